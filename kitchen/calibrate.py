"""The GRM against its ground truths: training data, human labels, and the calibration report.

Seed 001 (§4, module 2) trains a GRM in three stages: build the rules and the judging data, train
the critique, then calibrate against real human preferences. Seed 000 (step 4) adds: sample the
GRM's reviews against human reviews regularly, and when they disagree, find out whether the clause
is ambiguous or the GRM is wrong.

- **Training data** — (personal constitution, trajectory) → review text, labelled by the
  independent rule judge (`kitchen.judge`), over scripted dialogues that break every clause
  (`kitchen.scripted.GRM_QUIRKS`), generic ones (`SFT_QUIRKS`) and, when a policy is given, that
  policy's own samples. Human labels (`data/labels/*.jsonl`) override the judge where present.
- **Calibration** — per-clause accuracy, Cohen's kappa and the confusion matrix of the GRM
  against the judge on held-out tasks and profiles, and against human labels when there are any;
  the parse-failure rate; and what voting over several samples gains.

Cohen's kappa is computed here (five lines) rather than importing scikit-learn for it:

    κ = (p_o − p_e) / (1 − p_e),  p_o = Σ_k C_kk / N,  p_e = Σ_k (Σ_j C_kj)(Σ_j C_jk) / N²

with C the confusion matrix over {pass, violate, n/a}. κ = 1 is perfect agreement, 0 is chance.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from kitchen import paths
from kitchen.config import KitchenError, Problem, StrictModel, read_yaml, validate_doc
from kitchen.constitution import PersonalConstitution
from kitchen.files import atomic_write_json, atomic_write_text, read_jsonl, write_jsonl
from kitchen.grm import GRM, GRMConfig, build_prompt, format_review, turn_facts
from kitchen.judge import judge
from kitchen.models import ModelSpec
from kitchen.review import ClauseVerdict, Review, overall_from
from kitchen.sft import SFTData, SFTRecipe
from kitchen.world import Trajectory

CLASSES = ("pass", "violate", "n/a")


class HumanLabel(BaseModel):
    """A person's verdict on one (trajectory, turn, clause)."""

    trajectory: str
    turn: int = Field(ge=0)
    clause: str
    verdict: Literal["pass", "violate", "n/a"]
    annotator: str = "anonymous"
    agrees_with: str | None = Field(
        None,
        description="'grm' or 'judge' when given as agree/disagree with that reviewer's verdict.",
    )


class LabelSet(BaseModel):
    """Human labels and the trajectories (and personal constitutions) they refer to."""

    labels: list[HumanLabel] = Field(default_factory=list)
    trajectories: dict[str, Trajectory] = Field(default_factory=dict)
    constitutions: dict[str, PersonalConstitution] = Field(default_factory=dict)

    def for_trajectory(self, traj_id: str) -> dict[tuple[int, str], str]:
        return {(x.turn, x.clause): x.verdict for x in self.labels if x.trajectory == traj_id}


def load_labels(folder: str | os.PathLike) -> LabelSet:
    """Read `labels.jsonl` and `trajectories.jsonl` from a labels folder (missing: empty set)."""
    folder = Path(folder)
    out = LabelSet()
    tp = folder / "trajectories.jsonl"
    if tp.exists():
        for n, row in enumerate(read_jsonl(tp), start=1):
            try:
                traj = Trajectory.model_validate(row["trajectory"])
                out.trajectories[traj.id] = traj
                out.constitutions[traj.id] = PersonalConstitution.model_validate(
                    row["constitution"]
                )
            except (KeyError, ValueError) as e:
                raise KitchenError(
                    [Problem(str(tp), n, "row", f"not a labelled trajectory: {e}".splitlines()[0])]
                ) from None
    lp = folder / "labels.jsonl"
    if lp.exists():
        for n, row in enumerate(read_jsonl(lp), start=1):
            try:
                out.labels.append(HumanLabel.model_validate(row))
            except ValueError as e:
                raise KitchenError([Problem(str(lp), n, "row", str(e).splitlines()[0])]) from None
    return out


