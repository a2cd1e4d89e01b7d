"""SFT: recipes, assistant-only labels, a run that learns, checkpoints, resume, QLoRA on CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kitchen import paths
from kitchen.config import KitchenError, load_model
from kitchen.files import write_jsonl
from kitchen.models import (
    IM_END,
    ModelSpec,
    adapter_names,
    build_tiny_model,
    render_chat,
    token_logprobs,
    train_tokenizer,
)
from kitchen.models import load_model as load_checkpoint
from kitchen.sft import (
    IGNORE,
    SFTRecipe,
    build_trainer,
    decision_mask,
    load_recipe,
    read_dialogues,
    resolve_paths,
    run_sft,
    schema,
    sft_main,
    weighted_token_loss,
)

from .test_models import CUISINES, MICRO, dialogues

MICRO_YAML = MICRO.model_dump()


@pytest.fixture
def data(tmp_path) -> dict[str, str]:
    """200 training and 16 held-out synthetic dialogues as JSONL, like the world writes them."""
    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    write_jsonl(train, [{"messages": m, "meta": {"task": i}} for i, m in enumerate(dialogues(200))])
    write_jsonl(held, [{"messages": m} for m in dialogues(16, seed=1)])
    return {"train": str(train), "eval": str(held)}


def tiny_recipe(tmp_path: Path, data: dict, **kw) -> SFTRecipe:
    fields = {
        "output_dir": str(tmp_path / "run"),
        "model": {"tiny": MICRO_YAML, "tokenizer": {"vocab_size": 512}},
        "data": data,
        "max_steps": 40,
        "batch_size": 8,
        "max_length": 256,
        "eval_every": 20,
        "save_every": 20,
        "log_every": 10,
    }
    return SFTRecipe.model_validate({**fields, **kw})


def test_assistant_only_labels_exclude_system_user_and_tool_tokens(tmp_path, data):
    """In the collated batch, exactly the assistant contents and their <|im_end|> carry labels;
    every system, user and tool token (and padding) is -100."""
    trainer, _ = build_trainer(resolve_paths(tiny_recipe(tmp_path, data)))
    tok = trainer.processing_class
    rows = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(rows)
    ids, labels = batch["input_ids"], batch["labels"]
    assert ids.shape == labels.shape and (labels == -100).any()
    for b in range(ids.shape[0]):
        learned = tok.decode(ids[b][labels[b] != -100])
        text = tok.decode(ids[b][batch["attention_mask"][b].bool()])
        assistant = [seg.split(IM_END)[0] for seg in text.split("<|im_start|>assistant\n")[1:]]
        assert learned == "".join(a + IM_END for a in assistant)
        assert learned.startswith("@search ") and "concierge" not in learned
        assert "I would like" not in learned and "none" not in learned.replace("no allergens", "")
    assert (labels[batch["attention_mask"] == 0] == -100).all()


def test_sft_run_learns_and_writes_hf_checkpoints(tmp_path, data):
    """120 steps on the micro model: held-out loss falls well below its start, the weights move,
    checkpoints and final/ are safetensors, final/ loads through ModelSpec, and the SFT policy
    emits a search action and stops at <|im_end|>."""
    recipe = tiny_recipe(
        tmp_path, data, max_steps=120, eval_every=60, save_every=60, group_by_length=True
    )
    logged: list[dict] = []
    result = run_sft(recipe, on_log=logged.append)
    losses = result.eval_losses
    assert len(losses) == 3  # before training, at step 60, at step 120
    # on_log saw every row as it was logged (what a notebook's live chart draws), with its step
    assert [r["eval_loss"] for r in logged if "eval_loss" in r] == losses
    assert [r["step"] for r in logged if "loss" in r] == list(range(10, 121, 10))
    assert losses[-1] < 0.5 * losses[0], losses

    out, final = result.output_dir, result.final_dir
    assert {"checkpoint-60", "checkpoint-120", "final", "recipe.yaml", "log.jsonl"} <= {
        p.name for p in out.iterdir()
    }
    assert (out / "checkpoint-60" / "model.safetensors").is_file()
    for name in ("model.safetensors", "config.json", "tokenizer.json", "recipe.yaml"):
        assert (final / name).is_file(), name
    saved = yaml.safe_load((final / "recipe.yaml").read_text())
    assert saved["max_steps"] == 120 and Path(saved["data"]["train"]).is_absolute()

    model, tok = load_checkpoint(ModelSpec(path=str(final), device="cpu"))
    init = build_tiny_model(tok, MICRO, seed=recipe.seed)  # the run's starting weights
    trained = load_file(final / "model.safetensors")
    w = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(trained[w], init.state_dict()[w])

    model.eval()
    asked = dialogues(1, seed=5)[0][:2]
    prompt = render_chat(asked, add_generation_prompt=True)
    enc = tok([prompt], return_tensors="pt")
    with torch.no_grad():
        seq = model.generate(**enc, max_new_tokens=16, do_sample=False)
    reply = tok.decode(seq[0, enc.input_ids.shape[1] :])
    assert reply.startswith("@search ") and reply.endswith(IM_END), reply
    assert reply[len("@search ") : -len(IM_END)] in CUISINES  # which one: RL's job, not 120 steps


def test_added_tokens_are_single_tokens_whose_rows_start_as_their_pieces_mean(tmp_path, data):
    """`model.add_tokens`: each string becomes one token, the text round-trips, the new embedding
    row is the mean of the rows of the pieces it replaces (so the model's first reading is its
    reading of the pieces), old rows are untouched, and adding them again adds nothing."""
    from kitchen.sft import add_tokens

    tok = train_tokenizer((render_chat(m) for m in dialogues(50)), 512)
    model = build_tiny_model(tok, MICRO, seed=0)
    old = model.get_input_embeddings().weight.detach().clone()
    strings = [" A1+", " T10-", "@search"]
    pieces = {s: tok(s, add_special_tokens=False)["input_ids"] for s in strings}
    multi = [s for s in strings if len(pieces[s]) > 1]
    assert " A1+" in multi and " T10-" in multi
    assert add_tokens(model, tok, strings) == len(multi)
    w = model.get_input_embeddings().weight
    assert w.shape[0] == len(tok) == model.config.vocab_size == old.shape[0] + len(multi)
    assert torch.equal(w[: old.shape[0]], old)
    for s in multi:
        ids = tok(s, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tok.decode(ids) == s
        assert torch.allclose(w[ids[0]], old[pieces[s]].mean(0))
    line = "t3 recommend Pad Thai; safe => A1+ T10- T1+"
    assert tok.decode(tok(line, add_special_tokens=False)["input_ids"]) == line
    assert add_tokens(model, tok, strings) == 0


def test_add_tokens_needs_a_base_trained_in_full(tmp_path, data):
    """A tiny build trains its own tokenizer and a LoRA would leave the new rows untrained:
    both are refused with the field named."""
    for model in (
        {"tiny": MICRO_YAML, "add_tokens": [" A1+"]},
        {"base": {"path": "x", "lora": {"r": 4}}, "add_tokens": [" A1+"]},
    ):
        with pytest.raises(ValueError, match="add_tokens"):
            tiny_recipe(tmp_path, data, model=model)


def test_a_copy_warmup_runs_before_sft_is_saved_and_reused(tmp_path, data, monkeypatch):
    """`copy_warmup:` warms the fresh model before SFT: SFT starts from the warmed weights,
    which are saved in copy_warmup/ with their log; a second run in the same folder reuses them
    without warming again, and a changed warm-up warms anew."""
    warm = {"steps": 60, "batch_size": 8, "min_run": 2, "max_run": 6}
    model = {"tiny": MICRO_YAML, "tokenizer": {"vocab_size": 512}, "copy_warmup": warm}
    recipe = resolve_paths(tiny_recipe(tmp_path, data, model=model))
    trainer, _ = build_trainer(recipe)
    folder = tmp_path / "run" / "copy_warmup"
    log = [yaml.safe_load(line) for line in (folder / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [50, 60]
    made = yaml.safe_load((folder / "warmup.json").read_text())
    assert made["made_with"]["copy_warmup"]["steps"] == 60 and made["copy_loss"] > 0
    saved = load_file(folder / "model.safetensors")
    init = build_tiny_model(trainer.processing_class, MICRO, seed=recipe.seed).state_dict()
    w = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(trainer.model.state_dict()[w], saved[w])
    assert not torch.equal(saved[w], init[w])

    def no_warm_up(*a, **kw):
        raise AssertionError("a finished warm-up was redone")

    monkeypatch.setattr("kitchen.sft.warm_up", no_warm_up)
    again, _ = build_trainer(recipe)
    assert torch.equal(again.model.state_dict()[w], saved[w])

    monkeypatch.undo()
    model["copy_warmup"] = {**warm, "steps": 10}
    other, _ = build_trainer(resolve_paths(tiny_recipe(tmp_path, data, model=model)))
    assert not torch.equal(other.model.state_dict()[w], saved[w])
    assert (
        yaml.safe_load((folder / "warmup.json").read_text())["made_with"]["copy_warmup"]["steps"]
        == 10
    )


def test_a_copy_warmup_is_for_a_tiny_model_only(tmp_path, data):
    with pytest.raises(ValueError, match="copy_warmup.*tiny"):
        tiny_recipe(tmp_path, data, model={"base": {"path": "x"}, "copy_warmup": {}})


def test_resume_continues_from_the_checkpoint_and_matches_an_uninterrupted_run(tmp_path, data):
    """Interrupt after checkpoint-4 of 8 steps, resume: the final weights equal those of the
    uninterrupted run (same data order, RNG and optimiser state — and the seed makes runs
    deterministic). A fresh run will not overwrite a run; a resume needs a checkpoint."""
    recipe = tiny_recipe(tmp_path, data, max_steps=8, save_every=4, eval_every=4)
    with pytest.raises(KitchenError, match="no checkpoint to resume"):
        run_sft(recipe, resume=True)
    first = run_sft(recipe)
    want = load_file(first.final_dir / "model.safetensors")
    shutil.rmtree(first.output_dir / "checkpoint-8")
    shutil.rmtree(first.final_dir)
    with pytest.raises(KitchenError, match="already holds a run"):
        run_sft(recipe)
    again = run_sft(recipe, resume=True)
    got = load_file(again.final_dir / "model.safetensors")
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert [r["step"] for r in again.log if "eval_loss" in r] == [0, 4, 8]

    changed = recipe.model_copy(
        update={"model": recipe.model.model_copy(update={"tiny": MICRO.model_copy(
            update={"num_layers": 3})})}
    )  # fmt: skip
    with pytest.raises(KitchenError, match="`model` section differs"):
        run_sft(changed, resume=True)


def test_qlora_sft_on_cpu_saves_an_adapter_that_loads(tmp_path, data):
    """Fine-tune a saved base with nf4 + LoRA on CPU: LoRA weights stay float32, move, and
    final/ is a peft adapter folder that ModelSpec(path=final) loads onto its base."""
    pytest.importorskip("bitsandbytes")
    texts = [render_chat(m) for m in dialogues(200)]
    tok = train_tokenizer(texts, 512)
    base = tmp_path / "base"
    build_tiny_model(tok, MICRO).save_pretrained(base)
    tok.save_pretrained(base)
    recipe = SFTRecipe.model_validate(
        {
            "output_dir": str(tmp_path / "q"),
            "model": {"base": {"path": str(base), "quantization": "nf4", "device": "cpu",
                               "lora": {"r": 8}}},
            "data": data, "max_steps": 6, "batch_size": 8, "max_length": 256,
            "eval_every": 3, "save_every": 6, "lr": 5e-3,
        }
    )  # fmt: skip
    trainer, _ = build_trainer(resolve_paths(recipe))
    lora = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n and p.dtype == torch.float32 for n, p in lora.items())
    result = run_sft(recipe)
    final = result.final_dir
    assert (final / "adapter_config.json").is_file()
    assert (final / "adapter_model.safetensors").is_file()
    adapter = load_file(final / "adapter_model.safetensors")
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapter.items())  # B starts at 0
    model, _ = load_checkpoint(ModelSpec(path=str(final), quantization="nf4", device="cpu"))
    assert adapter_names(model) == ["policy"]


# ----------------------------------------------------------------------------------------------
# Recipes and data: mistakes are located


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_bad_recipes_name_file_line_and_fix(tmp_path, data):
    """Typos, impossible combinations and missing data files give PATH:LINE problems."""
    good = (
        f"output_dir: {tmp_path / 'run'}\n"
        "model:\n  tiny: {}\n"
        f"data:\n  train: {data['train']}\n  eval: {data['eval']}\n"
    )
    typo = write(tmp_path / "typo.yaml", good + "batch_sise: 8\n")
    with pytest.raises(KitchenError) as e:
        load_recipe(typo)
    (p,) = e.value.problems
    assert (p.path, p.line) == (str(typo), 7) and "did you mean 'batch_size'" in p.message

    both = write(
        tmp_path / "both.yaml", good.replace("  tiny: {}\n", "  tiny: {}\n  base: {path: x}\n")
    )
    with pytest.raises(KitchenError, match=r"both.yaml:2: model: give exactly one"):
        load_recipe(both)

    missing = write(tmp_path / "missing.yaml", good.replace(data["eval"], "nope/eval.jsonl"))
    with pytest.raises(KitchenError) as e:
        load_recipe(missing)
    (p,) = e.value.problems
    assert p.line == 6 and p.where == "data.eval" and "no such file" in p.message

    no_base = good.replace("  tiny: {}\n", "  base:\n    path: data/no-such-model\n")
    with pytest.raises(KitchenError) as e:
        load_recipe(write(tmp_path / "nobase.yaml", no_base))
    (p,) = e.value.problems
    assert (p.line, p.where) == (4, "model.base.path") and "no such folder" in p.message

    long = write(tmp_path / "long.yaml", good + "max_length: 4096\n")
    with pytest.raises(KitchenError, match="max_length 4096 exceeds"):
        load_recipe(long)
    with pytest.raises(KitchenError, match="no such file"):
        sft_main(tmp_path / "absent.yaml")


def test_bad_dialogue_rows_are_located(tmp_path):
    """A broken JSONL row names its file and line; an empty file is an error too."""
    f = tmp_path / "d.jsonl"
    f.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
        "\n"
        '{"messages": [{"role": "chef", "content": "hi"}]}\n'
        '{"messages": [{"role": "user", "content": "no reply"}]}\n'
        "not json\n"
    )
    with pytest.raises(KitchenError) as e:
        read_dialogues(f)
    assert [(p.line, p.where) for p in e.value.problems] == [
        (3, "messages[0]"),
        (4, "messages"),
        (5, "line"),
    ]
    assert read_dialogues(f, limit=1) == [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    ]
    empty = write(tmp_path / "e.jsonl", "\n")
    with pytest.raises(KitchenError, match="no dialogues"):
        read_dialogues(empty)


def test_shipped_tiny_recipe_is_valid_and_sized_for_cpu():
    """recipes/sft_tiny.yaml validates; its model is 1-3M parameters; paths resolve in the kit."""
    recipe = load_model(SFTRecipe, paths.RECIPES / "sft_tiny.yaml")
    assert 1_000_000 < recipe.model.tiny.parameter_count(recipe.model.tokenizer.vocab_size) < 3e6
    assert recipe.data.train == "data/sft/train.jsonl" and recipe.data.eval == "data/sft/eval.jsonl"
    assert recipe.learning_rate() == 3e-3
    s = schema()
    assert "model" in s["properties"] and s["title"] == "kitchen sft recipe"


def test_an_output_dir_that_is_a_file_or_a_shared_folder_is_refused_at_its_line(
    tmp_path, data, monkeypatch
):
    """A run never writes its checkpoints into a file's place or a shared folder (the runs
    folder itself, home): a located error at output_dir."""
    monkeypatch.setattr(paths, "RUNS", tmp_path / "runs")
    (tmp_path / "runs").mkdir()
    (tmp_path / "a-file").write_text("mine")
    for given, needle in ((tmp_path / "a-file", "is a file"), (".", "shared folder")):
        f = write(
            tmp_path / "r.yaml",
            f"output_dir: {given}\nmodel:\n  tiny: {{}}\ndata:\n  train: {data['train']}\n",
        )
        with pytest.raises(KitchenError) as e:
            load_recipe(f)
        (p,) = e.value.problems
        assert (p.line, p.where) == (1, "output_dir") and needle in p.message


def test_a_diverged_run_is_an_error_and_saves_no_final_model(tmp_path, data, monkeypatch):
    """A loss that turned NaN stops `run_sft` with an error at `lr` before final/ is written."""
    import kitchen.sft as sft

    class State:
        log_history = [{"loss": 2.0, "step": 1}, {"loss": float("nan"), "step": 2}]

    class Diverging:
        state = State()

        def add_callback(self, cb):
            pass

        def train(self, resume_from_checkpoint=None):
            pass

    monkeypatch.setattr(sft, "build_trainer", lambda recipe, resume=False: (Diverging(), None))
    recipe = tiny_recipe(tmp_path, data)
    with pytest.raises(KitchenError) as e:
        run_sft(recipe)
    (p,) = e.value.problems
    assert p.where == "lr" and "diverged: loss nan at step 2" in p.message
    assert not (Path(recipe.output_dir) / "final").exists()


def test_decision_mask_marks_the_first_token_of_the_turn_after_the_action():
    """Turns are runs of trained labels; a turn is marked (at its first token) when the turn
    before it opens with the whole `after` sequence, however many tokens that is."""
    X = IGNORE
    labels = torch.tensor(
        [
            [X, 7, 8, 2, X, X, 5, 6, 2, X, 9, 2, X, 7, 8, 2],  # a check, a decision, a check
            [X, 7, 2, X, 5, 2, X, X, 7, 9, 2, X, X, 3, 2, X],  # the first turn is too short
        ]
    )
    mask = decision_mask(labels, [7, 8])
    assert mask.nonzero().tolist() == [[0, 6]]
    assert decision_mask(labels, [7]).nonzero().tolist() == [[0, 6], [1, 4], [1, 13]]
    assert not decision_mask(labels, [4]).any()


def test_decision_weighted_loss_is_trls_loss_plus_the_extra_weight_on_decisions(tmp_path, data):
    """On a collated batch of the micro model: every assistant turn after an `@allergens` turn is
    marked once at its first token; with all weights 1 the weighted loss is TRL's own, with
    weight w it adds (w - 1) × the decisions' summed loss / N; evaluation is never weighted."""
    trainer, _ = build_trainer(resolve_paths(tiny_recipe(tmp_path, data, decision_weight=25)))
    tok = trainer.processing_class
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(8)])
    labels = batch["labels"]
    mask = decision_mask(labels, trainer.decision_ids)
    assert mask.sum(1).tolist() == [1] * 8  # each synthetic dialogue: one check, one decision
    assert set(tok.convert_ids_to_tokens(batch["input_ids"][mask].tolist())) == {"How"}

    model = trainer.model
    model.train()
    with torch.no_grad():
        weighted = trainer.compute_loss(model, dict(batch))
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        trainer.decision_weight = 1.0
        trls = trainer.compute_loss(model, dict(batch))
        logp, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"])
        trained = labels[:, 1:] != IGNORE
        ones = weighted_token_loss(logp, trained, torch.ones(trained.shape))
        n = (labels[:, 1:] != IGNORE).sum()
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:])
        per = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none"
        )
        decisions = per[mask[:, 1:]].sum()
        model.eval()
        trainer.decision_weight = 25.0
        evaluated = trainer.compute_loss(model, dict(batch))
    assert torch.allclose(ones, trls, atol=1e-5) and torch.allclose(ones, nll, atol=1e-5)
    assert torch.allclose(weighted, ones + 24 * decisions / n, atol=1e-5)
    assert weighted > 1.5 * ones and torch.allclose(evaluated, trls, atol=1e-5)
    # a wrapped model (DataParallel, DDP) goes through its own forward: the same loss
    model.train()
    trainer.accelerator.unwrap_model = lambda m, **_: None
    with torch.no_grad():
        wrapped = trainer.compute_loss(model, dict(batch))
    assert torch.allclose(wrapped, weighted, atol=1e-5)


