"""Evaluation metrics: judge-based reports, win rates with intervals, personalisation, reward gap."""

from __future__ import annotations

import json

import pytest

from kitchen.evaluate import (
    EvalConfig,
    EvalReport,
    bootstrap_interval,
    compliance,
    compliance_difference,
    eval_jobs,
    format_report,
    judged_scores,
    policy_report,
    reward_gap,
    win_rate,
)
from kitchen.judge import judge
from kitchen.scripted import IDEAL_QUIRKS, SFT_QUIRKS, episodes
from kitchen.world import load_split

from .conftest import run_cli


def test_eval_jobs_are_heldout_and_deterministic():
    cfg = EvalConfig(tasks=12)
    jobs = eval_jobs(cfg)
    assert len(jobs) == 12 and eval_jobs(cfg) == jobs
    assert all(t.id.startswith("heldout") for t, _, _ in jobs)
    held = set(load_split("heldout"))
    assert len({pc.profile for _, pc, _ in jobs}) == len(held)
    # held-out tasks with the training diners (bench_red_lines.py --diners)
    trained = eval_jobs(cfg, diners="train")
    assert all(t.id.startswith("heldout") for t, _, _ in trained)
    train_diners = {pc.profile for _, pc, _ in eval_jobs(EvalConfig(tasks=36), split="train")}
    assert {pc.profile for _, pc, _ in trained} <= train_diners
    assert not train_diners & {pc.profile for _, pc, _ in jobs}


def test_win_rate_and_intervals():
    assert win_rate([2, 1, 1], [1, 1, 0], n=500)[0] == pytest.approx((1 + 0.5 + 1) / 3)
    mean, lo, hi = bootstrap_interval([0.0, 1.0] * 50, n=500)
    assert mean == 0.5 and lo < 0.5 < hi and hi - lo < 0.3


def test_ideal_beats_generic_and_is_more_personal():
    ideal = episodes(120, seed=9, quirks=IDEAL_QUIRKS)
    generic = episodes(120, seed=9, quirks=SFT_QUIRKS)
    ri = policy_report([t for t, _ in ideal], [pc for _, pc in ideal])
    rg = policy_report([t for t, _ in generic], [pc for _, pc in generic])
    assert ri.compliance > rg.compliance and ri.axiom_violations == 0
    assert ri.valid_actions == 1.0
    # a personal policy writes less to brief diners than to detailed ones; a generic one does not
    assert ri.personalisation["words/detailed"] - ri.personalisation["words/brief"] > 5
    assert (
        abs(rg.personalisation["words/detailed"] - rg.personalisation["words/brief"])
        < ri.personalisation["words/detailed"] - ri.personalisation["words/brief"]
    )
    assert ri.personalisation["small_talk_first/hurried"] == 0
    assert rg.personalisation["small_talk_first/hurried"] > 0
    si = judged_scores([t for t, _ in ideal], [pc for _, pc in ideal])
    sg = judged_scores([t for t, _ in generic], [pc for _, pc in generic])
    assert win_rate(si, sg, n=500)[1] > 0.5


def test_paired_compliance_difference_is_the_mean_of_per_episode_differences():
    """Episode i of one policy against episode i of the other (same jobs): the ideal agents'
    compliance exceeds the generic ones' with an interval above 0; a policy against itself is 0."""
    ideal = episodes(60, seed=9, quirks=IDEAL_QUIRKS)
    generic = episodes(60, seed=9, quirks=SFT_QUIRKS)
    pcs = [pc for _, pc in ideal]
    assert [pc.profile for pc in pcs] == [pc.profile for _, pc in generic]  # paired jobs
    a, b = [t for t, _ in ideal], [t for t, _ in generic]
    mean, lo, hi = compliance_difference(a, b, pcs, n=500)
    per_episode = [compliance(judge(x, pc), pc) - compliance(judge(y, pc), pc)
                   for x, y, pc in zip(a, b, pcs, strict=True)]  # fmt: skip
    assert mean == pytest.approx(sum(per_episode) / len(per_episode))
    assert 0 < lo <= mean <= hi
    assert compliance_difference(a, a, pcs, n=200) == (0.0, 0.0, 0.0)