def save_label(
    folder: str | os.PathLike, label: HumanLabel, traj: Trajectory, pc: PersonalConstitution
) -> None:
    """Append one label (and its trajectory, the first time) to a labels folder, atomically."""
    folder = Path(folder)
    known = (
        {r["trajectory"]["id"] for r in read_jsonl(folder / "trajectories.jsonl")}
        if (folder / "trajectories.jsonl").exists()
        else set()
    )
    if traj.id not in known:
        write_jsonl(
            folder / "trajectories.jsonl",
            [
                {
                    "trajectory": traj.model_dump(mode="json"),
                    "constitution": pc.model_dump(mode="json"),
                }
            ],
            append=True,
        )
    write_jsonl(folder / "labels.jsonl", [label.model_dump(mode="json")], append=True)


def with_labels(review: Review, labels: dict[tuple[int, str], str]) -> Review:
    """`review` with human verdicts replacing its own where a person labelled the cell."""
    if not labels:
        return review
    out = [
        ClauseVerdict(
            turn=v.turn,
            clause=v.clause,
            verdict=labels[(v.turn, v.clause)],
            reason=v.reason if labels[(v.turn, v.clause)] == v.verdict else "per a human label",
        )
        if (v.turn, v.clause) in labels
        else v
        for v in review.verdicts
    ]
    return review.model_copy(update={"verdicts": out, "overall": overall_from(out)})


# --------------------------------------------------------------------------------------------
# Training data


def grm_example(
    traj: Trajectory,
    pc: PersonalConstitution,
    cfg: GRMConfig,
    labels: dict[tuple[int, str], str] | None = None,
    *,
    first: int = 0,
    last: int | None = None,
    tool_mode: Literal["full", "names"] = "full",
    clip: int | None = None,
) -> dict[str, Any]:
    """One SFT row `{"messages": [system, user, assistant]}`: prompt → the judge's review.

    `first`, `last`, `tool_mode` and `clip` render the prompt as the truncation rule does for a
    long trajectory (`kitchen.grm.plan_windows`); the target then covers turns `first..last`.
    """
    target = with_labels(judge(traj, pc), labels or {})
    messages = build_prompt(traj, pc, cfg, first=first, last=last, tool_mode=tool_mode, clip=clip)
    text = format_review(target, facts=turn_facts(traj), first=first, last=last)
    return {
        "messages": messages + [{"role": "assistant", "content": text}],
        "trajectory": traj.id,
    }


#: Scripted agents the training mix draws from (`kitchen.scripted`).
QUIRK_PRESETS = ("grm", "sft", "ideal")
DEFAULT_MIX = {"grm": 0.6, "sft": 0.4}


def _quirks(name: str) -> Any:
    from kitchen.scripted import GRM_QUIRKS, IDEAL_QUIRKS, SFT_QUIRKS

    return {"grm": GRM_QUIRKS, "sft": SFT_QUIRKS, "ideal": IDEAL_QUIRKS}[name]


def scripted_mix(
    n: int, split: Literal["train", "heldout"], seed: int, mix: dict[str, float]
) -> list[tuple[Trajectory, PersonalConstitution, str]]:
    """`n` scripted episodes of `split`, shared among the agents of `mix` by weight:
    [(trajectory, personal constitution, agent name)]."""
    from kitchen.scripted import episodes

    total = sum(mix.values())
    names = [k for k in mix if mix[k] > 0]
    counts = [int(n * mix[k] / total) for k in names]
    counts[0] += n - sum(counts)
    out = []
    for j, (name, k) in enumerate(zip(names, counts, strict=True)):
        for traj, pc in episodes(k, split=split, seed=seed + j, quirks=_quirks(name)):
            out.append((traj, pc, name))
    return out


def _augmented(
    traj: Trajectory, pc: PersonalConstitution, cfg: GRMConfig, rng: random.Random
) -> dict[str, Any]:
    """A training row rendered as the truncation rule renders long trajectories: tool outputs
    cut to dish names, clipped messages, or one window of the later turns."""
    n = len(traj.turns)
    choice = rng.choice(["names", "clip", "window"] if n > 1 else ["names", "clip"])
    if choice == "names":
        return grm_example(traj, pc, cfg, tool_mode="names")
    if choice == "clip":
        return grm_example(traj, pc, cfg, tool_mode="names", clip=12)
    first = rng.randrange(1, n)
    last = rng.randrange(first, n)
    return grm_example(traj, pc, cfg, first=first, last=last, tool_mode="names", clip=12)


