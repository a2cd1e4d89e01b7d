"""Rollouts: the fast engine path records what the policy really sampled, plays each episode the
same whatever its batch, matches `generate` when decoding is greedy, and falls back honestly."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch.testing import assert_close

from kitchen import paths
from kitchen.jobs import pair_jobs
from kitchen.models import LoraSpec, ModelSpec, load_model, token_logprobs
from kitchen.rollout import RolloutConfig, prompt_ids, rollout


@pytest.fixture(scope="module")
def policy():
    spec = ModelSpec(path=str(paths.DATA / "models" / "policy-tiny"), lora=LoraSpec(dropout=0.0))
    return load_model(spec)


@pytest.fixture(scope="module")
def jobs(concierge):
    return pair_jobs("train", 3, 0, concierge)


CFG = RolloutConfig(k=4, max_turns=5, max_new_tokens=40)


def turns(trajs):
    return [[(t.tokens, t.truncated, t.guarded, t.action.text) for t in x.turns] for x in trajs]


def teacher_forced_error(model, tok, trajs) -> float:
    """Largest |recorded − recomputed| log-prob over every trained turn of `trajs`."""
    worst = 0.0
    with torch.no_grad():
        for traj in trajs:
            for i, ti in enumerate(traj.turns):
                if not ti.tokens:
                    continue
                p = prompt_ids(tok, traj.prompt_messages(i))
                ids = torch.tensor([p + ti.tokens])
                lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
                got = torch.tensor(ti.logprobs)
                worst = max(worst, float((lp[0, len(p) - 1 :] - got).abs().max()))
    return worst


def test_fast_rollout_logprobs_equal_a_teacher_forced_recompute(policy, jobs):
    """Every turn's recorded log-probs equal a fresh forward over the re-rendered prompt and the
    recorded tokens (≤ 1e-4): the cache reused across turns held exactly that prompt."""
    model, tok = policy
    trajs, stats = rollout(model, tok, jobs, CFG, seed=3)
    assert stats.engine == "fast" and not stats.fallback
    assert stats.extra["engine/lora_merged"]
    assert sum(len(t.turns) for t in trajs) > len(trajs)  # multi-turn
    assert teacher_forced_error(model, tok, trajs) <= 1e-4
    assert stats.prefill_per_token > 0 and stats.tokens == sum(
        len(t.tokens or []) for x in trajs for t in x.turns
    )


def test_an_episode_plays_the_same_alone_as_in_its_batch(policy, jobs):
    """Fixed seeds: a batch of 12 episodes (ending at different turns) and the same episodes
    played one at a time (`batch_size=1`) give every episode the same tokens and texts — up to
    the float32 arithmetic of a batch: where a draw lands among tokens of probability < 1e-4
    (each a sliver of the CDF, as thin as the batch's rounding), the two may pick neighbours.
    So: episodes are identical until a draw in that tail, and most never make one."""
    model, tok = policy
    together, _ = rollout(model, tok, jobs, CFG, seed=5)
    alone, _ = rollout(model, tok, jobs, CFG.model_copy(update={"batch_size": 1}), seed=5)
    assert len({len(t.turns) for t in together}) > 1
    tail = math.log(1e-4)
    same = 0
    for a, b in zip(together, alone, strict=True):
        if turns([a]) == turns([b]):
            same += 1
            assert a.outcome == b.outcome
            continue
        x, y = next(
            ((x, y) for x, y in zip(a.turns, b.turns, strict=False) if x.tokens != y.tokens),
            (None, None),
        )
        assert x is not None, "one episode is a prefix of the other: not a sampling difference"
        j = next(
            (j for j, (u, v) in enumerate(zip(x.tokens, y.tokens, strict=False)) if u != v), None
        )
        assert j is not None, "one turn is a prefix of the other: not a sampling difference"
        assert x.logprobs[j] < tail and y.logprobs[j] < tail, (x.logprobs[j], y.logprobs[j])
    assert same >= len(together) - 2


@pytest.mark.parametrize("engine", ["fast", "generate"])
def test_progress_bar_counts_every_finished_episode(policy, jobs, engine, capsys):
    """`progress=` shows a bar of finished episodes that ends at the number played, on both
    paths; without it nothing is printed."""
    model, tok = policy
    cfg = CFG.model_copy(update={"engine": engine, "k": 2, "max_turns": 3})
    rollout(model, tok, jobs, cfg, seed=2, progress="playing")
    err = capsys.readouterr().err
    assert "playing" in err and f"{2 * len(jobs)}/{2 * len(jobs)}" in err
    rollout(model, tok, jobs, cfg, seed=2)
    assert "playing" not in capsys.readouterr().err


def test_greedy_rollouts_equal_the_generate_path(policy, jobs):
    """At a temperature so low that sampling is argmax, the fast path and `generate` play the same
    episodes: same tokens, texts and truncation flags, log-probs within 1e-4."""
    model, tok = policy
    cfg = CFG.model_copy(update={"temperature": 1e-4})
    fast, fs = rollout(model, tok, jobs, cfg, seed=1)
    slow, ss = rollout(model, tok, jobs, cfg.model_copy(update={"engine": "generate"}), seed=1)
    assert fs.engine == "fast" and ss.engine == "generate"
    assert turns(fast) == turns(slow)
    for a, b in zip(fast, slow, strict=True):
        for x, y in zip(a.turns, b.turns, strict=True):
            assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
    assert fs.prefill_tokens < ss.prefill_tokens / 2  # no re-reading of the dialogue


class BlockFirst:
    """A guard that blocks every turn's first candidate (and logs it), as `AxiomGuard` would."""

    budget, fallback = 2, "Sorry, I can't do that."

    def __init__(self):
        self.log, self.seen = [], {}

    def violations(self, traj, text):
        turn = len(traj.turns)
        self.seen[turn] = self.seen.get(turn, 0) + 1
        return [("A0", "first try")] if self.seen[turn] == 1 else []


def test_the_guard_regenerates_on_the_fast_path(policy, jobs):
    """A blocked candidate is regenerated from the same prompt (the cache rolls back to it): every
    turn is blocked once, logged, and the accepted actions' log-probs still equal a recompute."""
    model, tok = policy
    guards: list[BlockFirst] = []

    def make(pc):
        guards.append(BlockFirst())
        return guards[-1]

    cfg = CFG.model_copy(update={"k": 1})
    trajs, stats = rollout(model, tok, jobs, cfg, seed=2, guard=make)
    played = sum(len(t.turns) for t in trajs)
    assert stats.extra["guard/blocked"] == played
    assert all(i.outcome == "regenerated" for g in guards for i in g.log)
    assert not any(t.guarded for x in trajs for t in x.turns)
    assert teacher_forced_error(model, tok, trajs) <= 1e-4
    for x in trajs:  # each blocked candidate is kept on its trajectory, with the policy's tokens
        assert [b.turn for b in x.blocked] == list(range(len(x.turns)))
        assert all(b.tokens and len(b.logprobs) == len(b.tokens) for b in x.blocked)
        assert all(b.clauses == ["A0"] and b.attempt == 0 for b in x.blocked)


def test_guarded_plays_only_the_first_samples_of_each_job_behind_the_guard(policy, jobs):
    """`guarded=1` with K = 3: each job's first sample meets the guard at every turn, the other
    two play every candidate they sample."""
    model, tok = policy
    trajs, stats = rollout(
        model,
        tok,
        jobs,
        CFG.model_copy(update={"k": 3}),
        seed=2,
        guard=lambda pc: BlockFirst(),
        guarded=1,
    )
    behind = [x for i, x in enumerate(trajs) if i % 3 == 0]
    free = [x for i, x in enumerate(trajs) if i % 3 != 0]
    assert all(len(x.blocked) == len(x.turns) > 0 for x in behind)
    assert free and not any(x.blocked for x in free)
    assert stats.extra["guard/blocked"] == sum(len(x.turns) for x in behind)


def test_stop_strings_end_a_turn_untruncated(policy, jobs):
    """A stop string ends a turn on the fast path: the text contains it, and the turn is not
    marked truncated."""
    model, tok = policy
    cfg = CFG.model_copy(update={"stop_strings": ["?"], "k": 2})
    trajs, _ = rollout(model, tok, jobs, cfg, seed=4)
    stopped = [t for x in trajs for t in x.turns if t.tokens and t.tokens[-1] != tok.eos_token_id]
    assert stopped and all(not t.truncated for t in stopped if "?" in tok.decode(t.tokens))


def test_a_model_the_engine_cannot_serve_falls_back_with_its_reason(policy, jobs, caplog):
    """Unsupported: the rollout runs on `generate`, says why in its stats and logs it."""
    model, tok = load_model(ModelSpec(path=str(paths.DATA / "models" / "policy-tiny")))
    model.generation_config.repetition_penalty = 1.1
    with caplog.at_level(logging.WARNING, logger="kitchen.engine"):
        trajs, stats = rollout(model, tok, jobs[:1], CFG.model_copy(update={"k": 2}), seed=0)
    assert stats.engine == "generate" and "repetition_penalty" in stats.fallback
    assert any("repetition_penalty" in r.message for r in caplog.records)
    assert all(t.turns for t in trajs)


def test_lora_still_trains_after_a_fast_rollout(policy, jobs):
    """generate → train with the adapter merged during the rollout: the base weights come back
    bit for bit, and a REINFORCE-style loss on the rollout's tokens gives the LoRA B matrices
    non-zero gradients."""
    model, tok = policy
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "base_layer" in n}
    trajs, _ = rollout(model, tok, jobs[:1], CFG.model_copy(update={"k": 2}), seed=7)
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    model.train()
    model.zero_grad()
    traj = trajs[0]
    ti = traj.turns[0]
    p = prompt_ids(tok, traj.prompt_messages(0))
    ids = torch.tensor([p + ti.tokens])
    lp, _ = token_logprobs(model, ids, torch.ones_like(ids))
    (-lp[0, len(p) - 1 :].sum()).backward()
    grads = [q.grad for n, q in model.named_parameters() if "lora_B" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads)
    model.zero_grad()


def test_prompt_tokens_equal_whole_prompt_tokenization(policy):
    """Tokenizing a prompt piece by piece between added tokens gives the ids of tokenizing it
    whole, for dialogues with unicode, digits, look-alike and real special tokens in content."""
    from kitchen.rollout import PromptTokens

    _, tok = policy
    pieces = PromptTokens(tok)
    assert pieces.split is not None
    messages = [{"role": "system", "content": "Concierge 12.50$ — naïve café 😀"}]
    for text in ("@search thai", "< |im_end| > fake", "real <|im_end|> inside", "  spaces\n\nx"):
        messages += [
            {"role": "assistant", "content": text},
            {"role": "tool", "content": text[::-1]},
        ]
        assert pieces(messages, "e") == prompt_ids(tok, messages)
    assert len(pieces.pieces) > 4  # pieces were remembered, not re-tokenized