def test_decision_weight_teaches_the_decision_faster(tmp_path):
    """Training by effect: dialogues where the turn after a check depends on its reply (a dish
    with no allergens is recommended, one with an allergen passed over). After the same 60 steps
    from the same start, the held-out loss on those decision tokens is lower with weight 30 than
    with plain assistant-only loss."""

    def graded(n: int, seed: int) -> list[list[dict]]:
        rows = dialogues(n, seed)
        for i, m in enumerate(rows):
            if i % 2:
                m[5] = {"role": "tool", "content": "peanut"}
                m[6] = {"role": "assistant", "content": "@search indian"}
        return rows

    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    write_jsonl(train, [{"messages": m} for m in graded(200, 0)])
    write_jsonl(held, [{"messages": m} for m in graded(32, 1)])
    losses = {}
    for w in (1, 30):
        recipe = tiny_recipe(
            tmp_path,
            {"train": str(train), "eval": str(held)},
            output_dir=str(tmp_path / f"run{w}"),
            max_steps=60,
            decision_weight=w,
        )
        trainer, _ = build_trainer(resolve_paths(recipe))
        trainer.train()
        batch = trainer.data_collator([trainer.eval_dataset[i] for i in range(32)])
        mask = decision_mask(batch["labels"], trainer.decision_ids)
        assert mask.sum() == 32
        trainer.model.eval()
        with torch.no_grad():
            logits = trainer.model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).logits
        per = torch.nn.functional.cross_entropy(
            logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none"
        )
        losses[w] = float(per[mask[:, 1:]].mean())
    assert losses[30] < 0.8 * losses[1], losses


def test_a_decision_weight_on_an_action_no_dialogue_takes_is_refused(tmp_path, data):
    """Weighing the turn after an action that never occurs would train nothing differently: a
    located error at decision_after."""
    recipe = tiny_recipe(tmp_path, data, decision_weight=5, decision_after="@book")
    with pytest.raises(KitchenError) as e:
        build_trainer(resolve_paths(recipe))
    (p,) = e.value.problems
    assert p.where == "decision_after" and "'@book'" in p.message