def write_grm_data(
    out_dir: str | os.PathLike,
    n_train: int = 4000,
    n_eval: int = 300,
    seed: int = 0,
    cfg: GRMConfig | None = None,
    policy_samples: Iterable[tuple[Trajectory, PersonalConstitution]] = (),
    labels: LabelSet | None = None,
    *,
    mix: dict[str, float] | None = None,
    augment: float = 0.0,
) -> dict[str, Any]:
    """Write `train.jsonl` (train split) and `eval.jsonl` (held-out tasks and profiles).

    The training mix: scripted dialogues shared by `mix` (default 60% GRM-quirk dialogues that
    break every clause, 40% generic ones), plus every policy sample given; a share `augment` of
    the training rows is rendered as the truncation rule renders long trajectories.
    Human-labelled trajectories are added with their labels. `eval_trajectories.jsonl` keeps the
    held-out trajectories and constitutions, to measure agreement after training.
    """
    cfg = cfg or GRMConfig()
    mix = mix or DEFAULT_MIX
    out = Path(out_dir)
    rng = random.Random(f"grm-data:{seed}")
    stats: dict[str, Any] = {}
    for name, split, n in (("train", "train", n_train), ("eval", "heldout", n_eval)):
        triples = scripted_mix(n, split, seed, mix)
        pairs = [(t, pc) for t, pc, _ in triples]
        sources = Counter(src for _, _, src in triples)
        if name == "train":
            extra = list(policy_samples)
            pairs += extra
            sources["policy"] = len(extra)
        rows = [
            _augmented(t, pc, cfg, rng)
            if name == "train" and rng.random() < augment
            else grm_example(t, pc, cfg)
            for t, pc in pairs
        ]
        if name == "train" and labels:
            rows += [
                grm_example(
                    labels.trajectories[tid],
                    labels.constitutions[tid],
                    cfg,
                    labels.for_trajectory(tid),
                )
                for tid in labels.trajectories
            ]
            sources["human-labelled"] = len(labels.trajectories)
        write_jsonl(out / f"{name}.jsonl", rows)
        if name == "eval":
            write_jsonl(
                out / "eval_trajectories.jsonl",
                (
                    {
                        "trajectory": t.model_dump(mode="json"),
                        "constitution": pc.model_dump(mode="json"),
                    }
                    for t, pc in pairs
                ),
            )
        verdicts = Counter(v.verdict for t, pc in pairs for v in judge(t, pc).verdicts)
        stats[name] = {
            "examples": len(rows),
            "sources": dict(sources),
            "verdicts": dict(verdicts),
            "prompt_chars": sum(len(r["messages"][1]["content"]) for r in rows)
            // max(len(rows), 1),
            "review_chars": sum(len(r["messages"][2]["content"]) for r in rows)
            // max(len(rows), 1),
        }
    atomic_write_json(out / "stats.json", stats)
    return stats


def read_labelled(path: str | os.PathLike) -> list[tuple[Trajectory, PersonalConstitution]]:
    """(trajectory, personal constitution) pairs from a JSONL file of
    `{"trajectory": ..., "constitution": ...}` rows (`eval_trajectories.jsonl`, labels)."""
    return [
        (
            Trajectory.model_validate(row["trajectory"]),
            PersonalConstitution.model_validate(row["constitution"]),
        )
        for row in read_jsonl(path)
    ]


# --------------------------------------------------------------------------------------------
# Agreement


class ClauseAgreement(BaseModel):
    clause: str
    n: int
    accuracy: float
    kappa: float
    decided_accuracy: float = Field(description="Accuracy where the reference says pass/violate.")
    confusion: list[list[int]] = Field(
        description="rows: reference, cols: GRM; pass, violate, n/a, masked"
    )


