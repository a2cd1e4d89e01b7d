"""The main job (`make demo`, `kitchen demo`): align the tiny policy end to end and report.

1. Training runs from one recipe, `recipes/tiny_mapo.yaml`, on single dishes *and* meals (long
   tasks of several courses, 12–20 turns): `mapo` (the method) and `grpo`, its `compare: grpo`
   arm (`Recipe.variant`) — the same recipe with GRPO's outcome-only advantage and MAPO's state
   key and loss aggregation, so the two differ in the advantage estimator alone
   (`mapo.one_factor`; the report prints what each applies, `mapo.describe`). Same seeds, tasks,
   budgets and GRM reward. Each is a `kitchen cook` subprocess with one torch thread, two at a
   time on a 2-core machine; a finished run is reused and an interrupted one resumed (a run
   folder whose recipe differs from today's is started afresh), so the job can be re-run
   cheaply. `seeds` repeats the pair with other recipe seeds (`kitchen demo --seeds 0,1,2`: the
   multi-seed figure behind the README's claims).
2. Evaluation on held-out tasks and diners, by the rule judge (`kitchen.evaluate`), per task kind:
   the SFT policy and every RL policy on the same jobs and seeds — win rate against the SFT
   policy with a 95% interval, per-clause compliance, success, axiom violations with and without
   the axiom guard, and personalisation per profile group (the pass rate of the clause each
   group's preference turns on, and words per message, with episode-bootstrap intervals).
3. Sample efficiency, per task kind and seed: the training episodes MAPO needed to reach GRPO's
   final held-out compliance (each run's held-out curve, logged every `eval_every` iterations
   from the SFT policy on), as a share of GRPO's episodes; the median over seeds. And on the
   large held-out set: MAPO at half its budget against GRPO's final policy, paired per episode
   (`half_budget`) — the MAPO run's checkpoint at half its iterations (mid-way down its
   learning-rate schedule), or with `half_runs` (`--half-runs`) a MAPO run trained on half the
   budget, one more run per seed.
4. A self-contained HTML report (`runs/<out>/report.html`: curves with seed bands, tables,
   side-by-side dialogues) and the numbers as JSON (`runs/<out>/results.json`), which the README
   quotes.

This is the method's training loop and its validation (docs/method.md#policy-update,
docs/method.md#validation, docs/method.md#long-horizon) in one command.

Departures from the method:
1. Validation there asks for human blind comparisons and human spot checks of personalisation;
   here the independent rule judge scores both, on held-out tasks and diners, because every
   concierge clause is checkable and the whole job must run unattended in CI.
2. Sample efficiency is read on the held-out compliance curve each run logs every `eval_every`
   iterations (a small held-out set, one sample each) and on the full held-out set at half the
   budget and at the end, not on a curve of full evaluations.
3. `tiny_grpo.yaml` (GRPO as its source defines it, seq-mean-token-mean loss) is not the
   comparison: it differs from MAPO's recipe in its loss aggregation too.

A number over nothing (a held-out compliance when no clause applied, a win rate over no
episodes) is NaN here, `null` in results.json and "no data" in the summary and the report; the
curves leave such points out.
"""

from __future__ import annotations

import copy
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Collection, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl
import torch
import yaml
from tqdm.auto import tqdm

from kitchen import charts, mapo, paths
from kitchen.config import KitchenError
from kitchen.evaluate import (
    EvalConfig,
    compliance_difference,
    eval_jobs,
    evaluate,
    json_ready,
    judged_scores,
    no_data,
    personal_rates,
    policy_report,
    show,
    win_rate,
)
from kitchen.files import atomic_write_json, atomic_write_text, read_jsonl
from kitchen.judge import RULES_VERSION
from kitchen.models import ModelSpec, load_model
from kitchen.report import Section, run_sections, write_html
from kitchen.train import (
    Recipe,
    _home,
    autocast_mode,
    latest_checkpoint,
    load_recipe,
    load_run_policy,
    run_checkpoint,
)
from kitchen.world import Trajectory, render_transcript

METHODS = {"mapo": None, "grpo": "grpo"}  # method → the recipe's compare arm (None: itself)
KINDS = ("long", "short")


def run_name(method: str, seed: int, prefix: str) -> str:
    return f"{prefix}-{method}" if prefix == "demo" and seed == 0 else f"{prefix}-{method}-s{seed}"


def arms(
    iterations: int | None = None,
    recipe: str | os.PathLike = paths.RECIPES / "tiny_mapo.yaml",
    seeds: Sequence[int] = (0,),
    prefix: str = "demo",
    half_runs: bool = False,
) -> dict[str, dict[str, Any]]:
    """The job's runs as recipe documents, for every seed: `recipe` itself (mapo) and its
    `compare: grpo` arm (grpo) — the same recipe but for the advantage estimator. A seed other
    than the recipe's shifts the recipe's seed (tasks drawn, rollouts, minibatches). `iterations`
    shortens every run (an α schedule set in the overrides is shortened with them). With
    `half_runs`, every seed also gets MAPO with half the budget as a run of its own
    (`half_run_name`): its α and learning-rate schedules end where it ends."""
    base = load_recipe(recipe)
    out = {}
    for seed in seeds:
        for method, arm in METHODS.items():
            name = run_name(method, seed, prefix)
            r = base.model_copy(update={"name": name}) if arm is None else base.variant(arm, name)
            doc = r.model_dump(mode="json", by_alias=True) | {"compare": {}}
            doc["seed"] = base.seed + seed
            if iterations:
                _shorten(doc, iterations)
            doc["keep_checkpoints"] = sorted({*doc["keep_checkpoints"], half_point(doc)})
            out[name] = doc
            if half_runs and arm is None:
                half = copy.deepcopy(doc) | {"name": half_run_name(name), "keep_checkpoints": []}
                out[half["name"]] = _shorten(half, half_point(doc))
    return out


def _shorten(doc: dict[str, Any], iterations: int) -> dict[str, Any]:
    """`doc` with `iterations` iterations; an α schedule set in its overrides ends with them."""
    doc["train"]["iterations"] = iterations
    alpha = doc["advantage"]["overrides"].get("alpha")
    if isinstance(alpha, dict) and alpha.get("steps"):
        alpha["steps"] = iterations
    return doc


