"""Independent evaluation: held-out tasks and profiles, scored by the rule judge, never the GRM.

docs/method.md#validation: training reward going up is not the model getting better — a policy
can overfit its reward model. So evaluation is decoupled from the training reward: held-out tasks
and profiles the trainer never saw, verdicts from the independent rule judge (`kitchen.judge`),
and four checks that must hold together:

1. **preference win rate** against the SFT policy on the same task, profile and seed, with a
   bootstrap confidence interval (the method asks for "clearly above 50%");
2. **clause compliance** per clause, with axiom violations counted separately (the goal is 0);
3. **personalisation** — for the same tasks, behaviour differs across profiles as their clauses
   ask: words per message for brief vs detailed diners, small talk before the recommendation for
   hurried vs relaxed diners, asking for the cuisine on ambiguous requests; and, before any
   RL, whether a policy reads the profile at all (`profile_swap`: the same dialogue, only the
   diner's verbosity changed, `kitchen eval --profile-swap N`);
4. **reward-hacking monitor** — the gap between the GRM's reward and the judge's reward for the
   same trajectories (computed by the trainer every iteration, see `reward_gap`).

A trajectory's judged score is `success + compliance`, with success ∈ {0, 1} from the world and
compliance ∈ [0, 1] the weight-averaged share of applicable verdicts that pass. Pairwise: the
higher score wins, equal scores tie (half a win).

Metrics of nothing are not numbers: a rate, a share or a mean over zero items — compliance of an
episode on which no clause applied, success over no episodes, valid actions over no turns — is
NaN (`mean`), JSON files hold `null` for it (`json_ready`), and tables print "no data" (`show`).
A report that read 1.0 for a run whose episodes all ended before their first turn would
describe a perfect policy that never acted.

Departures from the method (docs/method.md#validation):
1. An episode judged on nothing (no clause applied, e.g. it ended before its first turn) counts
   compliance 0 in its judged score: pairwise comparisons need a number, and an episode that did
   nothing must not beat one that did something imperfectly.
"""

from __future__ import annotations

import math
import random
import re
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, Field

from kitchen.config import KitchenError, Problem, StrictModel
from kitchen.constitution import PersonalConstitution
from kitchen.judge import judge
from kitchen.review import SCORE, Review, turn_rewards
from kitchen.world import Task, Trajectory, asks_cuisine, load_menu, word_count


def mean(values: Iterable[float]) -> float:
    """The mean of `values`, NaN when there are none: a mean over nothing is not a number."""
    xs = list(values)
    return statistics.fmean(xs) if xs else math.nan


def share(hits: float, total: float) -> float:
    """`hits / total`, NaN when `total` is 0 (a rate over nothing)."""
    return hits / total if total else math.nan