class CalibrationReport(BaseModel):
    reference: str
    reviews: int
    cells: int
    accuracy: float
    decided_accuracy: float
    kappa: float
    parse_failure_rate: float = Field(description="Reviews with any masked verdict.")
    masked_rate: float = Field(description="Cells the GRM gave no verdict for.")
    clauses: list[ClauseAgreement]
    voting: dict[str, float] = Field(default_factory=dict)
    by_source: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="Agreement per data source (scripted agent, policy)."
    )
    command: str = ""

    def table(self) -> str:
        lines = [f"{'clause':8} {'n':>6} {'acc':>7} {'acc(p/v)':>9} {'kappa':>7}"]
        for c in self.clauses:
            lines.append(
                f"{c.clause:8} {c.n:6d} {c.accuracy:7.1%} {c.decided_accuracy:9.1%} {c.kappa:7.3f}"
            )
        lines.append(
            f"{'all':8} {self.cells:6d} {self.accuracy:7.1%} {self.decided_accuracy:9.1%} "
            f"{self.kappa:7.3f}"
        )
        lines.append(
            f"parse failures: {self.parse_failure_rate:.1%} of {self.reviews} reviews; "
            f"masked cells: {self.masked_rate:.2%}"
        )
        for k, v in self.voting.items():
            lines.append(f"voting {k}: {v:.1%}")
        return "\n".join(lines)


def cohen_kappa(confusion: Sequence[Sequence[int]]) -> float:
    """Cohen's kappa of a square confusion matrix (see the module docstring)."""
    k = len(confusion)
    n = sum(sum(row) for row in confusion)
    if n == 0:
        return 0.0
    p_o = sum(confusion[i][i] for i in range(k)) / n
    p_e = sum(sum(confusion[i]) * sum(confusion[j][i] for j in range(k)) for i in range(k)) / n**2
    return 1.0 if p_e == 1 else (p_o - p_e) / (1 - p_e)


def _confusion(pairs: Iterable[tuple[str, str | None]]) -> list[list[int]]:
    m = [[0] * 4 for _ in range(3)]
    for ref, got in pairs:
        m[CLASSES.index(ref)][3 if got is None else CLASSES.index(got)] += 1
    return m


def agreement(
    grm: Sequence[Review],
    reference: Sequence[Review | dict[tuple[int, str], str]],
    name: str = "judge",
) -> CalibrationReport:
    """Agreement of GRM reviews with reference reviews (or label dicts), clause by clause.

    Only cells the reference has a verdict for count (all cells of a judge review; the labelled
    cells of a human label dict). A masked GRM verdict counts as a disagreement.
    """
    per: dict[str, list[tuple[str, str | None]]] = {}
    failures = masked = cells = 0
    for g, ref in zip(grm, reference, strict=True):
        table = ref.table() if isinstance(ref, Review) else ref
        mine = g.table()
        failures += g.parsed_fraction < 1
        for (turn, clause), rv in table.items():
            if rv is None:
                continue
            got = mine.get((turn, clause))
            masked += got is None
            cells += 1
            per.setdefault(clause, []).append((rv, got))
    clauses = []
    for clause in sorted(per):
        pairs = per[clause]
        conf = _confusion(pairs)
        decided = [(r, g) for r, g in pairs if r != "n/a"]
        clauses.append(
            ClauseAgreement(
                clause=clause,
                n=len(pairs),
                accuracy=sum(r == g for r, g in pairs) / len(pairs),
                kappa=cohen_kappa([row[:3] for row in conf]),
                decided_accuracy=sum(r == g for r, g in decided) / len(decided) if decided else 1.0,
                confusion=conf,
            )
        )
    everything = [p for pairs in per.values() for p in pairs]
    decided = [(r, g) for r, g in everything if r != "n/a"]
    conf = _confusion(everything)
    return CalibrationReport(
        reference=name,
        reviews=len(grm),
        cells=cells,
        accuracy=sum(r == g for r, g in everything) / max(len(everything), 1),
        decided_accuracy=sum(r == g for r, g in decided) / max(len(decided), 1),
        kappa=cohen_kappa([row[:3] for row in conf]),
        parse_failure_rate=failures / max(len(grm), 1),
        masked_rate=masked / max(cells, 1),
        clauses=clauses,
    )


# --------------------------------------------------------------------------------------------
# Policy samples: what the GRM will actually review during RL