def test_compliance_and_reward_gap():
    traj, pc = episodes(5, seed=1, quirks=SFT_QUIRKS)[0]
    r = judge(traj, pc)
    assert 0.0 <= compliance(r, pc) <= 1.0
    assert reward_gap([r], [r], [pc]) == 0.0
    generous = r.model_copy(
        update={
            "verdicts": [
                v.model_copy(update={"verdict": "pass"}) if v.verdict == "violate" else v
                for v in r.verdicts
            ]
        }
    )
    gap = reward_gap([generous], [r], [pc])
    assert gap >= 0.0 and (gap > 0) == bool(r.violations())


def test_eval_cli_prints_the_table_and_a_policy_ties_with_itself(tmp_path):
    """`kitchen eval` with the shipped policy as both policy and baseline: same seeds, same
    episodes, so every pair ties and the win rate is exactly 50%; the table and the JSON report
    carry every metric."""
    out = tmp_path / "eval.json"
    res = run_cli(
        "eval",
        "--policy",
        "data/models/policy-tiny",
        "--baseline",
        "data/models/policy-tiny",
        "--tasks",
        "3",
        "--samples",
        "1",
        "--seed",
        "5",
        "--out",
        str(out),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    for needle in ("success", "valid actions", "axiom violations", "A1", "words/", "win rate"):
        assert needle in res.stdout, needle
    rep = json.loads(out.read_text())
    assert rep["win_rate"][0] == 0.5 and rep["policy"] == rep["baseline"]
    assert rep["policy"]["episodes"] == 3 and rep["command"].startswith("kitchen eval")


def test_format_report_has_one_column_per_policy_played():
    eps = episodes(6, seed=3, quirks=SFT_QUIRKS)
    rep = policy_report([t for t, _ in eps], [pc for _, pc in eps])
    report = EvalReport(config=EvalConfig(tasks=6, samples=1), policy=rep, guarded=rep)
    lines = format_report(report).splitlines()
    assert lines[0].split() == ["metric", "policy", "guarded"]
    success = next(line for line in lines if line.startswith("success"))
    assert success.split()[1] == f"{rep.success:.1%}"
    assert any(line.strip().startswith("T3") for line in lines)


def unplayed(split: str, n: int, constitution) -> tuple[list, list]:
    """(trajectories, personal constitutions) of `n` jobs of `split` that ended before their
    first turn (the context rule), each with its outcome."""
    from kitchen.jobs import pair_jobs
    from kitchen.world import World

    trajs, pcs = [], []
    for task, pc, diner in pair_jobs(split, n, 0, constitution):
        w = World()
        w.reset(task, pc.dimensions, profile=pc.profile, diner=diner)
        w.traj.done, w.traj.end = True, "context"
        w.traj.outcome = w.outcome(w.traj)
        trajs.append(w.traj)
        pcs.append(pc)
    return trajs, pcs


def test_metrics_of_nothing_are_nan_and_print_no_data(concierge):
    """Episodes that ended before their first turn: no compliance (NaN, not the 1.0 of an empty
    set), no valid-action or truncation share; their judged score counts compliance 0; an
    interval over nothing is NaN; the table says "no data" and JSON holds null."""
    import math

    from kitchen.evaluate import json_ready, mean, show

    trajs, pcs = unplayed("heldout", 2, concierge)
    assert math.isnan(compliance(judge(trajs[0], pcs[0]), pcs[0]))
    rep = policy_report(trajs, pcs)
    assert rep.episodes == 2 and rep.success == 0.0
    assert all(math.isnan(x) for x in (rep.compliance, rep.valid_actions, rep.truncated))
    assert judged_scores(trajs, pcs) == [0.0, 0.0]
    assert all(math.isnan(x) for x in bootstrap_interval([])) and math.isnan(mean([]))
    lines = format_report(EvalReport(config=EvalConfig(tasks=2), policy=rep)).splitlines()
    assert next(x for x in lines if x.startswith("compliance")).split()[1:] == ["no", "data"]
    assert "nan" not in "\n".join(lines).lower()
    assert json_ready(rep.model_dump(mode="json"))["compliance"] is None
    assert json.loads(json.dumps(json_ready({"a": [math.inf, 1.0]}))) == {"a": [None, 1.0]}
    assert show(math.nan) == "no data" and show(0.5, ".0%") == "50%"


def test_eval_arguments_are_checked_before_anything_plays(tmp_path):
    """Numbers out of range, a missing checkpoint, an --out nowhere: every problem names its
    flag (`kitchen eval: --flag: ...`), all at once, before a model loads."""
    from kitchen.config import KitchenError
    from kitchen.evaluate import eval_args

    with pytest.raises(KitchenError) as e:
        eval_args(
            "data/models/nope",
            tasks=0,
            samples=10**6,
            seed=-1,
            out=str(tmp_path / "no" / "r.json"),
            profile_swap_n=0,
        )
    assert sorted(p.where for p in e.value.problems) == [
        "--out",
        "--policy",
        "--profile-swap",
        "--samples",
        "--seed",
        "--tasks",
    ]
    assert all(p.path == "kitchen eval" for p in e.value.problems)
    cfg = eval_args("data/models/policy-tiny", tasks=3, out=str(tmp_path / "r.json"))
    assert cfg.tasks == 3 and cfg.samples == EvalConfig().samples


def test_profile_swap_changes_only_the_dimension_and_counts_the_datas_own_words():
    """The swap rewrites one `dimension=` of the system prompt and nothing else (a prompt without
    it is a clear error); each dialogue is cut before its first recommendation; the data's words
    are the recommendations' own, grouped by their diner's value; the policy's are finite."""
    from kitchen import paths
    from kitchen.config import KitchenError
    from kitchen.evaluate import first_recommendation, profile_swap, with_dimension
    from kitchen.files import read_jsonl
    from kitchen.models import ModelSpec, load_model
    from kitchen.world import word_count

    system = "Concierge. Diner: verbosity=brief, pace=hurried, diet=any, allergies=egg."
    assert with_dimension(system, "verbosity", "detailed") == system.replace("brief", "detailed")
    assert with_dimension(system, "pace", "relaxed") == system.replace("hurried", "relaxed")
    with pytest.raises(KitchenError, match="no `mood=`.*verbosity, pace, diet, allergies"):
        with_dimension(system, "mood", "happy")

    rows = []
    for row in read_jsonl(paths.DATA / "sft" / "eval.jsonl"):
        if first_recommendation(row["messages"]) is not None:
            rows.append(row)
        if len(rows) == 2:
            break
    cut = first_recommendation(rows[0]["messages"])
    said = rows[0]["messages"][cut]
    assert said["role"] == "assistant" and not said["content"].startswith("@")
    assert rows[0]["messages"][cut - 1]["role"] == "tool"
    assert first_recommendation([{"role": "system", "content": system}]) is None

    policy = load_model(ModelSpec(path=str(paths.DATA / "models" / "policy-tiny")))
    out = profile_swap(policy, rows, values=("brief", "detailed"), samples=1, max_new_tokens=24)
    assert set(out["policy"]) == {"brief", "detailed"}
    assert all(0 <= w <= 24 for w in out["policy"].values())  # NaN fails too
    own: dict[str, list[int]] = {}
    for row in rows:
        value = row["messages"][0]["content"].split("verbosity=")[1].split(",")[0]
        text = row["messages"][first_recommendation(row["messages"])]["content"]
        own.setdefault(value, []).append(word_count(text))
    for value, words in own.items():
        if value in out["data"]:
            assert out["data"][value] == pytest.approx(sum(words) / len(words))
