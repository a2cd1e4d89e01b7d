"""The credit-assignment lab: a tabular multi-step task on which every preset trains in seconds.

The method argues (docs/method.md#credit-assignment) that outcome-only group normalisation (GRPO)
assigns credit too coarsely on long multi-step tasks, that process rewards fed to GRPO-style
groups need a comparison set per intermediate state, and that the replay buffer is what supplies
it (docs/method.md#replay-buffer). This module is a world
small enough to measure that claim many times over, in pure torch:

- An episode has `horizon` turns. At turn t the agent sees a situation c_t (one of `situations`,
  drawn at random: the diner's mood, the request's wording) and picks one of `actions`; its
  policy is a softmax table θ[t, c, a]. The state key of a turn is (t, c_t).
- One early turn, `key_step`, decides the task: exactly one action there is correct (say,
  "check the allergens"). Every other turn has one trap action (say, "recommend a dish the diner
  is allergic to") that also ruins the task. Outcome = 1 iff the key action was correct and no
  trap was taken. A uniform policy succeeds with probability (1/A)·(1 − 1/A)^(H−1), which falls
  geometrically with the horizon H: outcome-only groups are mostly all-zero.
- Every turn also gets a local reward, the judge's verdict on that turn: +1 for the good action
  (the correct one at the key turn, a designated good one elsewhere), −1 for a trap, 0 otherwise,
  plus a per-state offset (some situations are judged harshly whatever the agent does;
  `state_spread`) and Gaussian noise (`local_noise`). Offsets are what state groups remove and
  turn or batch groups cannot.

`train` runs one preset for many seeds at once (random seeds are a batch dimension: one
`ReplayBuffer`, one `mapo.advantages` call and one Adam step per update, rows tagged with their
seed so no statistic mixes seeds), through exactly the code path a language-model trainer uses:
`mapo.returns_for` → `steps.StepSamples` → `steps.advantages_for` (the replay buffer where the
preset uses one) → `mapo.mapo_loss`. The success rate is computed exactly from θ (no evaluation
noise); "samples" are rollouts (episodes) drawn from the environment, so replayed history is
free, as it is in a real run.

Departures from a language-model run:
1. One action is one token, so the loss-aggregation modes differ only by constant factors, which
   Adam removes; the presets differ here by their advantages alone.
2. The reference policy of the KL term is the initial (uniform) policy.
3. The action's "token id" is its flat index in θ, so a replayed record can be re-scored from its
   tokens alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from pydantic import Field, model_validator

from kitchen import mapo
from kitchen.buffer import ReplayBuffer
from kitchen.config import StrictModel
from kitchen.mapo import AdvantageConfig
from kitchen.steps import StepSamples, advantages_for

Tensor = torch.Tensor


class LabConfig(StrictModel):
    """The tabular world and the training budget of the credit-assignment lab."""

    horizon: int = Field(8, ge=2, le=64, description="Turns per episode (H).")
    actions: int = Field(4, ge=2, le=32, description="Actions per turn (A).")
    situations: int = Field(
        3, ge=1, le=32, description="Situations per turn; the state key is (turn, situation)."
    )
    key_step: int = Field(1, ge=0, description="The early turn whose action decides success.")
    local_noise: float = Field(
        0.5, ge=0.0, description="Std of the Gaussian noise on each local reward (judge noise)."
    )
    state_spread: float = Field(
        1.0,
        ge=0.0,
        description="Std of the per-state offset of local rewards: how much the judge's baseline "
        "differs between situations. 0 makes turn groups as good as state groups.",
    )
    k: int = Field(8, ge=2, description="Rollouts per task group (GRPO's K).")
    lr: float = Field(0.1, gt=0.0, description="Adam learning rate on the logits table.")
    updates: int = Field(
        400, ge=1, description="Budget of policy updates; each consumes k episodes per seed."
    )
    target: float = Field(
        0.6, gt=0.0, lt=1.0, description="Success rate that counts as solved (exact, from θ)."
    )
    capacity: int = Field(2048, ge=1, description="Replay-buffer records per seed.")
    max_age: int | None = Field(
        4, ge=0, description="Replay-buffer max age in policy updates (None: capacity only)."
    )
    seed: int = Field(0, description="Seed of the worlds and of sampling.")

    @model_validator(mode="after")
    def _check(self) -> LabConfig:
        if self.key_step >= self.horizon:
            raise ValueError(f"key_step {self.key_step} must be below horizon {self.horizon}")
        return self


@dataclass
class World:
    """`seeds` independent worlds: good and trap actions and judge offsets per state."""

    good: Tensor  # [S, H, C] the good action (the correct one at the key step)
    trap: Tensor  # [S, H, C] the trap action, −1 at the key step (any wrong action fails there)
    offset: Tensor  # [S, H, C] the judge's per-state offset


def make_world(config: LabConfig, seeds: int, generator: torch.Generator) -> World:
    """Draw good/trap actions (distinct) and per-state offsets for each seed."""
    shape = (seeds, config.horizon, config.situations)
    good = torch.randint(config.actions, shape, generator=generator)
    shift = torch.randint(1, config.actions, shape, generator=generator)
    trap = (good + shift) % config.actions  # never the good action
    trap[:, config.key_step] = -1
    offset = torch.randn(shape, generator=generator) * config.state_spread
    return World(good, trap, offset)


@dataclass
class Rollouts:
    """K episodes per seed: every tensor is [S, K, H] except `success` [S, K]."""

    situation: Tensor
    action: Tensor
    logp: Tensor
    quality: Tensor  # the judge's verdict without offset or noise: +1 good, −1 trap, 0 otherwise
    local: Tensor
    success: Tensor


def rollout(world: World, theta: Tensor, config: LabConfig, generator: torch.Generator) -> Rollouts:
    """Sample K episodes per seed from the softmax policy θ [S, H, C, A]."""
    S, H, C, A = theta.shape
    K = config.k
    c = torch.randint(C, (S, K, H), generator=generator)
    s_idx = torch.arange(S)[:, None, None].expand(S, K, H)
    t_idx = torch.arange(H)[None, None, :].expand(S, K, H)
    with torch.no_grad():
        logits = theta[s_idx, t_idx, c]  # [S, K, H, A]
        logp_all = torch.log_softmax(logits, -1)
        a = torch.multinomial(logp_all.exp().reshape(-1, A), 1, generator=generator)
        a = a.reshape(S, K, H)
        logp = logp_all.gather(-1, a[..., None]).squeeze(-1)
    good = a == world.good[s_idx, t_idx, c]
    trapped = a == world.trap[s_idx, t_idx, c]
    quality = good.float() - trapped.float()
    noise = torch.randn(S, K, H, generator=generator) * config.local_noise
    local = world.offset[s_idx, t_idx, c] + quality + noise
    success = good[:, :, config.key_step] & ~trapped.any(-1)
    return Rollouts(c, a, logp, quality, local, success)


def success_rate(world: World, theta: Tensor, key_step: int) -> Tensor:
    """Exact success probability of the softmax policy per seed [S] (situations are uniform):
    P = E_c[π_key(correct | c)] · Π_(t ≠ key) E_c[1 − π_t(trap | c)]."""
    with torch.no_grad():
        p = torch.softmax(theta, -1)  # [S, H, C, A]
        p_good = p.gather(-1, world.good[..., None]).squeeze(-1)
        p_trap = p.gather(-1, world.trap.clamp(min=0)[..., None]).squeeze(-1)
        p_trap = p_trap * (world.trap >= 0)
        survive = (1.0 - p_trap).mean(-1)  # [S, H]; 1 at the key step
        return p_good[:, key_step].mean(-1) * survive.prod(-1)


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread, then restore. The lab's tensors are tiny: a second thread only
    adds synchronisation, and when another process holds the other core each parallel op waits
    a scheduler tick for it (measured: 10× slower on a shared 2-core machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@dataclass
class LabRun:
    """One preset trained on `seeds` worlds."""

    preset: str
    horizon: int
    episodes: list[int]  # episodes per seed consumed after each logged point
    success: Tensor  # [points, S] exact success rate at each logged point
    samples_to_target: Tensor  # [S] episodes until success ≥ target (inf: not within budget)
    metrics: list[dict[str, float]] = field(default_factory=list)  # per update, seeds pooled


def _flat(x: Tensor) -> Tensor:
    return x.reshape(-1)


def _step_samples(
    config: LabConfig, ro: Rollouts, ret: Tensor, update: int
) -> tuple[StepSamples, Tensor]:
    """One update's rollouts as step samples ([S·K·H] rows), and each row's judged quality."""
    S, K, H = ro.action.shape
    A, C = config.actions, config.situations
    seed = torch.arange(S)[:, None, None].expand(S, K, H)
    turn = torch.arange(H)[None, None, :].expand(S, K, H)
    state = (seed * H + turn) * C + ro.situation  # unique per (seed, turn, situation)
    group = update * S + seed  # one task group per seed and update
    traj = group * K + torch.arange(K)[None, :, None]
    samples = StepSamples(
        state=_flat(state),
        tokens=_flat(state * A + ro.action),  # one token per step: its flat index into θ
        logp=_flat(ro.logp),
        tok_len=torch.ones(S * K * H, dtype=torch.long),
        local_reward=_flat(ro.local),
        ret=_flat(ret),
        global_reward=_flat(ro.success.float()[:, :, None].expand(S, K, H)),
        task_group=_flat(group),
        traj=_flat(traj),
        turn=_flat(turn),
        version=update,
        run=_flat(seed),
    )
    return samples, _flat(ro.quality)


def train(
    config: LabConfig, adv: AdvantageConfig, seeds: int = 10, *, stop_at_target: bool = True
) -> LabRun:
    """Train `adv` on `seeds` worlds for up to `config.updates` updates; see the module doc."""
    if adv.kl_target is not None:  # its runs share one θ tensor, so they would share one β
        raise ValueError(
            "the lab keeps β fixed (its seeds train as one batch): set kl_target: null"
        )
    with one_thread():
        return _train(config, adv, seeds, stop_at_target)


def _train(config: LabConfig, adv: AdvantageConfig, seeds: int, stop_at_target: bool) -> LabRun:
    S, H, C, A = seeds, config.horizon, config.situations, config.actions
    gen = torch.Generator().manual_seed(config.seed)
    world = make_world(config, S, gen)
    theta = torch.zeros(S, H, C, A, requires_grad=True)
    opt = torch.optim.Adam([theta], lr=config.lr)
    buffer = ReplayBuffer(capacity=config.capacity * S, max_age=config.max_age)

    success = [success_rate(world, theta, config.key_step)]
    episodes = [0]
    reached = torch.full((S,), math.inf)
    reached[success[0] >= config.target] = 0.0
    metrics: list[dict[str, float]] = []
    for update in range(config.updates):
        ro = rollout(world, theta, config, gen)
        ret = mapo.returns_for(
            adv, ro.local.reshape(S * config.k, H), ro.success.reshape(-1).float()
        )
        samples, _quality = _step_samples(config, ro, ret, update)
        scored = advantages_for(samples, adv, buffer, step=update)
        tok = scored.samples.tokens  # [G]: one token per step sample
        logp = torch.log_softmax(theta.reshape(-1, A), -1)[tok // A, tok % A][:, None]  # [G, 1]
        loss, lm = mapo.mapo_loss(
            logp,
            scored.adv,
            torch.ones_like(logp, dtype=torch.bool),
            ref_logp=torch.full_like(logp, -math.log(A)),
            old_logp=scored.samples.logp[:, None] if adv.reads_old_logp else None,
            **adv.loss_kwargs(),
        )
        m = scored.metrics
        opt.zero_grad()
        loss.backward()
        opt.step()

        p = success_rate(world, theta, config.key_step)
        success.append(p)
        episodes.append((update + 1) * config.k)
        newly = (p >= config.target) & torch.isinf(reached)
        reached[newly] = float((update + 1) * config.k)
        metrics.append(m | lm)
        if stop_at_target and not torch.isinf(reached).any():
            break
    return LabRun(adv.name, H, episodes, torch.stack(success), reached, metrics)


def median_samples(run: LabRun) -> float:
    """Median over seeds of the episodes needed to reach the target: the lower median for an
    even number of seeds, inf when more than half never reached it within the budget."""
    return float(torch.quantile(run.samples_to_target, 0.5, interpolation="lower"))


def compare(
    config: LabConfig,
    presets: dict[str, AdvantageConfig],
    horizons: list[int],
    seeds: int = 10,
) -> list[LabRun]:
    """Train every preset at every horizon on the same worlds (same seed); one run each."""
    runs = []
    for h in horizons:
        cfg = config.model_copy(update={"horizon": h})
        for adv in presets.values():
            runs.append(train(cfg, adv, seeds))
    return runs


def samples_table(runs: list[LabRun], baseline: str = "grpo") -> list[dict]:
    """Rows (preset, horizon): median episodes to target over seeds, the fraction of seeds that
    reached it, and the ratio to `baseline` at the same horizon (< 1: fewer samples). When the
    baseline's median never reached the target, its budget stands in and the ratio is an upper
    bound (`bound` is True)."""
    base = {r.horizon: r for r in runs if r.preset == baseline}
    rows = []
    for r in runs:
        med = median_samples(r)
        ratio, bound = math.nan, False
        b = base.get(r.horizon)
        if b is not None and math.isfinite(med):
            b_med = median_samples(b)
            bound = math.isinf(b_med)
            denom = b.episodes[-1] if bound else b_med
            ratio = med / denom if denom > 0 else math.nan
        rows.append(
            {
                "preset": r.preset,
                "horizon": r.horizon,
                "median_episodes": med,
                "reached": float((~torch.isinf(r.samples_to_target)).float().mean()),
                "budget": r.episodes[-1] if r.episodes else 0,
                f"vs_{baseline}": ratio,
                "bound": bound,
            }
        )
    return rows


def curve_rows(run: LabRun, every: int = 1) -> list[dict]:
    """Sample-efficiency curve: mean success over seeds with a 95% normal band, per logged point."""
    rows = []
    s = run.success
    n = s.shape[1]
    for i in range(0, s.shape[0], every):
        mean = float(s[i].mean())
        half = 1.96 * float(s[i].std(unbiased=True)) / math.sqrt(n) if n > 1 else 0.0
        rows.append(
            {
                "preset": run.preset,
                "horizon": run.horizon,
                "episodes": run.episodes[i],
                "success": mean,
                "low": max(0.0, mean - half),
                "high": min(1.0, mean + half),
            }
        )
    return rows


def credit_snapshot(
    config: LabConfig, presets: dict[str, AdvantageConfig], seeds: int = 10, warmup: int = 4
) -> list[dict]:
    """The advantage every preset gives the same rollouts of the initial (uniform) policy.

    Buffer-backed presets first see `warmup` earlier batches from the same policy (their history).
    Returns one row per (preset, step sample): turn, whether it is the key turn, the action's
    judged quality (+1 good, 0 neutral or wrong key, −1 trap), success, and the advantage.
    """
    with one_thread():
        return _credit_snapshot(config, presets, seeds, warmup)


def _credit_snapshot(
    config: LabConfig, presets: dict[str, AdvantageConfig], seeds: int, warmup: int
) -> list[dict]:
    S, H, A = seeds, config.horizon, config.actions
    gen = torch.Generator().manual_seed(config.seed + 1)
    world = make_world(config, S, gen)
    theta = torch.zeros(S, H, config.situations, A)
    batches = [rollout(world, theta, config, gen) for _ in range(warmup + 1)]
    out = []
    for adv in presets.values():
        buffer = ReplayBuffer(capacity=config.capacity * S, max_age=None)
        for u, ro in enumerate(batches):  # the earlier batches only fill the buffer (if used)
            ret = mapo.returns_for(
                adv, ro.local.reshape(S * config.k, H), ro.success.reshape(-1).float()
            )
            samples, quality = _step_samples(config, ro, ret, u)
            scored = advantages_for(samples, adv, buffer, step=adv.alpha.steps)  # α after schedule
        a = scored.adv[: scored.n_fresh]
        succ = samples.global_reward
        for t, q, s, v in zip(
            samples.turn.tolist(), quality.tolist(), succ.tolist(), a.tolist(), strict=True
        ):
            out.append(
                {
                    "preset": adv.name,
                    "turn": t,
                    "key": t == config.key_step,
                    "quality": q,
                    "success": s,
                    "advantage": v,
                }
            )
    return out


def credit_by_turn(rows: list[dict]) -> list[dict]:
    """Per (preset, turn): corr(advantage, the action's judged quality) — how much of a turn's
    advantage is about that turn's own action (1: all of it; 0: none) — and mean |advantage|."""
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for r in rows:
        groups.setdefault((r["preset"], r["turn"]), []).append((r["advantage"], r["quality"]))
    out = []
    for (preset, turn), pairs in groups.items():
        x = torch.tensor(pairs, dtype=torch.float64)
        a, q = x[:, 0], x[:, 1]
        sa, sq = a.std(unbiased=False), q.std(unbiased=False)
        corr = (
            float(((a - a.mean()) * (q - q.mean())).mean() / (sa * sq))
            if sa > 0 and sq > 0
            else 0.0
        )
        out.append(
            {"preset": preset, "turn": turn, "credit": corr, "abs_advantage": float(a.abs().mean())}
        )
    return out


def metric_rows(runs: list[LabRun], names: list[str]) -> list[dict]:
    """Training metrics per update as long rows (preset, horizon, episodes, metric, value)."""
    out = []
    for r in runs:
        for i, m in enumerate(r.metrics):
            for name in names:
                if name in m:
                    out.append(
                        {
                            "preset": r.preset,
                            "horizon": r.horizon,
                            "episodes": r.episodes[i + 1],
                            "metric": name,
                            "value": float(m[name]),
                        }
                    )
    return out


def halving_check(table: list[dict], preset: str = "mapo", baseline: str = "grpo") -> dict:
    """Does `preset` need at most half of `baseline`'s samples as the horizon grows?

    Returns the ratio (preset / baseline median episodes) per horizon, whether the ratio at the
    largest horizon is ≤ 0.5, and whether the ratio falls as the horizon grows.
    """
    col = f"vs_{baseline}"
    ratios = {r["horizon"]: r[col] for r in table if r["preset"] == preset and col in r}
    hs = sorted(ratios)
    last = ratios[hs[-1]] if hs else math.nan
    falling = all(ratios[a] >= ratios[b] for a, b in zip(hs, hs[1:], strict=False))
    return {
        "ratios": ratios,
        "largest_horizon": hs[-1] if hs else None,
        "halved": bool(math.isfinite(last) and last <= 0.5),
        "falling": falling,
    }