def policy_episodes(
    policy: str | Any,
    n: int,
    split: Literal["train", "heldout"],
    seed: int,
    temperature: float = 1.0,
) -> list[tuple[Trajectory, PersonalConstitution]]:
    """`n` rollouts of `policy` (a checkpoint path, or a loaded `(model, tokenizer)`) on `split`
    tasks and profiles, two per (task, profile): [(trajectory, personal constitution)]."""
    from kitchen.evaluate import EvalConfig, eval_jobs
    from kitchen.models import ModelSpec, load_model
    from kitchen.rollout import RolloutConfig, rollout

    if n <= 0:
        return []
    model, tok = load_model(ModelSpec(path=policy)) if isinstance(policy, str) else policy
    k = 2
    jobs = eval_jobs(EvalConfig(tasks=-(-n // k), samples=k, seed=seed), split=split)
    trajs, _ = rollout(
        model,
        tok,
        jobs,
        RolloutConfig(k=k, temperature=temperature),
        seed=seed,
        group_prefix=f"policy-{split}-{seed}:",
    )
    pcs = [pc for _, pc, _ in jobs for _ in range(k)]
    return list(zip(trajs, pcs, strict=True))[:n]


# --------------------------------------------------------------------------------------------
# `kitchen grm train RECIPE`


class GRMDataSettings(StrictModel):
    """What the GRM learns from: judge-labelled reviews of scripted and policy dialogues."""

    n_train: int = Field(
        6000, ge=1, description="Scripted training dialogues (train tasks and profiles)."
    )
    n_eval: int = Field(
        300,
        ge=1,
        description="Scripted held-out dialogues (held-out tasks and profiles): the eval loss "
        "and the agreement printed after training.",
    )
    seed: int = Field(0, description="Seeds the dialogues, the policy samples and the mix.")
    mix: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_MIX),
        description="Share of each scripted agent (grm: breaks every clause; sft: the generic "
        "cold-start agent; ideal: what the constitution asks for). Default 60% grm, 40% sft.",
    )
    augment: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of training rows rendered as the truncation rule renders long "
        "trajectories (dish names only, clipped messages, a window of turns). Default 0.",
    )
    policy: str | None = Field(
        None,
        description="A policy checkpoint whose rollouts on training tasks are added, judge-"
        "labelled (e.g. data/models/policy-tiny): the GRM then knows the text it will review in "
        "RL. Default none.",
    )
    policy_samples: int = Field(0, ge=0, description="How many rollouts of `policy` to add.")
    policy_temperature: float = Field(
        1.0, gt=0, description="Sampling temperature of those rollouts (1.0: as in RL)."
    )
    labels: str | None = Field(
        "data/labels",
        description="Human labels folder (`save_label`); labelled cells override the judge. "
        "A missing or empty folder adds nothing.",
    )
    reuse: str | None = Field(
        None,
        description="Train on the review data another run wrote (its run folder, e.g. "
        "runs/grm_tiny) instead of writing new data; the fields above are then not used. "
        "For a second training stage on the same data. Default: write the data.",
    )

    @model_validator(mode="after")
    def _check(self) -> GRMDataSettings:
        bad = sorted(set(self.mix) - set(QUIRK_PRESETS))
        if bad:
            raise ValueError(f"mix: unknown agent {bad[0]!r}; use {', '.join(QUIRK_PRESETS)}")
        if any(v < 0 for v in self.mix.values()) or sum(self.mix.values()) <= 0:
            raise ValueError("mix: shares must be >= 0 with a positive sum")
        if self.policy_samples and not self.policy:
            raise ValueError("policy_samples > 0 needs `policy:` (a checkpoint folder)")
        return self


class GRMTraining(SFTRecipe):
    """The SFT settings of the GRM (every field of `kitchen.sft.SFTRecipe`); `output_dir` and
    `data` are filled in by the GRM recipe and must be left out."""

    output_dir: str | None = Field(None, description="Leave out: the GRM recipe's output_dir.")
    data: SFTData | None = Field(
        None, description="Leave out: the review data the GRM recipe writes."
    )

    @model_validator(mode="after")
    def _filled_in(self) -> GRMTraining:
        if self.output_dir is not None or self.data is not None:
            raise ValueError(
                "sft.output_dir and sft.data are filled in by the GRM recipe; remove them"
            )
        return self