def no_data(x: Any) -> bool:
    """True for a metric that was computed over nothing (None or NaN)."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def show(x: Any, spec: str = ".3f") -> str:
    """`x` formatted with `spec`, or "no data" for a metric over nothing."""
    return "no data" if no_data(x) else format(x, spec)


def json_ready(obj: Any) -> Any:
    """`obj` with every NaN and infinity replaced by None, so JSON files hold `null` for a
    metric over nothing (Python's json would write `NaN`, which is not JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_ready(v) for v in obj]
    return obj


class EvalConfig(StrictModel):
    """What evaluation plays. Defaults: about 2 minutes for the tiny policy on a CPU."""

    tasks: int = Field(30, ge=1, le=10_000, description="Held-out tasks (at most 10,000).")
    samples: int = Field(
        2,
        ge=1,
        le=256,
        description="Episodes per (task, profile): more narrows the win-rate interval. At most "
        "256.",
    )
    seed: int = Field(
        1234,
        ge=0,
        le=2**32 - 1,
        description="Seeds the task draw, the pairing and the sampling. In [0, 2^32).",
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the policy.")
    bootstrap: int = Field(
        2000, ge=100, le=1_000_000, description="Bootstrap resamples for intervals."
    )
    long_share: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Share of the held-out tasks that are multi-course meals (long tasks, "
        "played with a 24-turn budget). 0 = single dishes only, as before meals existed.",
    )


def eval_jobs(
    cfg: EvalConfig,
    constitution: Any = None,
    split: Literal["train", "heldout"] = "heldout",
    diners: Literal["train", "heldout"] | None = None,
) -> list[tuple[Task, PersonalConstitution, dict[str, Any]]]:
    """Held-out (task, personal constitution, diner values) jobs: every held-out profile meets
    tasks that some dish fits for it. Deterministic in `cfg.seed`.

    `split="train"` draws the same kind of jobs from the training tasks and profiles instead
    (e.g. policy samples for GRM training data, which must not see the held-out set). `diners`
    takes the profiles from another split than the tasks (e.g. held-out tasks with the training
    diners: does a policy read a profile, or remember the ones it trained with?)."""
    from kitchen import paths
    from kitchen.constitution import PersonalizationCache, load_constitution
    from kitchen.profile import split_profiles
    from kitchen.world import feasible, generate_tasks

    c = constitution or load_constitution(paths.DEFAULT_CONSTITUTION)
    profiles = split_profiles(diners or split)
    cache = PersonalizationCache()
    menu = load_menu()
    jobs = []
    for task in generate_tasks(
        cfg.tasks * 4, seed=cfg.seed, split=split, long_share=cfg.long_share
    ):
        if len(jobs) == cfg.tasks:
            break
        profile = profiles[len(jobs) % len(profiles)]  # every held-out profile in turn
        job = make_job(task, profile, c, cache)
        diner = job[2]
        if feasible(menu, task, diner.get("allergies") or [], diner.get("diet") == "vegetarian"):
            jobs.append(job)
    return jobs


def make_job(
    task: Task, profile: Any, constitution: Any = None, cache: Any = None
) -> tuple[Task, PersonalConstitution, dict[str, Any]]:
    """One (task, personal constitution, diner values) job for `profile`: the policy and the
    judge see the personal constitution's (effective) dimensions; the simulated diner holds the
    profile's real values, low-confidence ones included."""
    from kitchen import paths
    from kitchen.constitution import PersonalizationCache, load_constitution
    from kitchen.profile import redact

    c = constitution or load_constitution(paths.DEFAULT_CONSTITUTION)
    pc = (cache or PersonalizationCache()).get(c, profile)
    real = {k: v.value for k, v in redact(profile).dimensions.items()}
    diner = pc.dimensions | {k: v for k, v in real.items() if k in pc.dimensions}
    return task, pc, diner


def compliance(review: Review, pc: PersonalConstitution) -> float:
    """Weight-averaged share of applicable verdicts that pass, in [0, 1]; NaN when none apply
    (an episode judged on nothing has no compliance, good or bad)."""
    weights = {c.id: c.weight for c in pc.clauses}
    num = den = 0.0
    for v in review.verdicts:
        if v.verdict in SCORE:
            w = weights.get(v.clause, 1.0)
            num += w * (v.verdict == "pass")
            den += w
    return share(num, den)


def judged_scores(
    trajs: Sequence[Trajectory],
    pcs: Sequence[PersonalConstitution],
    reviews: Sequence[Review] | None = None,
) -> list[float]:
    """Each trajectory's `success + compliance`; compliance over nothing counts 0 (departure 1)."""
    reviews = reviews or [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]
    out = []
    for t, r, pc in zip(trajs, reviews, pcs, strict=True):
        c = compliance(r, pc)
        out.append((t.outcome.success if t.outcome else 0) + (0.0 if math.isnan(c) else c))
    return out


def bootstrap_interval(
    values: Sequence[float], n: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """(mean, low, high): percentile bootstrap interval of the mean; NaNs for no values."""
    if not values:
        return math.nan, math.nan, math.nan
    rng = random.Random(seed)
    k = len(values)
    means = sorted(sum(rng.choice(values) for _ in range(k)) / k for _ in range(n))
    lo, hi = means[int((1 - level) / 2 * n)], means[min(n - 1, int((1 + level) / 2 * n))]
    return sum(values) / k, lo, hi


def win_rate(
    a: Sequence[float], b: Sequence[float], n: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Pairwise win rate of `a` over `b` (ties count half) with a bootstrap 95% interval."""
    outcomes = [1.0 if x > y else 0.5 if x == y else 0.0 for x, y in zip(a, b, strict=True)]
    return bootstrap_interval(outcomes, n=n, seed=seed)


def compliance_difference(
    a: Sequence[Trajectory],
    b: Sequence[Trajectory],
    pcs: Sequence[PersonalConstitution],
    n: int = 2000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """Paired held-out compliance of `a` minus `b` (the same jobs and seeds, episode i of each),
    with a bootstrap 95% interval over episodes:

        Δ = (1/N) Σ_i [c(a_i) − c(b_i)],   c = an episode's judged compliance,

    over the N episodes where some clause applied in both. NaNs for no such episode."""
    diffs = []
    for x, y, pc in zip(a, b, pcs, strict=True):
        cx, cy = compliance(judge(x, pc), pc), compliance(judge(y, pc), pc)
        if not (math.isnan(cx) or math.isnan(cy)):
            diffs.append(cx - cy)
    return bootstrap_interval(diffs, n=n, seed=seed)


class PolicyReport(BaseModel):
    """How one policy does on the held-out set, judged by rules. Rates over nothing are NaN:
    `success` with no episodes, `valid_actions` and `truncated` with no turns, `compliance` when
    no episode had an applicable verdict."""

    episodes: int
    success: float
    valid_actions: float = Field(description="Share of assistant turns that parse as actions.")
    truncated: float
    compliance: float = Field(
        description="Mean compliance over the episodes on which some clause applied."
    )
    axiom_violations: int
    clause_pass: dict[str, float]
    clause_n: dict[str, int]
    personalisation: dict[str, float]
    guard_interceptions: int = 0


def policy_report(
    trajs: Sequence[Trajectory],
    pcs: Sequence[PersonalConstitution],
    reviews: Sequence[Review] | None = None,
) -> PolicyReport:
    """Judge-based metrics for a set of trajectories."""
    reviews = reviews or [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]
    turns = [ti for t in trajs for ti in t.turns]
    passes: dict[str, int] = {}
    totals: dict[str, int] = {}
    axioms = {c.id for pc in pcs for c in pc.clauses if c.kind == "axiom"}
    axiom_violations = 0
    for r in reviews:
        for v in r.verdicts:
            if v.verdict in SCORE:
                totals[v.clause] = totals.get(v.clause, 0) + 1
                passes[v.clause] = passes.get(v.clause, 0) + (v.verdict == "pass")
                axiom_violations += v.verdict == "violate" and v.clause in axioms
    judged = [compliance(r, pc) for r, pc in zip(reviews, pcs, strict=True)]
    return PolicyReport(
        episodes=len(trajs),
        success=share(sum(t.outcome.success if t.outcome else 0 for t in trajs), len(trajs)),
        valid_actions=share(sum(ti.action.kind != "invalid" for ti in turns), len(turns)),
        truncated=share(sum(ti.truncated for ti in turns), len(turns)),
        compliance=mean(c for c in judged if not math.isnan(c)),
        axiom_violations=axiom_violations,
        clause_pass={c: passes[c] / totals[c] for c in sorted(totals)},
        clause_n=dict(sorted(totals.items())),
        personalisation=personalisation(trajs, pcs),
    )


def personalisation(
    trajs: Sequence[Trajectory], pcs: Sequence[PersonalConstitution]
) -> dict[str, float]:
    """Behaviour by profile group: what a personalised policy changes and a generic one does not.

    - `words/<verbosity>`: mean words per message to the diner, by the diner's verbosity;
    - `small_talk_first/<pace>`: share of episodes whose first message to the diner neither
      recommends a dish nor asks for the cuisine, by pace;
    - `asks_cuisine/ambiguous`: share of ambiguous requests where the agent asked before searching.
    """
    menu = load_menu()
    words: dict[str, list[int]] = {}
    small: dict[str, list[int]] = {}
    asked: list[int] = []
    for t, pc in zip(trajs, pcs, strict=True):
        says = [ti.action.text for ti in t.turns if ti.action.kind == "say"]
        words.setdefault(str(pc.dimensions.get("verbosity")), []).extend(map(word_count, says))
        if says:
            first = says[0]
            small.setdefault(str(pc.dimensions.get("pace")), []).append(
                int(not menu.mentioned(first) and not asks_cuisine(first))
            )
        if t.task.ambiguous:
            first_search = next(
                (i for i, ti in enumerate(t.turns) if ti.action.tool == "search"), len(t.turns)
            )
            asked.append(
                int(
                    any(
                        ti.action.kind == "say" and asks_cuisine(ti.action.text)
                        for ti in t.turns[:first_search]
                    )
                )
            )
    out = {f"words/{k}": statistics.fmean(v) for k, v in sorted(words.items()) if v}
    out |= {f"small_talk_first/{k}": statistics.fmean(v) for k, v in sorted(small.items()) if v}
    if asked:
        out["asks_cuisine/ambiguous"] = statistics.fmean(asked)
    return out


#: The clause each profile group's preference turns on: what a personal policy must do for it.
GROUP_CLAUSES = (
    ("verbosity", "brief", "T3"),  # short messages
    ("verbosity", "detailed", "T6"),  # described recommendations
    ("pace", "hurried", "T4"),  # the recommendation first
)


def first_recommendation(messages: Sequence[dict[str, Any]]) -> int | None:
    """Index of a dialogue's first recommendation: the first assistant message to the diner
    (not a tool call) that answers a tool result; None if there is none."""
    for i, m in enumerate(messages):
        if (
            i > 2
            and m.get("role") == "assistant"
            and not str(m.get("content", "")).startswith("@")
            and messages[i - 1].get("role") == "tool"
        ):
            return i
    return None


def _shown(dimension: str) -> re.Pattern[str]:
    """`<dimension>=<value>` as the policy's system prompt shows a profile dimension."""
    return re.compile(rf"\b{re.escape(dimension)}=([\w-]+)")


def with_dimension(system: str, dimension: str, value: str) -> str:
    """The policy's system prompt with the profile's `dimension=` set to `value`, the rest as is.
    `KitchenError` when the prompt does not show that dimension."""
    pattern = _shown(dimension)
    if not pattern.search(system):
        shown = ", ".join(re.findall(r"(\w+)=", system)) or "none"
        raise KitchenError(
            f"the system prompt shows no `{dimension}=`; the profile dimensions it shows are "
            f"{shown}"
        )
    return pattern.sub(f"{dimension}={value}", system)


def with_profile(
    messages: Sequence[dict[str, Any]], dimension: str, value: str
) -> list[dict[str, Any]]:
    """`messages` (system prompt first) with the profile's `dimension=` set to `value` in the
    system prompt (`with_dimension`), every other message as is."""
    system = {"role": "system", "content": with_dimension(messages[0]["content"], dimension, value)}
    return [system, *messages[1:]]


def profile_swap(
    policy: tuple[Any, Any],
    dialogues: Sequence[dict[str, Any]],
    *,
    dimension: str = "verbosity",
    values: Sequence[str] = ("brief", "normal", "detailed"),
    samples: int = 4,
    max_new_tokens: int = 60,
) -> dict[str, dict[str, float]]:
    """Does the policy read the diner's profile? Each dialogue (a chat row of `kitchen world
    sft-data`) is cut before its first recommendation; the policy writes that message with the
    system prompt's `dimension=` set to each of `values` in turn, everything else the same,
    `samples` times at temperature 1 (seeds 0, 1, …).

    Returns `{"policy": {value: mean words}, "data": {value: mean words}}`: the policy's words per
    swapped value, and the data's own first recommendations grouped by the value their diner had
    (what the policy was trained to do). A policy that ignores the profile writes the same length
    for every value; the data shows how far apart they should be.
    """
    from kitchen.models import reply

    model, tok = policy
    words: dict[str, list[int]] = {v: [] for v in values}
    data: dict[str, list[int]] = {}
    for row in dialogues:
        msgs = row["messages"]
        cut = first_recommendation(msgs)
        if cut is None:
            continue
        own = _shown(dimension).search(msgs[0]["content"])
        if own:
            data.setdefault(own.group(1), []).append(word_count(msgs[cut]["content"]))
        for value in values:
            prompt = with_profile(msgs[:cut], dimension, value)
            for seed in range(samples):
                text = reply(
                    model,
                    tok,
                    prompt,
                    temperature=1.0,
                    seed=seed,
                    max_new_tokens=max_new_tokens,
                )
                words[value].append(word_count(text))
    return {
        "policy": {v: mean(xs) for v, xs in words.items()},
        "data": {v: mean(data.get(v, [])) for v in values},
    }


def ratio_interval(
    pairs: Sequence[tuple[float, float]], n: int = 2000, seed: int = 0, level: float = 0.95
) -> tuple[float, float, float]:
    """(Σa/Σb, low, high) over per-episode pairs (a, b), with a percentile bootstrap interval
    that resamples *episodes* (verdicts of one episode are not independent); NaNs when Σb = 0."""
    total = sum(b for _, b in pairs)
    if not pairs or total == 0:
        return math.nan, math.nan, math.nan
    rng = random.Random(seed)
    k = len(pairs)
    stats = []
    for _ in range(n):
        draw = [pairs[rng.randrange(k)] for _ in range(k)]
        den = sum(b for _, b in draw)
        if den:
            stats.append(sum(a for a, _ in draw) / den)
    stats.sort()
    lo = stats[int((1 - level) / 2 * len(stats))]
    hi = stats[min(len(stats) - 1, int((1 + level) / 2 * len(stats)))]
    return sum(a for a, _ in pairs) / total, lo, hi


def personal_rates(
    trajs: Sequence[Trajectory],
    pcs: Sequence[PersonalConstitution],
    reviews: Sequence[Review] | None = None,
    *,
    n: int = 2000,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Per profile group (`GROUP_CLAUSES`): how often the clause its preference turns on passed,
    and the words per message its diners got, each with a 95% bootstrap interval over episodes.
    One row per group: {group, clause, episodes, pass, pass_low, pass_high, words, words_low,
    words_high}; rates over nothing are NaN."""
    reviews = reviews or [judge(t, pc) for t, pc in zip(trajs, pcs, strict=True)]
    rows = []
    for dim, value, clause in GROUP_CLAUSES:
        verdicts, words = [], []
        for t, pc, r in zip(trajs, pcs, reviews, strict=True):
            if pc.dimensions.get(dim) != value:
                continue
            vs = [v.verdict for v in r.verdicts if v.clause == clause]
            verdicts.append(
                (sum(v == "pass" for v in vs), sum(v in ("pass", "violate") for v in vs))
            )
            says = [word_count(ti.action.text) for ti in t.turns if ti.action.kind == "say"]
            words.append((sum(says), len(says)))
        p, p_lo, p_hi = ratio_interval(verdicts, n=n, seed=seed)
        w, w_lo, w_hi = ratio_interval(words, n=n, seed=seed)
        rows.append(
            {
                "group": f"{dim}={value}",
                "clause": clause,
                "episodes": len(verdicts),
                "pass": p,
                "pass_low": p_lo,
                "pass_high": p_hi,
                "words": w,
                "words_low": w_lo,
                "words_high": w_hi,
            }
        )
    return rows


def reward_gap(
    grm_reviews: Sequence[Review],
    judge_reviews: Sequence[Review],
    pcs: Sequence[PersonalConstitution],
) -> float:
    """Mean over turns of (GRM local reward − judge local reward): > 0 means the GRM is more
    generous than the truth — the reward-hacking signal to watch during training. NaN when no
    turn carries a signal from both."""
    gaps = []
    for g, j, pc in zip(grm_reviews, judge_reviews, pcs, strict=True):
        rg, vg, _ = turn_rewards(g, pc)
        rj, vj, _ = turn_rewards(j, pc)
        gaps += [a - b for a, b, x, y in zip(rg, rj, vg, vj, strict=True) if x and y]
    return mean(gaps)


class EvalReport(BaseModel):
    """A policy against a baseline on the same held-out episodes."""

    config: EvalConfig
    policy: PolicyReport
    baseline: PolicyReport | None = None
    win_rate: tuple[float, float, float] | None = Field(
        None, description="(rate, low, high) of the policy over the baseline, 95% bootstrap."
    )
    guarded: PolicyReport | None = Field(None, description="The policy behind the axiom guard.")


def evaluate(
    policy: tuple[Any, Any],
    cfg: EvalConfig | None = None,
    baseline: tuple[Any, Any] | None = None,
    *,
    with_guard: bool = True,
    rollout_cfg: Any = None,
    progress: bool = False,
) -> tuple[EvalReport, dict[str, list[Trajectory]]]:
    """Play the held-out set with `policy` (model, tokenizer), and `baseline` on the same seeds.

    Returns the report and the trajectories by name ("policy", "baseline", "guarded") for charts
    and side-by-side dialogues. `progress` shows a bar of finished episodes per policy played.
    """
    from kitchen.guard import AxiomGuard
    from kitchen.rollout import RolloutConfig, rollout

    cfg = cfg or EvalConfig()
    rcfg = (rollout_cfg or RolloutConfig()).model_copy(
        update={"k": cfg.samples, "temperature": cfg.temperature}
    )
    jobs = eval_jobs(cfg)
    pcs = [pc for _, pc, _ in jobs for _ in range(cfg.samples)]
    out: dict[str, list[Trajectory]] = {}

    def bar(name: str) -> str | None:
        return f"held-out episodes ({name})" if progress else None

    out["policy"], _ = rollout(
        *policy, jobs, rcfg, seed=cfg.seed, group_prefix="eval:", progress=bar("policy")
    )
    report = EvalReport(config=cfg, policy=policy_report(out["policy"], pcs))
    if baseline is not None:
        out["baseline"], _ = rollout(
            *baseline, jobs, rcfg, seed=cfg.seed, group_prefix="eval:", progress=bar("baseline")
        )
        report.baseline = policy_report(out["baseline"], pcs)
        report.win_rate = win_rate(
            judged_scores(out["policy"], pcs),
            judged_scores(out["baseline"], pcs),
            n=cfg.bootstrap,
            seed=cfg.seed,
        )
    if with_guard:
        guards: list[AxiomGuard] = []

        def make(pc: PersonalConstitution) -> AxiomGuard:
            guards.append(AxiomGuard(pc))
            return guards[-1]

        out["guarded"], _ = rollout(
            *policy,
            jobs,
            rcfg,
            seed=cfg.seed,
            group_prefix="eval:",
            guard=make,
            progress=bar("guarded"),
        )
        report.guarded = policy_report(out["guarded"], pcs)
        report.guarded.guard_interceptions = sum(len(g.log) for g in guards)
    return report, out


# --------------------------------------------------------------------------------------------
# The command line: `kitchen eval`


def format_report(report: EvalReport, names: dict[str, str] | None = None) -> str:
    """A compact text table of an `EvalReport`: one column per policy played (policy, baseline,
    guarded), rows for success, valid actions, compliance, axiom violations, per-clause pass
    rates (with their counts) and the personalisation metrics, then the win rate."""
    names = names or {}
    cols = [("policy", report.policy), ("baseline", report.baseline), ("guarded", report.guarded)]
    cols = [(k, r) for k, r in cols if r is not None]
    width = 16
    head = f"{'metric':26}" + "".join(f"{k:>{width}}" for k, _ in cols)
    lines = [head, "-" * len(head)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(f"{label:26}" + "".join(f"{c:>{width}}" for c in cells))

    row("episodes", [str(r.episodes) for _, r in cols])
    row("success", [show(r.success, ".1%") for _, r in cols])
    row("valid actions", [show(r.valid_actions, ".1%") for _, r in cols])
    row("truncated turns", [show(r.truncated, ".1%") for _, r in cols])
    row("compliance", [show(r.compliance, ".1%") for _, r in cols])
    row("axiom violations", [str(r.axiom_violations) for _, r in cols])
    if report.guarded is not None:
        row(
            "guard interceptions",
            ["" if k != "guarded" else str(r.guard_interceptions) for k, r in cols],
        )
    lines.append("clause pass rate (n judged)")
    clauses = sorted({c for _, r in cols for c in r.clause_pass})
    for c in clauses:
        row(
            f"  {c}",
            [
                f"{r.clause_pass[c]:.1%} ({r.clause_n[c]})" if c in r.clause_pass else "-"
                for _, r in cols
            ],
        )
    lines.append("personalisation")
    keys = sorted({k for _, r in cols for k in r.personalisation})
    for k in keys:
        row(
            f"  {k}",
            [show(r.personalisation[k], ".2f") if k in r.personalisation else "-" for _, r in cols],
        )
    if report.win_rate is not None:
        rate, lo, hi = report.win_rate
        lines.append(
            "win rate of policy over baseline: no data (no episodes)"
            if no_data(rate)
            else f"win rate of policy over baseline: {rate:.1%} (95% bootstrap interval "
            f"{lo:.1%} – {hi:.1%}; ties count half)"
        )
    for k, v in names.items():
        lines.append(f"{k}: {v}")
    return "\n".join(lines)


def eval_main(
    policy: str,
    *,
    baseline: str | None = None,
    tasks: int | None = None,
    samples: int | None = None,
    seed: int | None = None,
    long_share: float | None = None,
    guard: bool = False,
    out: str | None = None,
    profile_swap_n: int | None = None,
) -> int:
    """`kitchen eval --policy PATH [--baseline PATH] [--tasks N] [--samples K] [--seed S]
    [--long SHARE] [--guard] [--out FILE] [--profile-swap N]`: play the held-out set, judge it by
    rules, print the table.

    Omitted numbers take `EvalConfig`'s defaults. `--out` also writes the report as JSON.
    `--profile-swap N` adds `profile_swap` on the first N held-out SFT dialogues
    (`data/sft/eval.jsonl`): does each policy's first recommendation change length with the
    diner's verbosity alone?
    Model paths are what `kitchen.models.load_model` accepts (a folder, or a hub name). Every
    argument is checked before anything is played (`eval_args`).
    """
    import time

    from kitchen.files import atomic_write_json
    from kitchen.models import ModelSpec, load_model

    cfg = eval_args(
        policy,
        baseline=baseline,
        tasks=tasks,
        samples=samples,
        seed=seed,
        long_share=long_share,
        out=out,
        profile_swap_n=profile_swap_n,
    )
    start = time.perf_counter()
    pol = load_model(ModelSpec(path=policy))
    base = load_model(ModelSpec(path=baseline)) if baseline else None
    report, _ = evaluate(pol, cfg, base, with_guard=guard, progress=True)
    swaps: dict[str, Any] = {}
    if profile_swap_n:
        from itertools import islice

        from kitchen import paths
        from kitchen.files import read_jsonl

        rows = list(islice(read_jsonl(paths.DATA / "sft" / "eval.jsonl"), profile_swap_n))
        for name, model in (("policy", pol), ("baseline", base)):
            if model is not None:
                swaps[name] = profile_swap(model, rows, samples=SWAP_SAMPLES)
    seconds = time.perf_counter() - start
    names = {"policy": policy}
    if baseline:
        names["baseline"] = baseline
    command = "kitchen eval --policy " + policy + (f" --baseline {baseline}" if baseline else "")
    command += f" --tasks {cfg.tasks} --samples {cfg.samples} --seed {cfg.seed}"
    command += f" --long {cfg.long_share:g}" if cfg.long_share else ""
    command += " --guard" if guard else ""
    command += f" --profile-swap {profile_swap_n}" if profile_swap_n else ""
    print(
        f"held-out evaluation: {cfg.tasks} tasks × {cfg.samples} samples, seed {cfg.seed}, "
        f"judged by rules ({seconds:.0f} s)"
    )
    print(format_report(report, names))
    for name, swap in swaps.items():
        print(
            f"{name}: words of the first recommendation with only the diner's verbosity changed "
            f"({profile_swap_n} held-out SFT dialogues × {SWAP_SAMPLES} samples): "
            + ", ".join(f"{v} {show(w, '.1f')}" for v, w in swap["policy"].items())
            + "; the data's own: "
            + ", ".join(f"{v} {show(w, '.1f')}" for v, w in swap["data"].items())
        )
    if out:
        extra = {"command": command, "names": names} | ({"profile_swap": swaps} if swaps else {})
        atomic_write_json(out, json_ready(report.model_dump(mode="json") | extra))
        print(f"report: {out}")
    return 0


SWAP_SAMPLES = 4  # `kitchen eval --profile-swap`: samples per dialogue and verbosity
FLAGS = {"long_share": "long"}  # EvalConfig field → `kitchen eval` flag


def eval_args(
    policy: str,
    *,
    baseline: str | None = None,
    tasks: int | None = None,
    samples: int | None = None,
    seed: int | None = None,
    long_share: float | None = None,
    out: str | None = None,
    profile_swap_n: int | None = None,
) -> EvalConfig:
    """`kitchen eval`'s arguments checked before any model loads: the numbers as `EvalConfig`
    bounds them, the model paths as checkpoints (a local folder, or a hub name), `--out` as a
    file that can be written. Every problem is `kitchen eval: --flag: what and how to fix`."""
    from pathlib import Path

    from pydantic import ValidationError

    from kitchen.models import find_checkpoint

    where = "kitchen eval"
    problems: list[Problem] = []
    given = {"tasks": tasks, "samples": samples, "seed": seed, "long_share": long_share}
    cfg = None
    try:
        cfg = EvalConfig(**{k: v for k, v in given.items() if v is not None})
    except ValidationError as err:
        for e in err.errors(include_url=False):
            problems.append(
                Problem(
                    where,
                    None,
                    f"--{FLAGS.get(e['loc'][0], e['loc'][0])}",
                    f"{e['msg']} (got {e['input']!r})",
                )
            )
    for flag, path in (("--policy", policy), ("--baseline", baseline)):
        if path is None:
            continue
        try:
            if not str(path).strip():
                raise KitchenError("the path is empty; give a checkpoint folder")
            find_checkpoint(str(path))
        except KitchenError as e:
            problems += [Problem(where, None, flag, p.message) for p in e.problems]
    if profile_swap_n is not None and not 1 <= profile_swap_n <= 10_000:
        problems.append(
            Problem(
                where,
                None,
                "--profile-swap",
                f"give a number of dialogues from 1 to 10000 (got {profile_swap_n})",
            )
        )
    if out:
        target = Path(out)
        if target.is_dir():
            problems.append(Problem(where, None, "--out", f"{out} is a folder; give a file name"))
        elif not target.parent.is_dir():
            problems.append(
                Problem(
                    where, None, "--out", f"no folder {target.parent} to write {target.name} in"
                )
            )
    if problems:
        raise KitchenError(problems)
    return cfg
