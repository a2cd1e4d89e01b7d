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

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from kitchen.config import KitchenError, Problem
from kitchen.constitution import PersonalConstitution
from kitchen.files import atomic_write_json, read_jsonl, write_jsonl
from kitchen.grm import GRMConfig, build_prompt, format_review
from kitchen.judge import judge
from kitchen.review import ClauseVerdict, Review, overall_from
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
) -> dict[str, Any]:
    """One SFT row `{"messages": [system, user, assistant]}`: prompt → the judge's review."""
    target = with_labels(judge(traj, pc), labels or {})
    messages = build_prompt(traj, pc, cfg)
    return {
        "messages": messages + [{"role": "assistant", "content": format_review(target)}],
        "trajectory": traj.id,
    }


def write_grm_data(
    out_dir: str | os.PathLike,
    n_train: int = 4000,
    n_eval: int = 300,
    seed: int = 0,
    cfg: GRMConfig | None = None,
    policy_samples: Iterable[tuple[Trajectory, PersonalConstitution]] = (),
    labels: LabelSet | None = None,
) -> dict[str, Any]:
    """Write `train.jsonl` (train split) and `eval.jsonl` (held-out tasks and profiles).

    The training mix: 60% GRM-quirk scripted dialogues (every clause broken), 40% generic ones,
    plus every policy sample given. Human-labelled trajectories are added with their labels.
    """
    from kitchen.scripted import GRM_QUIRKS, SFT_QUIRKS, episodes

    cfg = cfg or GRMConfig()
    out = Path(out_dir)
    stats: dict[str, Any] = {}
    for name, split, n in (("train", "train", n_train), ("eval", "heldout", n_eval)):
        pairs = episodes(int(n * 0.6), split=split, seed=seed, quirks=GRM_QUIRKS)
        pairs += episodes(n - len(pairs), split=split, seed=seed + 1, quirks=SFT_QUIRKS)
        if name == "train":
            pairs += list(policy_samples)
        rows = [grm_example(t, pc, cfg) for t, pc in pairs]
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
        write_jsonl(out / f"{name}.jsonl", rows)
        stats[name] = {"examples": len(rows)}
    atomic_write_json(out / "stats.json", stats)
    return stats


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