class GRMRecipe(StrictModel):
    """`kitchen grm train RECIPE`: build review data, train a GRM with `kitchen.sft`, install it."""

    output_dir: str = Field(
        description="Run folder (relative paths under runs/): data/, checkpoints, final/, log."
    )
    data: GRMDataSettings = Field(default_factory=GRMDataSettings)
    review: GRMConfig = Field(
        default_factory=GRMConfig,
        description="How prompts are rendered (clause_text) and budgeted; the same settings "
        "must be used when the GRM reviews.",
    )
    sft: GRMTraining
    install: str | None = Field(
        None,
        description="Copy final/ here in float16 (e.g. data/models/grm-tiny). Default: no copy.",
    )
    install_dtype: Literal["float16", "bfloat16", "float32"] = Field(
        "float16", description="Storage precision of the installed copy."
    )

    @model_validator(mode="after")
    def _fits(self) -> GRMRecipe:
        tiny = self.sft.model.tiny
        need = self.review.max_prompt_tokens + self.review.max_new_tokens
        if tiny is not None and need > tiny.max_positions:
            raise ValueError(
                f"review.max_prompt_tokens + review.max_new_tokens = {need} exceeds "
                f"sft.model.tiny.max_positions {tiny.max_positions}; lower a budget or raise "
                "max_positions"
            )
        return self

    def sft_recipe(self, out: Path) -> SFTRecipe:
        """The `kitchen.sft` recipe that trains the GRM on the data in `out/data`."""
        doc = self.sft.model_dump(exclude={"output_dir", "data"}) | {
            "output_dir": str(out),
            "data": {
                "train": str(out / "data" / "train.jsonl"),
                "eval": str(out / "data" / "eval.jsonl"),
                "max_eval": self.sft.data.max_eval if self.sft.data else 256,
            },
        }
        return SFTRecipe.model_validate(doc)


def grm_recipe_schema() -> dict[str, Any]:
    """JSON schema of GRM recipes (editor completion for recipes/grm_*.yaml)."""
    s = GRMRecipe.model_json_schema(by_alias=True)
    s["title"] = "kitchen grm recipe"
    return s


def load_grm_recipe(path: str | os.PathLike) -> GRMRecipe:
    """Read and validate a GRM recipe; problems are `PATH:LINE: field: what to fix`."""
    return validate_doc(GRMRecipe, read_yaml(path))


def _abs(path: str) -> Path:
    p = Path(path).expanduser()
    if p.is_absolute():
        return p
    return p if (Path.cwd() / p).exists() else paths.HOME / p