def half_point(doc: dict[str, Any]) -> int:
    """The iteration at half a run's budget: every run keeps its checkpoint there, and MAPO's
    is evaluated against GRPO's last (sample efficiency: the same level on half the episodes)."""
    return max(1, doc["train"]["iterations"] // 2)


def episodes_per_iteration(doc: dict[str, Any]) -> int:
    """Training episodes a run of the recipe `doc` plays per iteration: its tasks × K."""
    return doc["train"]["tasks_per_iteration"] * doc["rollout"]["k"]


def half_name(run: str) -> str:
    """The held-out name of MAPO at half its budget (a kept checkpoint or a half run)."""
    return f"{run}-half"


def half_run_name(run: str) -> str:
    """The run folder of MAPO trained on half of `run`'s budget (`arms(half_runs=True)`)."""
    return f"{run}-half-run"


def _state(folder: Path, doc: dict[str, Any]) -> str:
    """'done', 'partial' or 'new' for a run folder meant to run the recipe `doc`; a folder
    whose saved recipe differs from `doc` (an older demo) counts as 'new'."""
    ck = latest_checkpoint(folder)
    if ck is None:
        return "new"
    try:
        saved = load_recipe(folder / "recipe.yaml").model_dump()
    except KitchenError:  # written by an older kit
        return "new"
    if saved != Recipe.model_validate(doc).model_dump():
        return "new"
    done = int(ck.name.split("-")[1]) >= doc["train"]["iterations"]
    return "done" if done else "partial"


def models_digest(doc: dict[str, Any]) -> dict[str, str]:
    """{model folder: sha256 of its weights} for the policy and GRM a recipe names (folders on
    disk only): a finished run is reused only while the models it was trained on are unchanged —
    a retrained GRM or policy installed under the same path makes the old runs stale."""
    import hashlib

    out = {}
    for path in (doc.get("policy", {}).get("path"), (doc.get("grm") or {}).get("model")):
        folder = Path(_home(path)) if path else None  # where the run loads it from
        if folder is None or not folder.is_dir():
            continue
        h = hashlib.sha256()
        for f in sorted(folder.glob("*.safetensors")):
            h.update(f.read_bytes())
        out[str(path)] = h.hexdigest()[:16]
    return out


@dataclass(frozen=True)
class Play:
    """A policy's held-out episodes, played in a slot training leaves free (`_play_held_out`
    into `cache`, where `held_out` finds them): once the run `after` has finished (None: no
    run to wait for) and `where` exists."""

    name: str
    where: str
    cfg: EvalConfig
    cache: str
    guard: bool = True
    after: str | None = None


def cook_side_by_side(
    recipes: dict[str, dict[str, Any]],
    out: Path,
    progress: bool = True,
    parallel: int = 2,
    plays: Sequence[Play] = (),
) -> dict[str, Path]:
    """Run each recipe in its own `kitchen cook` process, `parallel` at a time (one torch thread
    each); wait for them all. Finished runs are skipped, interrupted ones resumed. A slot no
    training run needs (the last runs outlast the others: GRPO reads no review) plays the
    `plays` whose policies are ready, in their order, and waits for them too; a play that fails
    is left for `held_out` to play again, where its error shows."""
    folders = {name: paths.RUNS / name for name in recipes}
    todo = []
    for name, doc in recipes.items():
        rpath = out / f"{name}.yaml"
        atomic_write_text(rpath, yaml.safe_dump(doc, sort_keys=False))
        state = _state(folders[name], doc)
        digest, models = out / f"{name}.models.json", models_digest(doc)
        if state != "new" and (not digest.exists() or json.loads(digest.read_text()) != models):
            state = "new"  # trained on other weights than the ones installed now
        atomic_write_json(digest, models)
        if state == "done":
            continue
        if state == "new" and folders[name].exists():
            shutil.rmtree(folders[name])
        todo.append(
            (name, ["--resume", str(folders[name])] if state == "partial" else [str(rpath)])
        )
    total = sum(d["train"]["iterations"] for d in recipes.values())
    bar = tqdm(total=total, desc="training", unit="it", disable=not progress)
    running: dict[str, tuple[subprocess.Popen, Any]] = {}
    env = os.environ | {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    finished = {n for n in recipes if n not in dict(todo)}
    waiting, playing = list(plays), {}
    ctx = multiprocessing.get_context("spawn")
    while todo or running or playing or any(_ready(p, finished) for p in waiting):
        while todo and len(running) + len(playing) < parallel:
            name, args = todo.pop(0)
            log = (out / f"{name}.log").open("w")
            proc = subprocess.Popen(
                [sys.executable, "-m", "kitchen.cli", "cook", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
            running[name] = (proc, log)
        for play in [p for p in waiting if _ready(p, finished)]:
            if todo or len(running) + len(playing) >= parallel:
                break
            waiting.remove(play)
            args = (play.name, play.where, play.cfg, play.cache, play.guard)
            playing[play.name] = ctx.Process(target=_play_held_out, args=args, daemon=True)
            playing[play.name].start()
        bar.set_postfix_str(f"held-out play: {', '.join(playing)}" if playing else "")
        time.sleep(2)
        for name, proc in list(playing.items()):
            if not proc.is_alive():
                del playing[name]
                if proc.exitcode:
                    bar.write(
                        f"held-out play of {name} failed (exit {proc.exitcode}); it plays again"
                    )
        done = min(sum(_iterations(folders[n]) for n in recipes), total)
        if done > bar.n:
            bar.update(done - bar.n)
        for name, (proc, log) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            if proc.returncode == 0:
                finished.add(name)
            else:
                for p, lg in running.values():
                    p.terminate()
                    lg.close()
                for p in playing.values():
                    p.terminate()
                tail = (out / f"{name}.log").read_text()[-2000:]
                raise KitchenError(
                    f"training run {name} failed (exit {proc.returncode}); the end of "
                    f"{out / (name + '.log')}:\n{tail}"
                )
    bar.update(total - bar.n)
    bar.close()
    return folders


def early_plays(
    recipes: dict[str, dict[str, Any]],
    mapos: Sequence[str],
    half_runs_of: dict[str, str],
    sft: str,
    cfg: EvalConfig,
    cache: Path,
) -> list[Play]:
    """The held-out plays `main_job` evaluates, for the slots training leaves free, longest
    first: every run's final policy (with the guard and without), MAPO at half its budget
    (its half run, or the full run's kept checkpoint once written; without the guard), then the
    SFT policy."""
    cache.mkdir(parents=True, exist_ok=True)

    def play(name: str, where: Path, guard: bool = True, after: str | None = None) -> Play:
        return Play(name, str(where), cfg, str(cache / f"{name}.json"), guard, after)

    runs = set(half_runs_of.values())
    out = [play(n, paths.RUNS / n, after=n) for n in recipes if n not in runs]
    halves = half_policies(recipes, mapos, half_runs_of)
    out += [play(name, where, False, after) for name, (where, after) in halves.items()]
    return [*out, play("sft", Path(sft), False)]


def half_policies(
    recipes: dict[str, dict[str, Any]], mapos: Sequence[str], half_runs_of: dict[str, str]
) -> dict[str, tuple[Path, str | None]]:
    """MAPO at half its budget, per seed: its held-out name → (where it is, the run it waits
    for): its half run, or the full run's checkpoint at `half_point` (kept; there once
    written, and then complete: checkpoints are written atomically)."""
    out: dict[str, tuple[Path, str | None]] = {}
    for m in mapos:
        if m in half_runs_of:
            out[half_name(m)] = (paths.RUNS / half_runs_of[m], half_runs_of[m])
        else:
            ck = paths.RUNS / m / "checkpoints" / f"it-{half_point(recipes[m]):04d}"
            out[half_name(m)] = (ck, None)
    return out


def _ready(play: Play, finished: Collection[str]) -> bool:
    """Whether `play`'s policy is there to play: its run has finished, its folder exists."""
    return (play.after is None or play.after in finished) and Path(play.where).exists()


def _iterations(folder: Path) -> int:
    f = folder / "metrics.parquet"
    try:
        return pl.read_parquet(f).height if f.exists() else 0
    except Exception:  # being rewritten right now
        return 0


# --------------------------------------------------------------------------------------------
# Learning curves and sample efficiency


def held_out_curve(folder: Path, doc: dict[str, Any], kind: str, start: float) -> pl.DataFrame:
    """(episodes, value): the run's held-out judged compliance on `kind` tasks at each
    evaluation (eval.jsonl), from the SFT policy's `start` at 0 episodes. Points over nothing
    (NaN) are left out."""
    per_it = episodes_per_iteration(doc)
    rows = [] if no_data(start) else [{"episodes": 0, "value": float(start)}]
    for row in read_jsonl(folder / "eval.jsonl") if (folder / "eval.jsonl").exists() else []:
        value = (row.get("by_kind") or {}).get(kind, {}).get("compliance")
        if value is not None and not no_data(value):
            rows.append({"episodes": row["iteration"] * per_it, "value": float(value)})
    return pl.DataFrame(rows, schema={"episodes": pl.Int64, "value": pl.Float64})


def episodes_to_reach(curve: pl.DataFrame, target: float) -> int | None:
    """Training episodes at the first held-out point at or above `target` (None: never)."""
    hit = curve.filter(pl.col("value") >= target - 1e-12)
    return int(hit["episodes"].min()) if hit.height else None


def efficiency(mapo_curve: pl.DataFrame, grpo_curve: pl.DataFrame) -> dict[str, Any]:
    """MAPO's episodes to reach GRPO's *final* held-out compliance, against GRPO's episodes:
    the ratio the README's claim is about (≤ ½: MAPO needs at most half GRPO's samples).
    A ratio over nothing (no curve) is None; MAPO never reaching it is None too, and so is a
    GRPO run that ended no higher than it started (`improved` False): reaching a level the SFT
    policy already had says nothing about sample efficiency."""
    if grpo_curve.height < 2 or mapo_curve.height < 2:
        return {
            "target": None,
            "grpo_episodes": None,
            "mapo_episodes": None,
            "ratio": None,
            "improved": None,
        }
    values = grpo_curve.sort("episodes")["value"]
    target, improved = float(values[-1]), float(values[-1]) > float(values[0])
    grpo_eps = int(grpo_curve["episodes"].max())
    mapo_eps = episodes_to_reach(mapo_curve, target)
    return {
        "target": target,
        "grpo_episodes": grpo_eps,
        "mapo_episodes": mapo_eps,
        "ratio": None if mapo_eps is None or grpo_eps == 0 or not improved else mapo_eps / grpo_eps,
        "improved": improved,
    }


# --------------------------------------------------------------------------------------------
# Held-out evaluation


def half_budget(recipes, trajs, pcs, cfg, seed, prefix, kind, held) -> dict[str, Any]:
    """Sample efficiency on the large held-out set: MAPO at half its budget (its kept
    checkpoint, or a run of half the budget: `mapo_half_from`) against GRPO at the end of the
    same budget, on `kind` tasks. `difference` is the paired compliance of MAPO's half minus
    GRPO's final (mean, low, high); a mean ≥ 0 means MAPO reached GRPO's final level with half of
    GRPO's episodes. None without the checkpoint."""
    m, g = run_name("mapo", seed, prefix), run_name("grpo", seed, prefix)
    h = half_name(m)
    if h not in trajs or kind not in held[h]:
        return {"difference": None}
    doc = recipes[m]
    per_it = episodes_per_iteration(doc)
    mine, kpcs, idx = _split(trajs[h]["policy"], pcs, kind)
    theirs = [trajs[g]["policy"][i] for i in idx]
    return {
        "mapo_half_from": "run" if half_run_name(m) in recipes else "checkpoint",
        "mapo_episodes": half_point(doc) * per_it,
        "grpo_episodes": doc["train"]["iterations"] * per_it,
        "mapo_half": held[h][kind]["compliance"],
        "mapo_final": held[m][kind]["compliance"],
        "grpo_final": held[g][kind]["compliance"],
        "difference": compliance_difference(mine, theirs, kpcs, cfg.bootstrap, cfg.seed),
    }


def _split(trajs, pcs, kind: str):
    idx = [i for i, t in enumerate(trajs) if bool(t.task.courses) == (kind == "long")]
    return [trajs[i] for i in idx], [pcs[i] for i in idx], idx


HELD_OUT_VERSION = 1  # raise it when a change to the code that plays or judges episodes lands


def _full_model(name: str, where: str | Path) -> bool:
    """Whether `where` is a model to load as it is — the SFT policy, another SFT checkpoint, or a
    saved adapter such as `data/models/mapo-tiny` (`load_model` loads its base first), played as
    an arm — rather than a training run or one of its checkpoints."""
    folder = Path(where)
    return name == "sft" or any(
        (folder / f).exists() for f in ("model.safetensors", "adapter_config.json")
    )


def _played_key(
    name: str, where: str | Path, cfg: EvalConfig, guard: bool = False
) -> tuple[str, int]:
    """What a policy's held-out episodes depend on: the evaluation settings, the held-out jobs
    themselves (tasks, personal constitutions, diners), the weights it plays with (the SFT
    checkpoint; a run's latest adapter and the models its recipe names), HELD_OUT_VERSION for
    the code and, with the `guard` (which asks the rule judge what to block), the judge's
    `RULES_VERSION`. Returns (key, the number of episodes a policy plays)."""
    import hashlib

    rules = f"|rules {RULES_VERSION}" if guard else ""
    h = hashlib.sha256(f"{HELD_OUT_VERSION}{rules}|{name}|{cfg.model_dump_json()}".encode())
    jobs = eval_jobs(cfg)
    for task, pc, values in jobs:
        job = [task.model_dump(mode="json"), pc.model_dump(mode="json"), values]
        h.update(json.dumps(job, sort_keys=True, default=str).encode())
    if _full_model(name, where):
        folder = Path(where)
    else:
        run, folder = run_checkpoint(where)
        recipe = run / "recipe.yaml"
        if recipe.exists():
            h.update(json.dumps(models_digest(yaml.safe_load(recipe.read_text()))).encode())
    for f in sorted(folder.rglob("*.safetensors")) if folder else []:
        h.update(f.read_bytes())
    if folder and (folder / "adapter_config.json").exists():  # a saved adapter: its base too
        base = json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"]
        h.update(json.dumps(models_digest({"policy": {"path": base}})).encode())
    return h.hexdigest()[:16], len(jobs) * cfg.samples


def _play_held_out(
    name: str, where: str, cfg: EvalConfig, cache: str | None = None, guard: bool = True
) -> tuple[str, dict[str, list]]:
    """One policy's held-out episodes (also with the axiom guard when `guard`; never for the SFT
    policy), with one torch thread (a worker process's, or the caller's for the length of the
    call): `where` is the SFT checkpoint ("sft"), a training run's folder or one of its
    checkpoints. With a `cache` file the episodes are kept there and reused while their key
    still matches (`_played_key`), so an interrupted evaluation resumes at the policies it had
    not finished."""
    guard = guard and name != "sft"
    key, played = _played_key(name, where, cfg, guard)
    if cache and Path(cache).exists():
        saved = json.loads(Path(cache).read_text())
        eps = saved.get("episodes") or {}
        fits = len(eps.get("policy", [])) == played and (not guard or bool(eps.get("guarded")))
        if saved.get("key") == key and fits:
            return name, {v: [Trajectory.model_validate(t) for t in ts] for v, ts in eps.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        if _full_model(name, where):
            policy = load_model(ModelSpec(path=where))
            policy[0].eval()
        else:
            policy = load_run_policy(where)
        _, eps = evaluate(policy, cfg, with_guard=guard)
    finally:
        torch.set_num_threads(threads)
    if cache:
        doc = {v: [t.model_dump(mode="json") for t in ts] for v, ts in eps.items()}
        atomic_write_json(Path(cache), {"key": key, "episodes": doc})
    return name, eps


def kept_settings(folder: str | os.PathLike) -> EvalConfig:
    """The evaluation settings the held-out episodes kept in `folder/held_out/` were played with:
    the `eval` key of `folder/results.json`, which `kitchen demo` and `benchmarks/bench_arms.py`
    write beside them."""
    path = Path(folder) / "results.json"
    try:
        return EvalConfig(**json.loads(path.read_text())["eval"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise KitchenError(
            f"{path}: no evaluation settings to read ({e}); run `kitchen demo` or "
            "benchmarks/bench_arms.py first — they write it beside the episodes they keep"
        ) from e


def held_out(
    policies: dict[str, str | Path],
    cfg: EvalConfig,
    progress: bool = True,
    parallel: int = 2,
    cache: str | os.PathLike | None = None,
    unguarded: Collection[str] = (),
) -> tuple[dict[str, Any], dict[str, dict[str, list]]]:
    """Every policy (name → the SFT checkpoint for "sft"; a run folder, one of its checkpoints
    or another whole model for the others) on the same held-out jobs and seeds, `parallel`
    policies at a time in worker processes (one torch thread each; every episode is seeded, so
    the result does not depend on it), with the guard for the RL ones but those in
    `unguarded`; per task kind: reports, win rates vs "sft" and personalisation. A `cache`
    folder keeps every policy's episodes (`<name>.json`), so a rerun plays only what changed.
    Returns (results by name, trajectories by name and variant)."""
    cache = Path(cache) if cache else None
    if cache:
        cache.mkdir(parents=True, exist_ok=True)

    def kept(name: str) -> str | None:
        return str(cache / f"{name}.json") if cache else None

    pcs = [pc for _, pc, _ in eval_jobs(cfg) for _ in range(cfg.samples)]
    trajs: dict[str, dict[str, list]] = {}
    order = sorted(policies, key=lambda n: n == "sft")  # the guarded RL runs take longest: first
    bar = tqdm(total=len(order), desc="held-out evaluation", disable=not progress)
    if parallel <= 1:
        for name in order:
            guard = name not in unguarded
            trajs[name] = _play_held_out(name, str(policies[name]), cfg, kept(name), guard)[1]
            bar.update()
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=parallel, mp_context=ctx) as pool:
            jobs = [
                pool.submit(_play_held_out, n, str(policies[n]), cfg, kept(n), n not in unguarded)
                for n in order
            ]
            for job in as_completed(jobs):
                name, eps = job.result()
                trajs[name] = eps
                bar.update()
    bar.close()
    trajs = {name: trajs[name] for name in policies}  # the caller's order
    sft = trajs["sft"]["policy"]
    results: dict[str, Any] = {}
    for name, eps in trajs.items():
        out: dict[str, Any] = {}
        for kind in KINDS:
            mine, kpcs, idx = _split(eps["policy"], pcs, kind)
            if not mine:
                continue
            rep = policy_report(mine, kpcs)
            row: dict[str, Any] = {
                "episodes": rep.episodes,
                "success": rep.success,
                "compliance": rep.compliance,
                "axiom_violations": rep.axiom_violations,
                "clause_pass": rep.clause_pass,
                "personalisation": rep.personalisation,
                "groups": personal_rates(mine, kpcs, n=cfg.bootstrap, seed=cfg.seed),
            }
            if name != "sft":
                base = [sft[i] for i in idx]
                row["win_rate_vs_sft"] = win_rate(
                    judged_scores(mine, kpcs), judged_scores(base, kpcs), cfg.bootstrap, cfg.seed
                )
            if eps.get("guarded"):
                guarded, _, _ = _split(eps["guarded"], pcs, kind)
                g = policy_report(guarded, kpcs)
                row["guarded"] = {
                    "success": g.success,
                    "compliance": g.compliance,
                    "axiom_violations": g.axiom_violations,
                }
            out[kind] = row
        results[name] = out
    return results, trajs


def side_by_side(
    trajs: dict[str, dict[str, list]], pcs: Sequence[Any], names: Sequence[str], n: int = 3
) -> list[tuple[str, list[str]]]:
    """A few held-out jobs where the policies' judged scores differ most (meals first, a brief
    or hurried diner preferred): (heading, one transcript per policy)."""
    scores = {name: judged_scores(trajs[name]["policy"], pcs) for name in names}
    order = sorted(
        range(len(pcs)),
        key=lambda i: (
            not trajs[names[0]]["policy"][i].task.courses,
            -(max(scores[m][i] for m in names) - min(scores[m][i] for m in names)),
        ),
    )
    out = []
    for i in order[:n]:
        t = trajs[names[0]]["policy"][i]
        dims = pcs[i].dimensions
        head = (
            f"{t.task.request} — diner: verbosity {dims.get('verbosity')}, pace "
            f"{dims.get('pace')}, allergies {', '.join(dims.get('allergies') or []) or 'none'}"
        )
        out.append((head, [render_transcript(trajs[m]["policy"][i]) for m in names]))
    return out


def arithmetic(recipe: Recipe) -> dict[str, str]:
    """What the recipe's GRM review and policy update compute in on this machine: its `fast`
    settings (`grm.dtype`, `train.autocast`) are bfloat16 where the device multiplies it in
    hardware (a CPU with AMX, a CUDA GPU) and float32 elsewhere, so runs on two machines can
    differ in their last bits and in time (README, *On a CPU without AMX*)."""
    from kitchen.grm import review_dtype
    from kitchen.models import resolve_device, resolve_dtype

    device = resolve_device(recipe.policy.device)  # the update's; the GRM loads on `auto`
    grm_device = resolve_device("auto")
    review = str(resolve_dtype(review_dtype(recipe.grm.dtype), grm_device)).removeprefix("torch.")
    update = autocast_mode(recipe.train.autocast, device)
    return {
        "device": device.type,
        "review": review,
        "update": "float32" if update == "none" else "bfloat16 autocast",
    }


def precision_note(recipe: Recipe, arith: dict[str, str]) -> str | None:
    """A line for the user when the recipe asks for bfloat16 where it pays (`fast`) and this
    machine has no hardware for it, so the job runs in float32 and takes longer; None otherwise."""
    asked = recipe.grm.dtype == "fast" or recipe.train.autocast == "fast"
    fell_back = arith["device"] == "cpu" and arith["review"] == arith["update"] == "float32"
    if not (asked and fell_back):
        return None
    return (
        "note: this CPU does not multiply bfloat16 in hardware (no AMX), so the recipe's `fast` "
        "review and update run in float32: about 1.4x the time they take on a CPU with AMX, and "
        "figures that differ from the README's bfloat16 runs in their details"
    )


# --------------------------------------------------------------------------------------------
# The job


def main_job(
    iterations: int | None = None,
    eval_tasks: int = 100,
    eval_samples: int = 2,
    progress: bool = True,
    recipe: str | os.PathLike = paths.RECIPES / "tiny_mapo.yaml",
    seeds: Sequence[int] = (0,),
    out_name: str | None = None,
    half_runs: bool = False,
) -> dict[str, Any]:
    """Run the whole main job on `recipe` and its `compare: grpo` arm for every seed; returns
    the results (also written to runs/<out_name>/; `demo` for one seed, `demo-seeds` for more).
    The SFT policy every run is compared with is the recipe's own `policy.path` (the shipped
    recipe's: data/models/policy-tiny). Sample efficiency plays MAPO at half its budget against
    GRPO's final policy: the MAPO run's checkpoint at half its iterations, or with `half_runs` a
    MAPO run trained on half the budget (a third run per seed: its schedules end with it, where
    the checkpoint is mid-schedule)."""
    start = load_recipe(recipe)
    for field, where in (("policy.path", start.policy.path), ("grm.model", start.grm.model)):
        if not (Path(_home(where)) / "config.json").exists():
            shipped = Path(_home(where)).resolve().parent == (paths.DATA / "models").resolve()
            raise KitchenError(
                f"{recipe}: {field} {where} is missing; "
                + (
                    "it ships with the kit (see its PROVENANCE.md for the command that makes it)"
                    if shipped
                    else "train it first (the recipe's header names the commands)"
                )
            )
    arith = arithmetic(start)
    note = precision_note(start, arith)
    if note and progress:
        tqdm.write(note)
    seeds = list(seeds)
    out_name = out_name or ("demo" if seeds == [0] else "demo-seeds")
    prefix = "demo" if out_name == "demo" else out_name
    out = paths.RUNS / out_name
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    recipes = arms(iterations, recipe, seeds, prefix, half_runs)
    base = Recipe.model_validate(next(iter(recipes.values())))
    cfg = EvalConfig(tasks=eval_tasks, samples=eval_samples, long_share=base.eval.long_share)
    mapos = {seed: run_name("mapo", seed, prefix) for seed in seeds}
    half_runs_of = {m: half_run_name(m) for m in mapos.values() if half_run_name(m) in recipes}
    sft = _home(start.policy.path)
    plays = early_plays(recipes, list(mapos.values()), half_runs_of, sft, cfg, out / "held_out")
    trained = cook_side_by_side(recipes, out, progress, plays=plays)
    train_s = time.perf_counter() - t0
    folders = {n: f for n, f in trained.items() if n not in half_runs_of.values()}

    torch.set_num_threads(1)
    halves = {  # MAPO at half its budget: the half run, or the full run's kept checkpoint
        name: where
        for name, (where, run) in half_policies(recipes, list(mapos.values()), half_runs_of).items()
        if run is not None or (where / "state.pt").exists()
    }
    policies = {"sft": Path(_home(start.policy.path)), **folders, **halves}
    held, trajs = held_out(policies, cfg, progress, cache=out / "held_out", unguarded=set(halves))
    pcs = [pc for _, pc, _ in eval_jobs(cfg) for _ in range(cfg.samples)]

    # the SFT policy's in-training held-out compliance: every curve starts there
    first = read_jsonl(folders[next(iter(folders))] / "eval.jsonl")
    starts = {kind: _start(first, kind) for kind in KINDS}
    curves: dict[str, dict[str, pl.DataFrame]] = {kind: {} for kind in KINDS}
    for name, folder in folders.items():
        for kind in KINDS:
            curves[kind][name] = held_out_curve(folder, recipes[name], kind, starts[kind])
    eff: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
    for kind in KINDS:
        for seed in seeds:
            m, g = run_name("mapo", seed, prefix), run_name("grpo", seed, prefix)
            eff[kind][seed] = efficiency(curves[kind][m], curves[kind][g])
    results: dict[str, Any] = {
        "seeds": seeds,
        "runs": {
            n: {"seed": d["seed"], "iterations": d["train"]["iterations"]}
            for n, d in recipes.items()
        },
        "advantage": {
            method: mapo.describe(
                Recipe.model_validate(
                    recipes[run_name(method, seeds[0], prefix)]
                ).advantage.resolve()
            )
            for method in METHODS
        },
        "eval": cfg.model_dump(),
        "sft_policy": start.policy.path,
        "arithmetic": arith,
        "train_seconds": train_s,
        "held_out": held,
        "sample_efficiency": eff,
        "median_ratio": {kind: _median([e["ratio"] for e in eff[kind].values()]) for kind in KINDS},
        "mapo_vs_grpo": {},
    }
    sft_scores = judged_scores(trajs["sft"]["policy"], pcs)
    results["all_vs_sft"] = {  # every held-out episode, both task kinds: the headline figure
        name: win_rate(
            judged_scores(trajs[name]["policy"], pcs), sft_scores, cfg.bootstrap, cfg.seed
        )
        for name in folders
    }
    results["half_budget"] = {
        kind: {
            seed: half_budget(recipes, trajs, pcs, cfg, seed, prefix, kind, results["held_out"])
            for seed in seeds
        }
        for kind in KINDS
    }
    for seed in seeds:
        m, g = run_name("mapo", seed, prefix), run_name("grpo", seed, prefix)
        results["mapo_vs_grpo"][seed] = win_rate(
            judged_scores(trajs[m]["policy"], pcs),
            judged_scores(trajs[g]["policy"], pcs),
            cfg.bootstrap,
            cfg.seed,
        )
    results["seconds"] = time.perf_counter() - t0
    write_html(
        out / "report.html",
        "kitchen main job: MAPO on the concierge world",
        report_sections(results, curves, folders, trajs, pcs, prefix),
        intro=f"{results['seconds'] / 60:.1f} minutes end to end on {arith['device']} (GRM review "
        f"in {arith['review']}, update in {arith['update']}); `kitchen demo` re-creates it. "
        "Evaluation uses the independent rule judge on held-out tasks and diners.",
    )
    atomic_write_json(out / "results.json", json_ready(results))
    atomic_write_text(out / "table.md", seeds_table(results, prefix))
    return results


def _start(rows: list[dict[str, Any]], kind: str) -> float:
    """The held-out compliance at iteration 0 (the SFT policy): a run's first evaluation."""
    for row in rows:
        if row.get("iteration") == 0:
            return (row.get("by_kind") or {}).get(kind, {}).get("compliance", float("nan"))
    return float("nan")


def _median(values: Sequence[float | None]) -> float | None:
    """The median over seeds; a seed where MAPO never reached GRPO's level counts as above
    every ratio (∞), so it can only push the median up; None when no seed has a number."""
    xs = [float("inf") if v is None else v for v in values]
    if not xs or all(x == float("inf") for x in xs):
        return None
    return statistics.median(xs)


def _frame(curves: dict[str, pl.DataFrame], prefix: str) -> pl.DataFrame:
    rows = []
    for name, c in curves.items():
        method = "mapo" if "-mapo" in name else "grpo"
        seed = int(name.rsplit("-s", 1)[1]) if name.rsplit("-", 1)[-1].startswith("s") else 0
        rows += [{"method": method, "seed": seed, **r} for r in c.to_dicts()]
    return pl.DataFrame(
        rows,
        schema={"method": pl.String, "seed": pl.Int64, "episodes": pl.Int64, "value": pl.Float64},
    )


def report_sections(results, curves, folders, trajs, pcs, prefix) -> list[Section]:
    """The report: summary per task kind, sample efficiency with the curves, per-clause pass
    rates, personalisation per profile group, side-by-side dialogues, then each run."""
    held = results["held_out"]
    names = ["sft", *folders]
    sections = []
    for kind in KINDS:
        if kind not in held["sft"]:
            continue
        s = Section(
            f"{'Meals (long tasks)' if kind == 'long' else 'Single dishes (short tasks)'}: "
            "RL policies vs the SFT policy (held-out tasks and diners, rule judge)"
        )
        rows = []
        for name in names:
            r = held[name][kind]
            wr = r.get("win_rate_vs_sft")
            rows.append(
                {
                    "policy": name,
                    "episodes": r["episodes"],
                    "win rate vs sft": None if wr is None else wr[0],
                    "95% interval": ""
                    if wr is None or no_data(wr[0])
                    else f"{wr[1]:.2f}–{wr[2]:.2f}",
                    "success": r["success"],
                    "compliance": r["compliance"],
                    "axiom violations": r["axiom_violations"],
                    "… with the guard": None
                    if "guarded" not in r
                    else r["guarded"]["axiom_violations"],
                }
            )
        s.table(pl.DataFrame(rows))
        s.table(
            pl.DataFrame(
                [
                    {"clause": c, **{n: held[n][kind]["clause_pass"].get(c) for n in names}}
                    for c in sorted(held["sft"][kind]["clause_pass"])
                ]
            ),
            "pass rate per clause",
        )
        s.table(
            pl.DataFrame(
                [
                    {
                        "group": g["group"],
                        "clause": g["clause"],
                        **{
                            f"{n} pass": _interval(
                                next(
                                    x for x in held[n][kind]["groups"] if x["group"] == g["group"]
                                ),
                                "pass",
                            )
                            for n in names
                        },
                        **{
                            f"{n} words": _interval(
                                next(
                                    x for x in held[n][kind]["groups"] if x["group"] == g["group"]
                                ),
                                "words",
                                ".1f",
                            )
                            for n in names
                        },
                    }
                    for g in held["sft"][kind]["groups"]
                ]
            ),
            "personalisation per profile group: pass rate of the clause the group's preference "
            "turns on, and words per message (95% intervals over episodes)",
        )
        eff = results["sample_efficiency"][kind]
        s.text(efficiency_text(eff, results["median_ratio"][kind], kind))
        if "half_budget" in results:
            s.text(half_text(results["half_budget"][kind], kind))
        s.chart(
            charts.method_curves(
                _frame(curves[kind], prefix),
                title=f"held-out judged compliance, {kind} tasks",
                y_title="compliance",
            )
        )
        sections.append(s)
    s = Section("What each method computes")
    s.text(
        "The runs share one recipe and differ in the advantage estimator alone (the GRPO runs "
        "are the recipe's `compare: grpo` arm, with MAPO's state key and loss)."
    )
    for method, text in results["advantage"].items():
        s.pre(f"{method}: {text}")
    sections.append(s)
    s = Section("Side by side: the same held-out task and diner")
    shown = [
        "sft",
        run_name("mapo", results["seeds"][0], prefix),
        run_name("grpo", results["seeds"][0], prefix),
    ]
    for head, texts in side_by_side(trajs, pcs, shown):
        s.text(head)
        for name, text in zip(shown, texts, strict=True):
            s.pre(f"— {name} —\n{text}")
    sections.append(s)
    for name, folder in folders.items():
        sections += run_sections(folder, name)
    return sections


def _interval(row: dict[str, Any], key: str, fmt: str = ".1%") -> str:
    v, lo, hi = row[key], row[f"{key}_low"], row[f"{key}_high"]
    return "no data" if no_data(v) else f"{v:{fmt}} [{lo:{fmt}}, {hi:{fmt}}]"


def efficiency_text(eff: dict[Any, dict[str, Any]], median: float | None, kind: str) -> str:
    """The sample-efficiency comparison of one task kind in a sentence or two."""
    parts = []
    for seed, e in eff.items():
        if e["target"] is None:
            parts.append(f"seed {seed}: no curve")
            continue
        if not e.get("improved", True):
            parts.append(
                f"seed {seed}: GRPO ended at {e['target']:.3f}, no higher than it started, so "
                "there is no level to race to (no ratio)"
            )
            continue
        reached = "never" if e["mapo_episodes"] is None else f"after {e['mapo_episodes']}"
        parts.append(
            f"seed {seed}: GRPO ended at {e['target']:.3f} after {e['grpo_episodes']} episodes; "
            f"MAPO reached it {reached}"
            + ("" if e["ratio"] is None else f" ({e['ratio']:.2f}× GRPO's episodes)")
        )
    med = "no data" if median is None else f"{median:.2f}×"
    return (
        f"{kind} tasks — MAPO's training episodes to reach GRPO's final held-out compliance, "
        f"as a share of GRPO's (median over seeds: {med}; ≤ 0.5 means half the samples): "
        + "; ".join(parts)
    )


def half_text(half: dict[Any, dict[str, Any]], kind: str) -> str:
    """The half-budget comparison of one task kind (`half_budget` per seed) in a sentence."""
    rows = {s: h for s, h in half.items() if h.get("difference") is not None}
    if not rows:
        return f"{kind} tasks — MAPO at half its budget: no kept checkpoint to evaluate."
    first = next(iter(rows.values()))
    diffs = [h["difference"][0] for h in rows.values()]
    per_seed = "; ".join(
        f"seed {s}: {h['mapo_half']:.3f} vs {h['grpo_final']:.3f}, difference "
        f"{h['difference'][0]:+.3f} [{h['difference'][1]:+.3f}, {h['difference'][2]:+.3f}]"
        for s, h in rows.items()
    )
    source = (
        "a run of its own"
        if first.get("mapo_half_from") == "run"
        else "its run's checkpoint, mid-schedule"
    )
    return (
        f"{kind} tasks — MAPO after {first['mapo_episodes']} episodes ({source}) against GRPO "
        f"after {first['grpo_episodes']}, held-out compliance (≥ 0: MAPO reached GRPO's final level "
        f"with half the episodes): median difference {statistics.median(diffs):+.3f}; {per_seed}."
    )


def seeds_table(results: dict[str, Any], prefix: str) -> str:
    """The README's results table (Markdown): per task kind and method, median and range over
    seeds of the held-out figures, and the sample-efficiency ratios."""
    held = results["held_out"]
    seeds = results["seeds"]
    lines = [
        f"Seeds {', '.join(map(str, seeds))}; {results['eval']['tasks']} held-out tasks × "
        f"{results['eval']['samples']} samples; median [min, max] over seeds.",
        "",
    ]
    every = results.get("all_vs_sft") or {}
    if every:
        lines += ["**all held-out episodes**", "", "| | MAPO | GRPO |", "|---|---:|---:|"]
        for label, i in (("win rate vs SFT", 0), ("95% interval low", 1)):
            cells = [
                _spread([every[run_name(method, s, prefix)][i] for s in seeds])
                for method in METHODS
            ]
            lines.append(f"| {label} | {' | '.join(cells)} |")
        h2h = ", ".join(
            f"seed {s}: {_num(w[0])} [{_num(w[1])}, {_num(w[2])}]"
            for s, w in results["mapo_vs_grpo"].items()
        )
        lines += ["", f"MAPO vs GRPO head to head: {h2h}.", ""]
    for kind in KINDS:
        if kind not in held["sft"]:
            continue
        lines += [f"**{kind} tasks**", "", "| | SFT | MAPO | GRPO |", "|---|---:|---:|---:|"]

        def cell(method: str, fn, kind: str = kind) -> str:
            if method == "sft":
                return _num(fn(held["sft"][kind]))
            return _spread([fn(held[run_name(method, s, prefix)][kind]) for s in seeds])

        for label, fn, sft_has_it in (
            ("win rate vs SFT", lambda r: (r.get("win_rate_vs_sft") or [None])[0], False),
            ("95% interval low", lambda r: (r.get("win_rate_vs_sft") or [None, None])[1], False),
            ("success", lambda r: r["success"], True),
            ("compliance", lambda r: r["compliance"], True),
            ("axiom violations", lambda r: r["axiom_violations"], True),
            (
                "… with the guard",
                lambda r: (r.get("guarded") or {}).get("axiom_violations"),
                False,
            ),
        ):
            sft = cell("sft", fn) if sft_has_it else "—"  # not compared with itself, not guarded
            lines.append(f"| {label} | {sft} | {cell('mapo', fn)} | {cell('grpo', fn)} |")
        for g in held["sft"][kind]["groups"]:

            def rate(r, group=g["group"]):
                return next(x for x in r["groups"] if x["group"] == group)["pass"]

            lines.append(
                f"| {g['clause']} pass, {g['group']} | {cell('sft', rate)} | {cell('mapo', rate)} "
                f"| {cell('grpo', rate)} |"
            )
        shown = ", ".join(
            "GRPO did not improve"
            if e.get("improved") is False
            else ("never" if e["ratio"] is None else f"{e['ratio']:.2f}")
            for e in results["sample_efficiency"][kind].values()
        )
        med = results["median_ratio"][kind]
        lines += [
            "",
            f"MAPO episodes to reach GRPO's final held-out compliance / GRPO's episodes: median "
            f"{'no data' if med is None else f'{med:.2f}'} (per seed: {shown}; the in-training "
            "curve's few held-out tasks).",
            "",
        ]
        if "half_budget" in results:
            lines += [half_text(results["half_budget"][kind], kind), ""]
    return "\n".join(lines)


def _spread(values: Sequence[Any]) -> str:
    """Per-seed values as "median [min, max]" (one value as itself), over the runs that have
    one; "no data" where none has."""
    vals = [v for v in values if v is not None and not no_data(v)]
    if not vals:
        return "no data"
    if len(vals) == 1:
        return _num(vals[0])
    return f"{_num(statistics.median(vals))} [{_num(min(vals))}, {_num(max(vals))}]"


def _num(v: Any) -> str:
    if v is None or no_data(v):
        return "no data"
    if isinstance(v, int):
        return str(v)
    return f"{v:.1%}" if 0 <= v <= 1 else f"{v:.2f}"


def summary(results: dict[str, Any], prefix: str = "demo") -> str:
    """The results as a few readable lines."""
    lines = []
    held = results["held_out"]

    def rate(w: Any) -> str:  # (rate, low, high)
        return "no data" if w is None or no_data(w[0]) else f"{w[0]:.1%} [{w[1]:.1%}, {w[2]:.1%}]"

    seed = results["seeds"][0]
    for kind in KINDS:
        if kind not in held["sft"]:
            continue
        s = held["sft"][kind]
        lines.append(
            f"{kind} tasks — sft: success {show(s['success'], '.1%')}, compliance "
            f"{show(s['compliance'])}, axiom violations {s['axiom_violations']}"
        )
        for method in METHODS:
            r = held[run_name(method, seed, prefix)][kind]
            lines.append(
                f"  {method}: win rate vs SFT {rate(r.get('win_rate_vs_sft'))}, success "
                f"{show(r['success'], '.1%')}, compliance {show(r['compliance'])}, axiom "
                f"violations {r['axiom_violations']} ({r['guarded']['axiom_violations']} with the "
                "guard)"
            )
        med = results["median_ratio"][kind]
        lines.append(
            f"  MAPO's episodes to GRPO's final held-out compliance: "
            f"{'no data' if med is None else f'{med:.2f}× GRPO’s'}"
        )
        if "half_budget" in results:
            lines.append("  " + half_text(results["half_budget"][kind], kind))
    every = results.get("all_vs_sft") or {}
    if every:
        lines.append(
            "all held-out episodes — "
            + ", ".join(
                f"{m}: win rate vs SFT {rate(every[run_name(m, seed, prefix)])}" for m in METHODS
            )
        )
    lines.append(
        "mapo vs grpo head to head: "
        + ", ".join(f"seed {s} {rate(w)}" for s, w in results["mapo_vs_grpo"].items())
    )
    name = "demo" if prefix == "demo" else prefix
    lines.append(
        f"report: {paths.RUNS / name / 'report.html'} ({results['seconds'] / 60:.1f} min); "
        f"table: {paths.RUNS / name / 'table.md'}"
    )
    return "\n".join(lines)