def grm_train_main(recipe_path: str | os.PathLike, *, resume: bool = False) -> int:
    """`kitchen grm train RECIPE [--resume]`: data → SFT → held-out agreement → install.

    With `--resume`, data already written (`data/stats.json`) is reused and the SFT run continues
    from its newest checkpoint. Prints the data statistics, the training time and losses, and the
    GRM's agreement with the judge on the held-out dialogues.
    """
    import time

    from kitchen.models import export_checkpoint, load_model
    from kitchen.sft import run_sft

    recipe = load_grm_recipe(recipe_path)
    out = Path(recipe.output_dir).expanduser()
    out = (out if out.is_absolute() else paths.RUNS / out).resolve()
    data_dir = out / "data"
    timings: dict[str, float] = {}
    if recipe.data.reuse:
        src = _abs(recipe.data.reuse) / "data"
        if not (src / "stats.json").is_file():
            raise KitchenError(
                f"data.reuse: {src} holds no review data (no stats.json); run that recipe first"
            )
        if not resume and (out / "final").exists():
            raise KitchenError(
                f"{out}: already holds a trained GRM; resume with --resume or choose another "
                "output_dir"
            )
        if src.resolve() != data_dir.resolve():
            data_dir.mkdir(parents=True, exist_ok=True)
            for name in ("train.jsonl", "eval.jsonl", "eval_trajectories.jsonl", "stats.json"):
                shutil.copy2(src / name, data_dir / name)
        stats = json.loads((data_dir / "stats.json").read_text())
        print(f"reusing the review data of {src}")
    elif resume and (data_dir / "stats.json").is_file():
        stats = json.loads((data_dir / "stats.json").read_text())
        print(f"reusing review data in {data_dir}")
    else:
        if not resume and (out / "final").exists():
            raise KitchenError(
                f"{out}: already holds a trained GRM; resume with --resume or choose another "
                "output_dir"
            )
        d = recipe.data
        start = time.perf_counter()
        samples = (
            policy_episodes(
                str(_abs(d.policy)), d.policy_samples, "train", d.seed, d.policy_temperature
            )
            if d.policy and d.policy_samples
            else []
        )
        timings["policy_samples_s"] = time.perf_counter() - start
        labels = load_labels(_abs(d.labels)) if d.labels else None
        stats = write_grm_data(
            data_dir,
            n_train=d.n_train,
            n_eval=d.n_eval,
            seed=d.seed,
            cfg=recipe.review,
            policy_samples=samples,
            labels=labels,
            mix=d.mix,
            augment=d.augment,
        )
        timings["data_s"] = time.perf_counter() - start
    atomic_write_text(out / "grm_recipe.yaml", Path(recipe_path).read_text())
    for name in ("train", "eval"):
        s = stats[name]
        print(
            f"{name}: {s['examples']} reviews from {s['sources']}; verdicts {s['verdicts']}; "
            f"~{s['prompt_chars']} prompt / {s['review_chars']} review characters"
        )

    start = time.perf_counter()
    result = run_sft(recipe.sft_recipe(out), resume=resume)
    timings["train_s"] = time.perf_counter() - start
    losses = result.eval_losses
    train_losses = [r["loss"] for r in result.log if "loss" in r]

    start = time.perf_counter()
    model, tok = load_model(ModelSpec(path=str(result.final_dir)))
    grm = GRM(model, tok, recipe.review)
    pairs = read_labelled(data_dir / "eval_trajectories.jsonl")
    reviews = grm.review([t for t, _ in pairs], [pc for _, pc in pairs])
    report = agreement(reviews, [judge(t, pc) for t, pc in pairs])
    timings["agreement_s"] = time.perf_counter() - start
    summary = {
        "recipe": str(recipe_path),
        "timings": timings,
        "eval_loss": losses,
        "train_loss_first_last": [train_losses[0], train_losses[-1]] if train_losses else [],
        "heldout_agreement": report.model_dump(mode="json"),
        "data": stats,
    }
    atomic_write_json(out / "summary.json", summary)
    if len(losses) >= 2:
        print(f"eval loss: {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(f"training: {timings['train_s'] / 60:.1f} min")
    print(f"held-out agreement with the judge ({len(pairs)} scripted dialogues, greedy):")
    print(report.table())
    if recipe.install:
        dst = export_checkpoint(result.final_dir, _abs(recipe.install), dtype=recipe.install_dtype)
        print(f"installed: {dst}")
    print(f"final model: {result.final_dir}")
    print(f"summary: {out / 'summary.json'}")
    return 0


# --------------------------------------------------------------------------------------------
# `kitchen grm calibrate`


def calibration_set(
    n: int, seed: int = 4242, policy: str | Any | None = "data/models/policy-tiny"
) -> list[tuple[Trajectory, PersonalConstitution, str]]:
    """`n` held-out (trajectory, personal constitution, source) triples, a third each from the
    clause-breaking scripted agent ("grm"), the generic one ("sft") and rollouts of `policy`
    ("policy"; its share goes to the scripted agents when `policy` is None). Held-out tasks and
    profiles only: nothing here was in the GRM's training data."""
    n_policy = n // 3 if policy is not None else 0
    n_scripted = n - n_policy
    out = scripted_mix(n_scripted, "heldout", seed, {"grm": 0.5, "sft": 0.5})
    if n_policy:
        pol = str(_abs(policy)) if isinstance(policy, str) else policy
        out += [(t, pc, "policy") for t, pc in policy_episodes(pol, n_policy, "heldout", seed)]
    return out


def _by_source(
    reviews: Sequence[Review], refs: Sequence[Review], sources: Sequence[str]
) -> dict[str, dict[str, float]]:
    out = {}
    for src in sorted(set(sources)):
        idx = [i for i, s in enumerate(sources) if s == src]
        rep = agreement([reviews[i] for i in idx], [refs[i] for i in idx])
        out[src] = {
            "reviews": len(idx),
            "accuracy": rep.accuracy,
            "decided_accuracy": rep.decided_accuracy,
            "kappa": rep.kappa,
        }
    return out


def confusion_table(report: CalibrationReport) -> str:
    """Each clause's confusion matrix on one line: for each reference verdict, the GRM's counts
    of pass / violate / n/a / masked."""
    lines = [f"confusion ({report.reference} verdict → GRM pass/violate/n-a/masked)"]
    for c in report.clauses:
        cells = "  ".join(
            f"{name}→[{' '.join(str(x) for x in row)}]"
            for name, row in zip(("pass", "viol", "n/a"), c.confusion, strict=True)
        )
        lines.append(f"  {c.clause:6} {cells}")
    return "\n".join(lines)


def grm_calibrate_main(
    grm: str | None = None,
    n: int = 200,
    votes: int = 5,
    labels: str | None = None,
    out: str | None = None,
    *,
    seed: int = 4242,
    temperature: float = 0.7,
    policy: str | None = "data/models/policy-tiny",
) -> int:
    """`kitchen grm calibrate`: the GRM against the judge on held-out data, and against human
    labels when the labels folder has any; parse failures; what voting gains.

    Voting: `votes` samples at `temperature`, majority per (turn, clause), against greedy
    decoding and against a single sample at that temperature (the vote's own first sample).
    """
    import time

    from kitchen.models import load_model

    cfg = GRMConfig() if grm is None else GRMConfig(model=grm)
    start = time.perf_counter()
    model, tok = load_model(ModelSpec(path=str(_abs(cfg.model))))
    reviewer = GRM(model, tok, cfg)
    pol = policy if policy and _abs(policy).exists() else None
    triples = calibration_set(n, seed, pol)
    trajs = [t for t, _, _ in triples]
    pcs = [pc for _, pc, _ in triples]
    sources = [s for _, _, s in triples]
    refs = [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]
    t0 = time.perf_counter()
    greedy = reviewer.review(trajs, pcs)
    greedy_s = time.perf_counter() - t0
    report = agreement(greedy, refs)
    report.by_source = _by_source(greedy, refs, sources)
    command = f"kitchen grm calibrate --n {n} --votes {votes}"
    command += f" --grm {grm}" if grm else ""
    report.command = command
    report.voting = {
        "greedy": report.accuracy,
        "greedy (pass/violate cells)": report.decided_accuracy,
    }
    if votes > 1:
        reviewer.cfg = cfg.model_copy(update={"samples": votes, "temperature": temperature})
        voted, samples = reviewer.review_with_samples(trajs, pcs)
        one = agreement([s[0] for s in samples], refs)
        many = agreement(voted, refs)
        report.voting |= {
            f"1 sample at T={temperature}": one.accuracy,
            f"1 sample at T={temperature} (pass/violate cells)": one.decided_accuracy,
            f"vote of {votes} at T={temperature}": many.accuracy,
            f"vote of {votes} at T={temperature} (pass/violate cells)": many.decided_accuracy,
            f"vote of {votes}: parse failures": many.parse_failure_rate,
        }
    human = judge_vs_human = None
    folder = _abs(labels or "data/labels")
    ls = load_labels(folder) if folder.is_dir() else LabelSet()
    if ls.labels:
        ids = [tid for tid in ls.trajectories if ls.for_trajectory(tid)]
        reviewer.cfg = cfg
        lt = [ls.trajectories[t] for t in ids]
        lpc = [ls.constitutions[t] for t in ids]
        marks = [ls.for_trajectory(t) for t in ids]
        human = agreement(reviewer.review(lt, lpc), marks, name="human")
        judge_vs_human = agreement(
            [judge(t, pc) for t, pc in zip(lt, lpc, strict=True)], marks, name="human"
        )
    seconds = time.perf_counter() - start

    print(
        f"GRM {cfg.model} vs the rule judge on {len(trajs)} held-out dialogues "
        f"({dict(Counter(sources))}); greedy reviews in {greedy_s:.0f} s"
    )
    print(report.table())
    for src, m in report.by_source.items():
        print(
            f"  {src:8} {m['reviews']:4d} reviews: acc {m['accuracy']:.1%}, "
            f"acc(p/v) {m['decided_accuracy']:.1%}, kappa {m['kappa']:.3f}"
        )
    print(confusion_table(report))
    if human is not None:
        print(f"\nvs human labels in {folder} ({human.cells} labelled cells):")
        print(human.table())
        print(f"the judge vs the same labels: acc {judge_vs_human.accuracy:.1%}")
    elif labels or folder.is_dir():
        print(f"no human labels in {folder}")
    print(f"({seconds:.0f} s in all)")
    if out:
        atomic_write_json(
            out,
            {
                "grm": cfg.model,
                "command": command,
                "judge": report.model_dump(mode="json"),
                "human": human.model_dump(mode="json") if human else None,
                "judge_vs_human": judge_vs_human.model_dump(mode="json")
                if judge_vs_human
                else None,
            },
        )
        print(f"report: {out}")
    return 0
