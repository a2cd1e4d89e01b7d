"""MAPO: group-normalised local and global advantages, mixed by α, trained with REINFORCE.

The method's optimiser (docs/method.md#mapo) is "group normalisation + replay buffer +
REINFORCE": no value network; every step sample gets two advantages and a mix of them,

    A_local(s, a)  = z-score of the step's local reward within its *state group*
                     (samples whose state key is equal, collected now and kept in the replay buffer)
    A_global(τ)    = z-score of the trajectory's outcome within its *task group* (K rollouts of
                     the same task, as in GRPO)
    A              = α · A_local + (1 − α) · A_global,  α on a schedule (global first, local later)

and the policy moves by `−A · log π(action tokens)` plus `β · KL(π ‖ π_ref)`.

Everything here is a pure tensor function with its equation in the docstring. The peers (GRPO,
Dr. GRPO, RLOO, REINFORCE++, GiGPO, the MAPO paper) are not separate code paths: each is an
`AdvantageConfig` in `PRESETS` — a choice of signal, grouping, normalisation, mix and loss
aggregation for the same functions — so they can be compared in one run (notebook 04).

Shapes: `N` step samples (one row per agent turn), `B` sequences and `T` tokens for the loss.
Group ids are int64 tensors; any keys may be used, they are made dense with `torch.unique`.
All reductions are `index_add_` / `scatter_reduce_` over group codes: no Python loop over samples.

Departures from the method (docs/method.md), and from the sources of the presets:
1. The method normalises "within the group" without saying how a group of one sample or a group
   whose rewards are all equal is handled. Here: a zero-variance group gives advantage 0 exactly
   (counted in `group/*_zero_var_frac`); a singleton *state* group falls back to 0, to its
   turn-level group (same task group and turn index), or to batch normalisation (`singleton`).
   A singleton *task* group gives 0, as TRL's GRPO (and verl's vectorised RLOO) do; verl's and
   verl-agent's GRPO instead pass a lone sample's reward through unnormalised (mean 0, std 1).
2. The method leaves "local reward" as one scalar per step. We allow its Monte-Carlo return over
   later steps (`gamma`), since a turn's choice also shapes later turns' verdicts (docs/method.md#credit-assignment).
3. Old samples from the buffer enter the *statistics* of the state groups; by default they do not
   enter the gradient (their log-probs came from an older policy). `replay_in_gradient` adds them
   with truncated importance weights min(π_now/π_old, `is_cap`) (Espeholt et al., 2018).
4. Zero-variance groups are detected exactly (max == min) instead of relying on `r − mean`
   being 0 in floating point; statistics are computed in float64. Results agree with TRL's and
   verl's float32 code to float32 precision.
5. `reinforce_pp` whitens its returns over *turns*; verl's REINFORCE++
   (`compute_reinforce_plus_plus_outcome_advantage`) whitens over *response tokens*, so there a
   turn weighs in the batch mean and std by its length. Here every step row weighs the same, as
   in every other preset. Example, γ = 1 (so the tokens of a turn share its return): two turns
   with returns 1 and 0, 3 tokens and 1 token long. verl whitens [1, 1, 1, 0] (mean 0.75, Bessel
   std 0.5) → +0.5 on each token of the first turn, −1.5 on the second; here [1, 0] (mean 0.5,
   std 0.707) → +0.707 and −0.707. The signs agree; the centre and the scale differ whenever
   turn lengths do (`tests/test_mapo.py` checks this example).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field, model_validator

from kitchen.config import StrictModel

Tensor = torch.Tensor

# --------------------------------------------------------------------------------------------
# Group codes
# --------------------------------------------------------------------------------------------


def encode(keys: Sequence[Hashable]) -> Tensor:
    """Dense int64 codes for arbitrary hashable keys, in order of first appearance. O(N) Python.

    Use it for small batches of string ids; large stores (the replay buffer) keep their own codes.
    """
    table: dict[Hashable, int] = {}
    return torch.tensor([table.setdefault(k, len(table)) for k in keys], dtype=torch.long)


def dense(groups: Tensor) -> tuple[Tensor, int]:
    """Map int keys [N] (or key rows [N, k]) to dense codes 0..G-1. Returns (codes[N], G)."""
    if groups.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=groups.device), 0
    uniq, inv = torch.unique(groups, dim=0 if groups.dim() > 1 else None, return_inverse=True)
    return inv.reshape(-1), uniq.shape[0]


def pair(a: Tensor, b: Tensor) -> Tensor:
    """Group key for "same a and same b" (e.g. task group × turn): rows of a [N, 2] tensor."""
    return torch.stack([a.long(), b.long()], dim=1)


def _first_index(code: Tensor, n_groups: int) -> Tensor:
    """[G] index of the first row of each group."""
    first = torch.full((n_groups,), len(code), dtype=torch.long, device=code.device)
    idx = torch.arange(len(code), device=code.device)
    return first.scatter_reduce_(0, code, idx, "amin")


# --------------------------------------------------------------------------------------------
# Normalisation
# --------------------------------------------------------------------------------------------


class Norm(StrictModel):
    """How a group's values become advantages: `(r − baseline) / scale`."""

    baseline: Literal["mean", "loo"] = Field(
        "mean",
        description="'mean' subtracts the group mean (GRPO). 'loo' subtracts the mean of the "
        "*other* members, the leave-one-out baseline of RLOO (Kool et al. 2019; Ahmadian et al. "
        "2024), which keeps the estimator unbiased; it equals n/(n−1)·(r − mean).",
    )
    scale: Literal["std", "none", "batch"] = Field(
        "std",
        description="'std' divides by the group's standard deviation (z-score; GRPO, Shao et al. "
        "2024). 'none' keeps the centred value: Dr. GRPO (Liu et al. 2025) shows that dividing by "
        "std up-weights groups that are nearly solved or nearly hopeless. 'batch' centres in the "
        "group and divides by one standard deviation of the centred values of the whole batch "
        "(REINFORCE++ with a group baseline, Hu et al. 2025): advantages of unit scale, as with "
        "'std', that keep each group's spread — a group whose members differ by a red line "
        "pushes harder than one whose members differ by a wording.",
    )
    unbiased: bool = Field(
        True,
        description="Bessel's correction (divide by n−1). Default True: TRL's `nanstd` and "
        "verl's `torch.std` both use it.",
    )
    eps: float = Field(
        1e-6,
        ge=0.0,
        description="Added so a tiny std cannot blow the advantage up. Default 1e-6 as in verl's "
        "`compute_grpo_outcome_advantage`; TRL's GRPOTrainer uses 1e-4; verl's `masked_whiten` "
        "(REINFORCE++) uses 1e-8 inside the square root (see `eps_mode`).",
    )
    eps_mode: Literal["std", "var"] = Field(
        "std",
        description="Where `eps` goes: 'std' → (r − b) / (std + eps) (TRL and verl GRPO); "
        "'var' → (r − b) / sqrt(var + eps) (verl `masked_whiten`, used by REINFORCE++).",
    )


@dataclass(frozen=True)
class GroupStats:
    """What `group_normalize` saw, per sample ([N]) and per group (fractions over groups)."""

    code: Tensor  # [N] dense group code of each sample
    size: Tensor  # [N] members in the sample's group
    mean: Tensor  # [N] group mean
    std: Tensor  # [N] group std (Bessel or not, without eps)
    singleton: Tensor  # [N] bool: the group has one member
    zero_var: Tensor  # [N] bool: the group has ≥ 2 members and all values are equal
    n_groups: int


def group_normalize(
    values: Tensor,
    groups: Tensor,
    *,
    baseline: Literal["mean", "loo"] = "mean",
    scale: Literal["std", "none", "batch"] = "std",
    unbiased: bool = True,
    eps: float = 1e-6,
    eps_mode: Literal["std", "var"] = "std",
) -> tuple[Tensor, GroupStats]:
    """Group-relative advantages: each value against the other members of its group.

    With n_g members in group g, mean μ_g and variance σ²_g = Σ (r − μ_g)² / (n_g − 1)
    (or / n_g when `unbiased=False`):

        baseline  b_i = μ_g                                ('mean')
                  b_i = (n_g μ_g − r_i) / (n_g − 1)        ('loo': mean of the others)
        A_i = (r_i − b_i) / (σ_g + eps)                    (scale 'std', eps_mode 'std')
        A_i = (r_i − b_i) / sqrt(σ²_g + eps)               (scale 'std', eps_mode 'var')
        A_i =  r_i − b_i                                   (scale 'none')
        A_i = (r_i − b_i) / (σ_B + eps)                    (scale 'batch')

    where σ_B is the standard deviation of r_i − b_i over every sample of the batch whose group
    has two or more members and some spread (the same Bessel choice and `eps_mode`).

    Edge cases (docs/method.md#mapo): a group of one sample and a group whose values are all equal give
    A = 0 exactly; both are flagged in the returned `GroupStats`. Non-finite values raise.

    values: [N] float. groups: [N] int keys or [N, k] key rows. Returns (A [N], stats).
    """
    if values.dim() != 1 or groups.shape[0] != values.shape[0]:
        raise ValueError(
            f"values must be [N] and groups [N] or [N, k]; got {tuple(values.shape)} "
            f"and {tuple(groups.shape)}"
        )
    bad = ~torch.isfinite(values)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise ValueError(f"value {i} is {values[i].item()}; rewards must be finite")
    code, n_groups = dense(groups.to(values.device))
    # float64 (where the device has it): exact-enough sums for any finite float32 rewards
    acc = torch.float32 if values.device.type == "mps" else torch.float64
    r = values.to(acc)
    kw = {"dtype": acc, "device": values.device}
    n = torch.zeros(n_groups, **kw).index_add_(0, code, torch.ones_like(r))
    total = torch.zeros(n_groups, **kw).index_add_(0, code, r)
    mean = total / n
    centred = r - mean[code]
    ss = torch.zeros(n_groups, **kw).index_add_(0, code, centred * centred)
    var = ss / (n - 1).clamp(min=1) if unbiased else ss / n
    hi = torch.full((n_groups,), -math.inf, **kw).scatter_reduce_(0, code, r, "amax")
    lo = torch.full((n_groups,), math.inf, **kw).scatter_reduce_(0, code, r, "amin")
    singleton = n == 1
    zero_var = (n > 1) & (hi == lo)
    var = torch.where(singleton | zero_var, torch.zeros_like(var), var)

    if baseline == "loo":
        others = (total[code] - r) / (n[code] - 1).clamp(min=1)  # mean of the other members
        adv = r - others
    else:
        adv = centred
    dead = (singleton | zero_var)[code]
    if scale == "std":
        denom = var.sqrt() + eps if eps_mode == "std" else (var + eps).sqrt()
        adv = adv / denom[code].clamp(min=torch.finfo(acc).tiny)
    elif scale == "batch":
        live = adv[~dead]
        spread = live.var(unbiased=unbiased) if live.numel() > 1 else adv.new_zeros(())
        denom = spread.sqrt() + eps if eps_mode == "std" else (spread + eps).sqrt()
        adv = adv / denom.clamp(min=torch.finfo(acc).tiny)
    adv = torch.where(dead, torch.zeros_like(adv), adv)

    stats = GroupStats(
        code=code,
        size=n[code].long(),
        mean=mean[code].to(values.dtype),
        std=var.sqrt()[code].to(values.dtype),
        singleton=singleton[code],
        zero_var=zero_var[code],
        n_groups=n_groups,
    )
    return adv.to(values.dtype), stats


# --------------------------------------------------------------------------------------------
# Returns
# --------------------------------------------------------------------------------------------


def step_returns(
    rewards: Tensor, gamma: float, mask: Tensor | None = None, outcome: Tensor | None = None
) -> Tensor:
    """Discounted return of every step of right-padded trajectories.

        G_t = r_t + γ · G_{t+1},  G after the last valid step = 0,
        i.e. G_t = Σ_{k ≥ t} γ^(k−t) r_k  (+ γ^(L−1−t) · R when `outcome` R is given,
        R added to the reward of the trajectory's last valid step L−1, as GiGPO and REINFORCE++
        treat the episode's outcome).

    rewards: [B, T]; mask: [B, T] (1 = a real step; padding only at the end); outcome: [B].
    Returns G [B, T] (0 on padding). The loop runs over T (turns), never over samples.
    """
    if mask is None:
        mask = torch.ones_like(rewards)
    mask = mask.to(rewards.dtype)
    r = rewards * mask
    if outcome is not None:
        last = (mask.sum(1).long() - 1).clamp(min=0)  # [B] index of the last valid step
        r = r.clone()
        rows = torch.arange(r.shape[0], device=r.device)
        r[rows, last] += outcome.to(r.dtype) * (mask.sum(1) > 0)
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        running = (r[:, t] + gamma * running) * mask[:, t]
        out[:, t] = running
    return out


def pad_steps(values: Tensor, traj: Tensor, turn: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Flat step rows → right-padded [B, T] by trajectory, ordered by turn.

    Returns (padded [B, T], mask [B, T], row [N], col [N]) with padded[row, col] = values.
    Turns of one trajectory must be distinct; gaps are closed (ranked by turn).
    """
    t_code, n_traj = dense(traj)
    order = torch.argsort(t_code * (int(turn.max()) + 1 if turn.numel() else 1) + turn, stable=True)
    count = torch.zeros(n_traj, dtype=torch.long, device=t_code.device)
    count.index_add_(0, t_code, torch.ones_like(t_code))
    start = torch.cumsum(count, 0) - count
    col = torch.empty_like(t_code)
    col[order] = torch.arange(len(order), device=order.device) - start[t_code[order]]
    width = int(count.max()) if n_traj else 0
    padded = torch.zeros(n_traj, width, dtype=values.dtype, device=values.device)
    mask = torch.zeros(n_traj, width, dtype=torch.bool, device=values.device)
    padded[t_code, col] = values
    mask[t_code, col] = True
    return padded, mask, t_code, col


# --------------------------------------------------------------------------------------------
# Local and global advantages, the mix, the α schedule
# --------------------------------------------------------------------------------------------


def local_advantages(
    signal: Tensor,
    state_groups: Tensor,
    *,
    norm: Norm | None = None,
    singleton: Literal["zero", "turn", "batch"] = "zero",
    turn_groups: Tensor | None = None,
    batch_groups: Tensor | None = None,
) -> tuple[Tensor, GroupStats]:
    """Step-level advantages: `signal` (local reward or its return) normalised in state groups.

        A_local_i = norm(signal_i | state group of i)      if that group has ≥ 2 members, else
                  = 0                                      ('zero')
                  | norm(signal_i | turn group of i)       ('turn')
                  | norm(signal_i | batch of i)            ('batch')

    A state group holds samples with the same state key: the method's "same (or similar) state"
    comparison set, fed by the replay buffer. `turn_groups` ([N] or [N, k]) is the fallback
    group for 'turn': same task group and turn index (the MAPO paper's turn level).
    `batch_groups` ([N], default one batch) separates independent runs for 'batch'.

    signal: [N]; state_groups: [N] or [N, k]. Returns (A_local [N], stats of the state groups).
    """
    norm = norm or Norm()
    kw = norm.model_dump()
    adv, stats = group_normalize(signal, state_groups, **kw)
    if singleton != "zero" and stats.singleton.any():
        if singleton == "turn":
            if turn_groups is None:
                raise ValueError("singleton='turn' needs turn_groups (task group × turn index)")
            fallback_groups = turn_groups
        else:
            fallback_groups = (
                torch.zeros_like(signal, dtype=torch.long) if batch_groups is None else batch_groups
            )
        fallback, _ = group_normalize(signal, fallback_groups, **kw)
        adv = torch.where(stats.singleton, fallback, adv)
    return adv, stats


def form_judged(signal: Tensor, form: Tensor, groups: Tensor, strata: Tensor) -> Tensor:
    """The local signal with its content compared only among turns of the same form.

    A turn's local reward splits into what its form clauses gave and the rest, r_i = f_i + c_i
    (f: the signed share of the clauses that judge how a message is written for this diner —
    length, order — c: what it says and does). With g(i) the state group of turn i and s(i) the
    turns of g(i) with the same verdicts on the form clauses (its stratum),

        r'_i = r_i − (mean_{s(i)} c − mean_{g(i)} c)     where s(i) has ≥ 2 members
             = r_i                                       otherwise (no other turn of its form)

    so normalising r' in the state group centres the two parts apart:

        r'_i − mean_{g(i)} r' = (f_i − mean_{g(i)} f) + (c_i − mean_{s(i)} c)

    A form is credited by its own clauses only; content (allergens, checks, dishes named) is
    credited against turns written the same way. Without it, a form the policy happens to use
    where it skips steps earns less in every state group it shares, and the push lands on the
    form as much as on the skipped step (docs/method.md#form-credit). It is a baseline that
    depends on part of the action, so the form no longer learns from content at all: that is
    the point, and its cost — a failing every turn of a form shares is absorbed by the
    stratum's mean. Measured on the main job it did not help (docs/method.md#form-credit).

    signal, form: [N]; groups: [N] or [N, k] state keys; strata: [N] int codes of the form
    verdicts. Returns r' [N].
    """
    n = signal.shape[0]
    if form.shape != signal.shape or strata.shape[0] != n or groups.shape[0] != n:
        raise ValueError(
            f"signal and form must be [N] and groups, strata [N]; got {tuple(signal.shape)}, "
            f"{tuple(form.shape)}, {tuple(groups.shape)} and {tuple(strata.shape)}"
        )
    content = signal - form
    by_state = groups.reshape(n, -1).long()
    by_form = torch.cat([by_state, strata.reshape(n, 1).long()], dim=1)
    _, in_state = group_normalize(content, by_state, scale="none")
    _, in_form = group_normalize(content, by_form, scale="none")
    shift = torch.where(in_form.singleton, torch.zeros_like(content), in_form.mean - in_state.mean)
    return signal - shift


def clause_advantages(
    scores: Tensor,
    weights: Tensor,
    groups: Tensor,
    *,
    norm: Norm | None = None,
    singleton: Literal["zero", "turn", "batch"] = "zero",
    turn_groups: Tensor | None = None,
    batch_groups: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled local advantages: each clause's verdicts normalised in the group on their own.

    With s_ic the verdict of clause c at step i (+1 pass, −1 violate; NaN where c does not apply)
    and w_c the clause's weight,

        z_ic = local_advantages(s_·c | groups)_i      over the steps where c applies
        u_i  = Σ_c w_c z_ic / Σ_(c applies at i) w_c
        A_i  = u_i / std(u)                           std over the steps of i's batch group

    A coupled local reward r_i = Σ w_c s_ic / Σ w_c is normalised as one number, so the clauses
    that vary most in a group (long messages break allergen and menu clauses more often) drown a
    clause that varies little, and different mixes of passes and violations collapse to one value
    (docs/method.md#decoupled-clauses). Here every clause is compared in its own group first,
    and the weights only decide how the comparisons add up; the last division gives A the unit
    scale a coupled z-score has, so α mixes the same magnitudes either way (GDPO, Liu et al.
    2026, arXiv 2601.05242, sums per-reward group normalisations, then normalises over the batch;
    here that last step only rescales: each clause's scores are already centred in their groups).

    scores: [N, C]; weights: [C] (> 0); groups, turn_groups: [N] or [N, k] keys; batch_groups:
    [N] independent runs (default one). A step where no clause applies gets 0; so does a whole
    batch group whose clauses never vary. Returns (A [N], metrics): `group/clause_signal_frac`,
    the share of (step, applicable clause) cells whose group varied on that clause.
    """
    if scores.dim() != 2 or weights.shape != (scores.shape[1],):
        raise ValueError(
            f"scores must be [N, C] and weights [C]; got {tuple(scores.shape)} and "
            f"{tuple(weights.shape)}"
        )
    if bool((weights <= 0).any()) or not bool(torch.isfinite(weights).all()):
        raise ValueError(f"clause weights must be finite and > 0; got {weights.tolist()}")
    n = scores.shape[0]
    applies = ~torch.isnan(scores)  # [N, C]
    num = torch.zeros(n, dtype=torch.float64, device=scores.device)
    den = torch.zeros(n, dtype=torch.float64, device=scores.device)
    moved = 0
    for c in range(scores.shape[1]):  # a loop over clauses (~15), never over samples
        rows = applies[:, c].nonzero()[:, 0]
        if rows.numel() == 0:
            continue
        z, _ = local_advantages(
            scores[rows, c],
            groups[rows],
            norm=norm,
            singleton=singleton,
            turn_groups=None if turn_groups is None else turn_groups[rows],
            batch_groups=None if batch_groups is None else batch_groups[rows],
        )
        num[rows] += float(weights[c]) * z.double()
        den[rows] += float(weights[c])
        moved += int((z != 0).sum())
    u = torch.where(den > 0, num / den.clamp(min=1e-12), torch.zeros_like(num))
    runs = (
        torch.zeros(n, dtype=torch.long, device=scores.device)
        if batch_groups is None
        else batch_groups
    )
    _, spread = group_normalize(u, runs, unbiased=False)  # only its std: u is not re-centred
    a = torch.where(spread.std > 0, u / spread.std.clamp(min=1e-12), torch.zeros_like(u))
    cells = int(applies.sum())
    metrics = {"group/clause_signal_frac": moved / cells} if cells else {}
    return a.to(scores.dtype), metrics


def global_advantages(
    outcome: Tensor,
    task_groups: Tensor,
    *,
    norm: Norm | None = None,
    traj: Tensor | None = None,
    unit: Literal["trajectory", "step"] = "trajectory",
) -> tuple[Tensor, GroupStats]:
    """Trajectory-level advantages: the outcome normalised within the task group (GRPO).

        unit 'trajectory': one value per trajectory enters the statistics (K rollouts → K values)
        unit 'step':       every step row enters them, so long trajectories weigh more
                           (verl-agent's GiGPO `episode_norm_reward`, compute_mean_std_cross_all_data)

    and every step of a trajectory gets its trajectory's advantage.

    outcome: [N] (constant within a trajectory); task_groups: [N]; traj: [N] (needed for
    'trajectory'). Returns (A_global [N], stats; per-row for 'step', per-trajectory otherwise).
    """
    norm = norm or Norm()
    if unit == "step":
        return group_normalize(outcome, task_groups, **norm.model_dump())
    if traj is None:
        raise ValueError("unit='trajectory' needs traj ids")
    t_code, n_traj = dense(traj)
    kw = {"dtype": outcome.dtype, "device": outcome.device}
    hi = torch.full((n_traj,), -math.inf, **kw).scatter_reduce_(0, t_code, outcome, "amax")
    lo = torch.full((n_traj,), math.inf, **kw).scatter_reduce_(0, t_code, outcome, "amin")
    if (hi != lo).any():
        raise ValueError(
            "the global reward differs between steps of one trajectory; it must be "
            "the trajectory's outcome, the same on every step"
        )
    first = _first_index(t_code, n_traj)  # one row per trajectory
    adv_traj, stats = group_normalize(hi, task_groups[first], **norm.model_dump())
    return adv_traj[t_code], stats


def mix(
    local: Tensor, global_: Tensor, alpha: float, mode: Literal["convex", "additive"] = "convex"
) -> Tensor:
    """The mixed advantage.

    convex:    A = α · A_local + (1 − α) · A_global      (the method's MAPO; the MAPO paper)
    additive:  A = A_global + α · A_local                 (GiGPO's A_E + ω · A_S, ω = α)
    """
    if mode == "additive":
        return global_ + alpha * local
    return alpha * local + (1.0 - alpha) * global_


class AlphaSchedule(StrictModel):
    """α over policy updates: from α0 to α1 over `steps` updates, then held at α1."""

    kind: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="'constant' keeps α0. 'linear' and 'cosine' move α0 → α1: the method's "
        "curriculum (docs/method.md#mapo) trains on the global reward first, so the direction is "
        "right, then raises the local weight to polish each step.",
    )
    alpha0: float = Field(0.0, ge=0.0, description="α at update 0.")
    alpha1: float = Field(0.0, ge=0.0, description="α from update `steps` on.")
    steps: int = Field(1, ge=1, description="Updates over which α moves from α0 to α1.")


def alpha_at(step: int, schedule: AlphaSchedule) -> float:
    """α at policy update `step` (0-based), with p = min(step / steps, 1):

    constant: α0;  linear: α0 + (α1 − α0) p;  cosine: α0 + (α1 − α0) (1 − cos π p) / 2.
    """
    if schedule.kind == "constant":
        return schedule.alpha0
    p = min(max(step, 0) / schedule.steps, 1.0)
    if schedule.kind == "cosine":
        p = (1.0 - math.cos(math.pi * p)) / 2.0
    return schedule.alpha0 + (schedule.alpha1 - schedule.alpha0) * p


# --------------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------------


def kl_penalty(
    logp: Tensor,
    ref_logp: Tensor,
    kind: Literal["k1", "k2", "k3"] = "k3",
    clamp: float | None = 10.0,
) -> Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from the sampled token's log-probs (Schulman 2020).

        k1 = log π − log π_ref = −d                (unbiased, high variance; verl "kl")
        k2 = d² / 2                                (verl "mse")
        k3 = exp(d) − d − 1,  d = log π_ref − log π (≥ 0, low variance; verl "low_var_kl")

    All three estimate the *value* of the reverse KL. Used as a loss term on tokens sampled from
    π and differentiated through log π alone (as here, TRL and verl do), their expected
    *gradients* differ (tests/test_mapo.py checks each against autograd of the exact KL):

        E_π[∇k1] = E_π[∇log π] = 0                              (no pull at all)
        E_π[∇k2] = E_π[(log π − log π_ref) ∇log π] = ∇ KL(π ‖ π_ref)     (reverse, mode-seeking)
        E_π[∇k3] = E_π[(1 − π_ref/π) ∇log π] = ∇ KL(π_ref ‖ π)          (forward, mass-covering)

    So k3 in the loss pays the policy to keep mass on every token the reference could sample —
    its tail included — while k2 lets it drop the tail and pulls back only where it moved mass.

    d is clamped to [−20, 20]. For k3, where d > 0 the result is clamped to `clamp` (`None`:
    TRL's unclamped form). Only that side: there exp(d) explodes on a token the policy has all but
    abandoned. Where d < 0 — the policy has put its mass on a token the reference finds unlikely,
    which is what a drifting policy samples — k3 ≈ −d − 1 grows only linearly, its gradient in
    log π is 1 − exp(d) ≤ 1, and a clamp there (verl's `kl_penalty_forward` clamps both sides)
    would zero the very gradient that pulls the policy back: measured on the main job, a seed
    whose KL passed ~3 never came back, its β doubling to 10⁹. k2 grows quadratically on both
    sides and needs no clamp. Shapes: [B, T] → [B, T].
    """
    if kind == "k1":
        return logp - ref_logp
    d = (ref_logp - logp).clamp(-20.0, 20.0)
    if kind == "k2":
        return 0.5 * d * d
    k3 = torch.exp(d) - d - 1.0
    return k3 if clamp is None else torch.where(d > 0, k3.clamp(max=clamp), k3)


#: The most `adaptive_beta` raises β to. Advantages are z-scores (|A| ≈ 1), so at β = 10 the KL
#: term outweighs the policy gradient many times over; past that a larger β changes only the
#: gradient's scale, which the clip and Adam take out again, while recovering from it costs one
#: halving per iteration.
BETA_MAX = 10.0


def adaptive_beta(
    beta: float,
    kl: float,
    target: float,
    floor: float,
    step: float = 2.0,
    ceiling: float = BETA_MAX,
) -> float:
    """The next iteration's KL coefficient, proportional to the KL just measured:

        β_{t+1} = min(β_max, max(β_0, β_t · clip(KL_t / KL_target, 1/s, s)))

    KL above the target tightens the leash (at most ×s per iteration), below it loosens it,
    never below the recipe's β_0 (`floor`) nor above `ceiling` (`BETA_MAX`, or β_0 if that is
    larger). Ziegler et al. (2019) adapt β the same way with a slower, clipped proportional step
    over a long horizon; an iteration here is a large step, so the factor is the ratio itself,
    bounded by s. A NaN KL leaves β as it is.
    """
    if not math.isfinite(kl):
        return beta
    return min(max(ceiling, floor), max(floor, beta * min(max(kl / target, 1.0 / step), step)))


def aggregate(
    loss: Tensor,
    mask: Tensor,
    mode: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = "token-mean",
    norm_len: int | None = None,
) -> Tensor:
    """Reduce per-token losses [B, T] to a scalar (verl `agg_loss` mode names).

    token-mean               Σ_bt m·ℓ / Σ_bt m                every token weighs the same
    seq-mean-token-mean      mean_b ( Σ_t m·ℓ / Σ_t m )       GRPO paper; sequences with no
                                                              token are left out
    seq-mean-token-sum       mean_b ( Σ_t m·ℓ )               sequence-level REINFORCE (RLOO)
    seq-mean-token-sum-norm  Σ_bt m·ℓ / (B · L)               Dr. GRPO; L = `norm_len` or T.
                             TRL's `dr_grpo` divides by B·max_completion_length like this;
                             verl divides by L only (its value is B times ours).
    """
    m = mask.to(loss.dtype)
    total = (loss * m).sum()
    if mode == "token-mean":
        return total / m.sum().clamp(min=1.0)
    per_seq = (loss * m).sum(1)
    n_tok = m.sum(1)
    has = n_tok > 0
    if mode == "seq-mean-token-mean":
        return (per_seq[has] / n_tok[has]).sum() / has.sum().clamp(min=1)
    if mode == "seq-mean-token-sum":
        return per_seq[has].sum() / has.sum().clamp(min=1)
    if mode == "seq-mean-token-sum-norm":
        return total / (loss.shape[0] * (norm_len or loss.shape[1]))
    raise ValueError(f"unknown aggregation {mode!r}")


def truncated_is_weights(
    logp: Tensor,
    old_logp: Tensor,
    mask: Tensor,
    cap: float,
    level: Literal["sequence", "token"] = "sequence",
) -> tuple[Tensor, Tensor]:
    """Truncated importance weights for samples drawn by an older policy (no gradient).

        token:    w_bt = min(π(a_bt) / π_old(a_bt), cap)
        sequence: w_b  = min(Π_t π(a_bt) / π_old(a_bt), cap)   (one weight per turn's action)

    Returns (w [B, T] detached, clipped [B] or [B, T] bool: where the cap was hit).
    """
    m = mask.to(logp.dtype)
    log_ratio = (logp.detach() - old_logp) * m
    if level == "sequence":
        ratio = torch.exp(log_ratio.sum(1, keepdim=True).clamp(max=50.0))  # [B, 1]
        clipped = (ratio > cap).squeeze(1)
        return ratio.clamp(max=cap).expand_as(logp), clipped
    ratio = torch.exp(log_ratio.clamp(max=50.0))
    return ratio.clamp(max=cap), (ratio > cap) & mask.bool()


def clipped_surrogate(
    logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    """PPO's clipped surrogate (Schulman et al. 2017), per token, as a loss:

        ρ_bt = π(a_bt) / π_old(a_bt)
        ℓ_bt = − min(ρ_bt · A_b,  clip(ρ_bt, 1 − ε, 1 + ε) · A_b)

    Where ρ = 1 (a fresh sample's first pass) its gradient is REINFORCE's, −A · ∇log π. On
    later passes over the same samples (`train.epochs` > 1) a token stops being pushed once its
    ratio has moved ε in the direction its advantage asks; against it, it is always pushed back.

    logp, old_logp, mask: [B, T]; adv: [B], [B, 1] or [B, T]. Returns (ℓ [B, T], clipped [B, T] bool:
    the tokens whose gradient the clip took away).
    """
    ratio = torch.exp((logp - old_logp.detach()).clamp(max=50.0))
    a = adv.detach().to(logp.dtype)
    a = (a[:, None] if a.dim() == 1 else a).expand_as(logp)
    plain, capped = ratio * a, ratio.clamp(1.0 - eps, 1.0 + eps) * a
    clipped = (capped < plain) & mask.bool()
    return -torch.minimum(plain, capped), clipped


def mapo_loss(
    logp: Tensor,
    adv: Tensor,
    mask: Tensor,
    *,
    ref_logp: Tensor | None = None,
    old_logp: Tensor | None = None,
    beta: float = 0.0,
    kl: Literal["k1", "k2", "k3"] = "k3",
    kl_clamp: float | None = 10.0,
    agg: str = "token-mean",
    norm_len: int | None = None,
    is_cap: float | None = None,
    is_level: Literal["sequence", "token"] = "sequence",
    clip: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """REINFORCE with a per-token KL penalty:

        ℓ_bt = − w_b · A_b · log π(a_bt)  +  β · KL_bt(π ‖ π_ref)
        loss = aggregate(ℓ, mask, agg)

    w = 1, or truncated importance weights (`truncated_is_weights`) when `is_cap` and `old_logp`
    are given. Its gradient is the REINFORCE estimator −Σ w A ∇log π (normalised as `agg` says);
    no value network. With `clip` ε and `old_logp` (the log-probs the samples were drawn with),
    the first term is PPO's clipped surrogate instead (`clipped_surrogate`): the same gradient
    where π = π_old, none for a token already moved ε the way its advantage asks.

    logp, ref_logp, old_logp, mask: [B, T]; adv: [B] (one advantage per step sample, shared by
    its tokens) or [B, T]. Returns (scalar loss, metrics).
    """
    a = adv.detach().to(logp.dtype)
    if a.dim() == 1:
        a = a[:, None]  # [B] → [B, 1], broadcast over the turn's tokens
    if clip is not None and is_cap is not None:
        raise ValueError("clip and is_cap are two corrections for old samples: give one")
    if clip is not None and old_logp is None:
        raise ValueError("clip needs old_logp, the log-probs the samples were drawn with")
    metrics: dict[str, float] = {}
    if clip is not None and old_logp is not None:
        pg, clipped = clipped_surrogate(logp, old_logp, a, mask, clip)
        metrics["clip/frac"] = clipped.sum().item() / max(mask.sum().item(), 1.0)
    else:
        w = torch.ones_like(logp)
        if is_cap is not None and old_logp is not None:
            w, clipped = truncated_is_weights(logp, old_logp, mask, is_cap, is_level)
            metrics["is/clipped_frac"] = clipped.float().mean().item() if clipped.numel() else 0.0
            metrics["is/weight_mean"] = (w * mask).sum().item() / max(mask.sum().item(), 1.0)
        pg = -w * a * logp
    per_token = pg
    if beta and ref_logp is not None:
        k = kl_penalty(logp, ref_logp, kl, kl_clamp)
        per_token = pg + beta * k
        # The reported KL (and what an adaptive β reads) is k3's value whichever estimator the
        # gradient comes from: one scale across settings. Under k3 it is the loss's own term.
        shown = k.detach() if kl == "k3" else kl_penalty(logp.detach(), ref_logp, "k3", kl_clamp)
        metrics["kl/mean"] = aggregate(shown, mask, "token-mean").item()
    loss = aggregate(per_token, mask, agg, norm_len)
    metrics["loss/pg"] = aggregate(pg.detach(), mask, agg, norm_len).item()
    metrics["loss/total"] = loss.item()
    return loss, metrics


# --------------------------------------------------------------------------------------------
# The configuration every preset is, and the one entry point
# --------------------------------------------------------------------------------------------


class AdvantageConfig(StrictModel):
    """Everything that differs between MAPO and its peers: signals, groups, norms, mix, loss."""

    name: str = Field("custom", description="Preset name, for logs and charts.")
    source: str = Field("", description="Paper and code this configuration follows.")

    gamma: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="Discount of the step returns G_t = Σ γ^k r_(t+k) (`returns_for`). 0 uses "
        "each turn's own reward, the method's local reward. GiGPO's scripts use 0.95; the MAPO "
        "paper's run script 0.85; REINFORCE++ in verl defaults to 1.0.",
    )
    outcome_in_return: bool = Field(
        False,
        description="Add the outcome to the last step's reward before discounting (GiGPO, "
        "REINFORCE++, where the environment's final reward is a step reward). Off: the outcome "
        "only enters through the global advantage.",
    )
    local_signal: Literal["reward", "return", "clauses"] = Field(
        "return",
        description="What the local advantage normalises: the step's own local reward, or the "
        "step return (equal to the reward when gamma = 0 and outcome_in_return is off), or "
        "'clauses': each clause's verdicts in the group on their own, then weighted "
        "(`clause_advantages`; needs gamma 0 and the samples' per-clause verdicts).",
    )
    local_groups: Literal["state", "state_in_task", "turn", "batch"] = Field(
        "state",
        description="Comparison set of a step: 'state' = same state key across task groups and "
        "the buffer (the method); 'state_in_task' = same state inside one task group (GiGPO's "
        "anchor states); 'turn' = same task group and turn index (the MAPO paper); 'batch' = "
        "every step (REINFORCE++).",
    )
    state_key: Literal["exact", "abstract"] = Field(
        "exact",
        description="Which state key the buffer groups by: the exact hash of what the policy saw, "
        "or the coarser abstract key (similar states). Exact is the method's default; abstract "
        "trades bias for larger groups.",
    )
    singleton: Literal["zero", "turn", "batch"] = Field(
        "zero",
        description="Local advantage of a step alone in its state group: 0 (no evidence; GiGPO), "
        "its turn-level group's, or batch normalisation's (docs/method.md#mapo).",
    )
    local_norm: Norm = Field(default_factory=Norm, description="Normalisation in local groups.")
    form_clauses: list[str] = Field(
        default_factory=list,
        description="Clauses that judge a message's form for the diner (in the concierge "
        "constitution T3, T4, T6: length and order). With any, a turn's content is compared "
        "only with turns of the same form in its state group, and the form only by these "
        "clauses (`form_judged`, docs/method.md#form-credit). Needs a turn's own reward as the "
        "local signal (gamma 0, no outcome in the return, not 'clauses'). Default none.",
    )
    global_signal: Literal["outcome", "return"] = Field(
        "outcome",
        description="What the global advantage normalises: the trajectory's outcome (GRPO), or "
        "the step return (the MAPO paper's batch-level term).",
    )
    global_groups: Literal["task", "batch"] = Field(
        "task",
        description="'task' = the K rollouts of one task (GRPO's group); 'batch' = all samples.",
    )
    global_unit: Literal["trajectory", "step"] = Field(
        "trajectory",
        description="'trajectory': one value per rollout enters the task-group statistics (GRPO). "
        "'step': every step row does (verl-agent GiGPO), so longer rollouts weigh more.",
    )
    global_norm: Norm = Field(default_factory=Norm, description="Normalisation in global groups.")

    mix: Literal["convex", "additive"] = Field(
        "convex",
        description="'convex': α·A_local + (1−α)·A_global (the method). 'additive': A_global + "
        "α·A_local (GiGPO, α = ω).",
    )
    alpha: AlphaSchedule = Field(
        default_factory=AlphaSchedule,
        description="α over updates. Default constant 0: outcome only, i.e. GRPO.",
    )
    use_buffer: bool = Field(
        False,
        description="State groups include the replay buffer's history (the method's MAPO). Off: "
        "only the current batch, as every peer does.",
    )
    replay_in_gradient: bool = Field(
        False,
        description="Buffer history also enters the gradient, with truncated importance weights. "
        "Off by default: old samples only sharpen the group statistics (docs/method.md#replay-buffer).",
    )
    is_cap: float = Field(
        1.0,
        gt=0.0,
        description="Truncation of importance weights for replayed samples: 1.0 as IMPALA's ρ̄ "
        "(Espeholt et al. 2018), never up-weighting a stale sample.",
    )
    clip: float | None = Field(
        None,
        gt=0.0,
        lt=1.0,
        description="PPO's clipped surrogate with this ε (0.2 in PPO, TRL and verl) in place of "
        "plain REINFORCE: a token stops being pushed once its probability has moved ε × its "
        "probability at collection the way its advantage asks. It matters when `train.epochs` "
        "passes over a batch (and in the later minibatches of one pass); with one pass and one "
        "minibatch it is REINFORCE. None: REINFORCE.",
    )

    loss_agg: Literal[
        "token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"
    ] = Field("token-mean", description="Loss aggregation (`aggregate`). verl's default.")
    norm_len: int | None = Field(
        None,
        ge=1,
        description="L for 'seq-mean-token-sum-norm' (Dr. GRPO's constant; TRL's "
        "max_completion_length). None uses the padded length T.",
    )
    beta: float = Field(
        0.0,
        ge=0.0,
        description="KL coefficient. 0 as TRL's and verl's defaults now are; the GRPO paper used "
        "0.04, verl's GRPO examples 0.001.",
    )
    kl: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="The KL penalty's estimator in the loss (`kl_penalty`): k3 (low variance, "
        "≥ 0) as GRPO, TRL and verl use, whose gradient is the forward KL's and keeps the "
        "reference's tail; k2, whose gradient is the reverse KL's and lets the policy drop it; "
        "k1 pulls nothing in expectation (docs/method.md#policy-update). kl/mean reports k3's "
        "value in every case.",
    )
    kl_target: float | None = Field(
        None,
        gt=0.0,
        description="Adaptive β (`adaptive_beta`): after each iteration β is scaled by the "
        "measured KL over this target (×½ … ×2), never below `beta`. None keeps β fixed.",
    )

    @model_validator(mode="after")
    def _check(self) -> AdvantageConfig:
        if self.global_signal == "return" and self.global_unit != "step":
            raise ValueError(
                "global_signal 'return' varies within a trajectory: set global_unit: step"
            )
        if self.mix == "convex" and max(self.alpha.alpha0, self.alpha.alpha1) > 1.0:
            raise ValueError(
                "with mix 'convex', alpha0 and alpha1 must lie in [0, 1]; use mix "
                "'additive' for a local weight above 1"
            )
        if self.local_signal == "clauses" and (self.gamma or self.outcome_in_return):
            raise ValueError(
                "local_signal 'clauses' normalises each turn's own verdicts: set gamma: 0 and "
                "outcome_in_return: false"
            )
        if self.form_clauses and (
            self.local_signal == "clauses" or self.gamma or self.outcome_in_return
        ):
            raise ValueError(
                "form_clauses splits each turn's own reward into form and content: use "
                "local_signal 'reward' (or 'return' with gamma: 0 and outcome_in_return: false)"
            )
        if len(set(self.form_clauses)) != len(self.form_clauses):
            raise ValueError(f"form_clauses names a clause twice: {self.form_clauses}")
        if self.replay_in_gradient and not self.use_buffer:
            raise ValueError("replay_in_gradient needs use_buffer: true")
        if self.replay_in_gradient and self.clip is not None:
            raise ValueError(
                "replay_in_gradient weighs old samples by truncated importance weights and clip "
                "clips the ratio instead: choose one (set clip: null, or replay_in_gradient: false)"
            )
        if self.kl_target is not None and not self.beta:
            raise ValueError("kl_target adapts β upward from beta: set beta > 0 (e.g. 0.02)")
        return self

    @property
    def alpha_ends(self) -> tuple[float, ...]:
        """The α values the schedule runs between (one for a constant): its extremes."""
        a = self.alpha
        return (a.alpha0,) if a.kind == "constant" else (a.alpha0, a.alpha1)

    @property
    def uses_local(self) -> bool:
        """Does the local term ever weigh in? Not when α is 0 for the whole schedule (GRPO)."""
        return max(self.alpha_ends) > 0

    @property
    def uses_global(self) -> bool:
        """Does the global term ever weigh in? Not when α is 1 throughout a convex mix."""
        return self.mix == "additive" or min(self.alpha_ends) < 1

    @property
    def reads_local_reward(self) -> bool:
        """Does any advantage depend on the per-turn (local) rewards? Through the local term,
        or through a global term on step returns, which sum them. When not (GRPO, RLOO, Dr.
        GRPO: outcome only), the reviews that make local rewards change nothing in training."""
        return self.uses_local or (self.uses_global and self.global_signal == "return")

    @property
    def reads_old_logp(self) -> bool:
        """Does the loss read the log-probs the samples were drawn with (`mapo_loss`'s
        `old_logp`)? Replay weighs by them, clip clips against them."""
        return self.replay_in_gradient or self.clip is not None

    def loss_kwargs(self) -> dict:
        """The `mapo_loss` keyword arguments this configuration sets (all but the tensors: pass
        `old_logp` where `reads_old_logp`)."""
        return {
            "beta": self.beta,
            "kl": self.kl,
            "agg": self.loss_agg,
            "norm_len": self.norm_len,
            "is_cap": self.is_cap if self.replay_in_gradient else None,
            "clip": self.clip,
        }


@dataclass
class StepBatch:
    """Step samples for `advantages`: one row per agent turn ([N] each).

    `state` and `task_group` are group keys (int64; any values); `traj` identifies the rollout;
    `turn` is the step index in it. `ret` is the step return computed with the config's gamma
    (`returns_for`). `fresh` marks samples of the current rollouts; the others are buffer history
    that by default only enters group statistics. `run` separates independent runs processed in
    one call (the lab's seeds): 'batch' statistics never mix runs. `valid` ([N] bool, default all)
    marks the rows that carry a local signal; the others get A_local = 0 and stay out of the
    local groups' statistics (a turn no clause applied to, or whose verdicts the GRM failed to
    give: no signal is not a zero). `clauses` ([N, C], NaN where a clause does not apply) and
    `clause_weight` ([C]) are the turn's per-clause verdicts, for `local_signal: clauses`.
    `form_reward` ([N]) is the share of `local_reward` the config's `form_clauses` gave and
    `form_key` ([N] int) codes the turn's verdicts on them, for `form_judged`. `blocked` ([N]
    bool, default none) marks candidates the axiom guard blocked: they did not make their
    episode's outcome, so they get A_global = 0 and stay out of the global statistics.
    """

    local_reward: Tensor
    global_reward: Tensor
    ret: Tensor
    state: Tensor
    task_group: Tensor
    traj: Tensor
    turn: Tensor
    fresh: Tensor | None = None
    run: Tensor | None = None
    valid: Tensor | None = None
    clauses: Tensor | None = None
    clause_weight: Tensor | None = None
    form_reward: Tensor | None = None
    form_key: Tensor | None = None
    blocked: Tensor | None = None

    def __len__(self) -> int:
        return self.local_reward.shape[0]


def returns_for(
    config: AdvantageConfig, local: Tensor, outcome: Tensor, mask: Tensor | None = None
) -> Tensor:
    """The step returns `config` asks for: `step_returns(local [B, T], config.gamma, mask,
    outcome [B] if config.outcome_in_return)` → [B, T]."""
    return step_returns(local, config.gamma, mask, outcome if config.outcome_in_return else None)


def gradient_mask(batch: StepBatch, config: AdvantageConfig) -> Tensor:
    """[N] bool: the rows whose advantages enter the loss (fresh ones, plus history if replayed)."""
    if batch.fresh is None or config.replay_in_gradient:
        return torch.ones(len(batch), dtype=torch.bool, device=batch.local_reward.device)
    return batch.fresh.bool()


def _group_metrics(prefix: str, stats: GroupStats, rows: Tensor | None) -> dict[str, float]:
    """Group sizes and singleton / zero-variance fractions over the groups that hold `rows`."""
    if rows is not None:
        codes = torch.unique(stats.code[rows])
    else:
        codes = torch.unique(stats.code)
    if codes.numel() == 0:
        return {}
    at = _first_index(stats.code, stats.n_groups)[codes]
    return {
        f"group/{prefix}_count": float(codes.numel()),
        f"group/{prefix}_size_mean": stats.size[at].float().mean().item(),
        f"group/{prefix}_singleton_frac": stats.singleton[at].float().mean().item(),
        f"group/{prefix}_zero_var_frac": stats.zero_var[at].float().mean().item(),
    }


def _moments(prefix: str, x: Tensor) -> dict[str, float]:
    if x.numel() == 0:
        return {}
    return {
        f"adv/{prefix}_mean": x.mean().item(),
        f"adv/{prefix}_std": x.std(unbiased=False).item(),
        f"adv/{prefix}_abs_mean": x.abs().mean().item(),
    }


def advantages(
    batch: StepBatch, config: AdvantageConfig, step: int = 0
) -> tuple[Tensor, dict[str, float]]:
    """The mixed advantage of every row of `batch` under `config`, at policy update `step`.

        A_local  = local_advantages(signal, groups = config.local_groups, ...)
        A_global = global_advantages(outcome | return, groups = config.global_groups, ...)
        A        = mix(A_local, A_global, alpha_at(step, config.alpha), config.mix)

    Returns (A [N], metrics). Metrics (namespaced, over rows in the gradient):
    `adv/{local,global,mixed}_{mean,std,abs_mean}`, `group/{local,global}_{count,size_mean,
    singleton_frac,zero_var_frac}` (fractions of groups), `group/history_frac` (state-group
    members from the buffer), `alpha`. A term whose weight is 0 for the whole schedule (the local
    one of GRPO, the global one of REINFORCE++) is neither computed nor reported.
    """
    n = len(batch)
    dev = batch.local_reward.device
    runs = torch.zeros(n, dtype=torch.long, device=dev) if batch.run is None else batch.run.long()
    uses_local, uses_global = config.uses_local, config.uses_global  # a term weighing 0: skipped
    in_grad = gradient_mask(batch, config)
    rows = in_grad.nonzero().squeeze(1)
    metrics: dict[str, float] = {}

    a_local = torch.zeros_like(batch.local_reward)
    if uses_local:
        turn_groups = pair(batch.task_group, batch.turn)
        local_keys = {
            "state": batch.state.long(),
            "state_in_task": pair(batch.task_group, batch.state),
            "turn": turn_groups,
            "batch": runs,
        }[config.local_groups]
        signal = batch.ret if config.local_signal == "return" else batch.local_reward
        # rows without a local signal (no verdict applied, or the reviewer gave none) stay out of
        # the local groups and keep A_local = 0: no signal is not a zero reward
        has = torch.arange(n, device=dev) if batch.valid is None else batch.valid.nonzero()[:, 0]
        kw = {
            "norm": config.local_norm,
            "singleton": config.singleton,
            "turn_groups": turn_groups[has],
            "batch_groups": runs[has],
        }
        signal = signal[has]
        if config.form_clauses:
            if batch.form_reward is None or batch.form_key is None:
                raise ValueError(
                    "form_clauses needs each step's form share and form verdicts "
                    "(StepBatch.form_reward and form_key); these samples carry none"
                )
            signal = form_judged(
                signal, batch.form_reward[has], local_keys[has], batch.form_key[has]
            )
        sub, l_stats = local_advantages(signal, local_keys[has], **kw)
        if config.local_signal == "clauses":
            if batch.clauses is None or batch.clause_weight is None:
                raise ValueError(
                    "local_signal 'clauses' needs the steps' per-clause verdicts "
                    "(StepBatch.clauses and clause_weight); these samples carry none"
                )
            sub, clause_metrics = clause_advantages(
                batch.clauses[has], batch.clause_weight, local_keys[has], **kw
            )
            metrics |= clause_metrics
        a_local[has] = sub
        local_rows = rows if batch.valid is None else rows[batch.valid[rows]]
        position = torch.full((n,), -1, dtype=torch.long, device=dev)
        position[has] = torch.arange(has.numel(), device=dev)
        metrics |= _moments("local", a_local[local_rows])
        metrics |= _group_metrics("local", l_stats, position[local_rows])
        if batch.valid is not None:
            metrics["group/local_signal_frac"] = batch.valid[rows].float().mean().item()

    a_global = torch.zeros_like(batch.local_reward)
    if uses_global:
        # a candidate the guard blocked did not make its episode's outcome: A_global = 0, and
        # it stays out of the statistics the played turns are normalised by
        own = (
            torch.arange(n, device=dev)
            if batch.blocked is None
            else (~batch.blocked.bool()).nonzero()[:, 0]
        )
        g_keys = (batch.task_group.long() if config.global_groups == "task" else runs)[own]
        if config.global_signal == "return":
            sub, g_stats = global_advantages(
                batch.ret[own], g_keys, norm=config.global_norm, unit="step"
            )
        else:
            sub, g_stats = global_advantages(
                batch.global_reward[own],
                g_keys,
                norm=config.global_norm,
                traj=batch.traj[own],
                unit=config.global_unit,
            )
        a_global[own] = sub
        metrics |= _moments("global", a_global[rows]) | _group_metrics("global", g_stats, None)

    alpha = alpha_at(step, config.alpha)
    adv = mix(a_local, a_global, alpha, config.mix)
    metrics |= {"alpha": alpha} | _moments("mixed", adv[rows])
    if batch.fresh is not None:
        metrics["group/history_frac"] = 1.0 - batch.fresh.float().mean().item()
    return adv, metrics


# --------------------------------------------------------------------------------------------
# Presets: the peers as configurations of the functions above
# --------------------------------------------------------------------------------------------

_Z_VERL = Norm()  # z-score, Bessel, eps 1e-6 added to std: verl compute_grpo_outcome_advantage

PRESETS: dict[str, AdvantageConfig] = {
    "grpo": AdvantageConfig(
        name="grpo",
        source="Shao et al. 2024 (DeepSeekMath, arXiv 2402.03300) §4.1.2, outcome supervision. "
        "verl core_algos.compute_grpo_outcome_advantage: torch.std (Bessel), eps 1e-6 on std. "
        "TRL GRPOTrainer: nanstd (Bessel), eps 1e-4, scale_rewards='group' (set global_norm.eps "
        "to 1e-4 to match it). Loss: the paper's seq-mean-token-mean (TRL loss_type='grpo').",
        global_norm=_Z_VERL,
        alpha=AlphaSchedule(kind="constant", alpha0=0.0),
        loss_agg="seq-mean-token-mean",
    ),
    "dr_grpo": AdvantageConfig(
        name="dr_grpo",
        source="Liu et al. 2025, Understanding R1-Zero-Like Training (arXiv 2503.20783): no std "
        "division, loss summed over tokens and divided by a constant (B · L). TRL loss_type="
        "'dr_grpo' with scale_rewards='none'; verl norm_adv_by_std_in_grpo=False with "
        "loss_agg_mode='seq-mean-token-sum-norm'.",
        global_norm=Norm(scale="none"),
        loss_agg="seq-mean-token-sum-norm",
    ),
    "rloo": AdvantageConfig(
        name="rloo",
        source="Ahmadian et al. 2024 (arXiv 2402.14740), Kool et al. 2019: leave-one-out "
        "baseline, no std. verl compute_rloo_vectorized_outcome_advantage (a lone sample gets 0). "
        "Sequence-level REINFORCE: seq-mean-token-sum.",
        global_norm=Norm(baseline="loo", scale="none"),
        loss_agg="seq-mean-token-sum",
    ),
    "reinforce_pp": AdvantageConfig(
        name="reinforce_pp",
        source="Hu 2025, REINFORCE++ (arXiv 2501.03262): returns normalised over the whole batch, "
        "no groups. verl compute_reinforce_plus_plus_outcome_advantage: outcome as the last "
        "reward, gamma 1.0, masked_whiten = (x − mean) / sqrt(var_Bessel + 1e-8). The paper puts a "
        "k1 KL into the reward; here KL stays in the loss (beta).",
        gamma=1.0,
        outcome_in_return=True,
        local_signal="return",
        local_groups="batch",
        local_norm=Norm(eps=1e-8, eps_mode="var"),
        alpha=AlphaSchedule(kind="constant", alpha0=1.0),
    ),
    "gigpo": AdvantageConfig(
        name="gigpo",
        source="Feng et al. 2025, GiGPO (arXiv 2505.10978); verl-agent gigpo/core_gigpo.py: "
        "A = A_E + ω·A_S, ω = step_advantage_w = 1.0, mode mean_std_norm (torch.std, eps 1e-6 "
        "on std). A_E: episode reward in the task group over all step rows; A_S: discounted step "
        "return (gamma 0.95, the authors' scripts) in anchor-state groups inside the task group; "
        "a lone anchor state gets 0.",
        gamma=0.95,
        outcome_in_return=True,
        local_signal="return",
        local_groups="state_in_task",
        singleton="zero",
        global_unit="step",
        mix="additive",
        alpha=AlphaSchedule(kind="constant", alpha0=1.0),
    ),
    "mapo_paper": AdvantageConfig(
        name="mapo_paper",
        source="Zhang et al. 2026, MAPO for long-horizon multi-turn dialogue (arXiv 2603.06194v1) "
        "and the authors' run script test_reinforce_pp_v5.sh (github 2200xiaohu/MAPO): Monte-Carlo "
        "returns of per-turn judge rewards (gamma 0.85), A = 0.6·A_batch + 0.4·A_turn, token-mean. "
        "Their estimator's code is not public: Bessel std, eps 1e-6 and the batch fallback for "
        "a lone turn are our choices.",
        gamma=0.85,
        outcome_in_return=True,
        local_signal="return",
        local_groups="turn",
        singleton="batch",
        global_signal="return",
        global_groups="batch",
        global_unit="step",
        alpha=AlphaSchedule(kind="constant", alpha0=0.4),
    ),
    "mapo": AdvantageConfig(
        name="mapo",
        source="The method (docs/method.md#mapo): local reward z-scored in exact "
        "state groups that include the replay buffer's history; outcome z-scored in the task "
        "group; α from 0.2 to 0.5 over 200 updates (global first, and the local weight never "
        "outweighs the global one: it invites gaming the judge, docs/method.md#reward-hacking); a lone "
        "state falls back to its turn-level group.",
        gamma=0.0,
        local_signal="return",
        local_groups="state",
        singleton="turn",
        use_buffer=True,
        alpha=AlphaSchedule(kind="linear", alpha0=0.2, alpha1=0.5, steps=200),
    ),
}


def preset(key: str, /, **overrides) -> AdvantageConfig:
    """A copy of `PRESETS[key]` with fields replaced (validated again), e.g.
    `preset("grpo", global_norm={"eps": 1e-4})` for TRL's epsilon."""
    if key not in PRESETS:
        raise KeyError(f"unknown preset {key!r}; known: {', '.join(PRESETS)}")
    data = PRESETS[key].model_dump() | overrides
    return AdvantageConfig.model_validate(data)


# --------------------------------------------------------------------------------------------
# One-factor comparisons, and what a preset computes
# --------------------------------------------------------------------------------------------

# Fields that are not the advantage estimator: what counts as the same state (the world's keys),
# and the loss (aggregation, KL, importance-weight cap, ratio clip). A comparison of estimators
# holds them.
SHARED_FIELDS = ("state_key", "loss_agg", "norm_len", "beta", "kl", "kl_target", "is_cap", "clip")


def one_factor(arm: AdvantageConfig, base: AdvantageConfig) -> AdvantageConfig:
    """`arm`'s advantage estimator with `base`'s loss and state key (`SHARED_FIELDS`).

    Each preset is faithful to its source, so two presets can differ in more than their
    advantage: `grpo` aggregates its loss seq-mean-token-mean (the paper), `mapo` token-mean.
    A comparison meant to isolate the advantage estimator runs `one_factor(arm, base)` against
    `base`: signals, groups, normalisation, mix, α and the buffer's use come from `arm`, the rest
    from `base`. `describe` shows what each side then applies.
    """
    return AdvantageConfig.model_validate(
        arm.model_dump() | {k: getattr(base, k) for k in SHARED_FIELDS}
    )


def _norm_text(x: str, group: str, norm: Norm) -> str:
    centre = (
        f"{x} − mean_{group}({x})"
        if norm.baseline == "mean"
        else f"{x} − mean of the others in {group}"
    )
    if norm.scale == "none":
        return f"({centre})"
    spread = "Bessel std" if norm.unbiased else "population std"
    if norm.scale == "batch":
        group = "batch"  # one spread: the centred values of every live group
    if norm.eps_mode == "var":
        return f"({centre}) / sqrt(var_{group} + {norm.eps:g})   [{spread}]"
    return f"({centre}) / (std_{group} + {norm.eps:g})   [{spread}]"


def _signal_text(config: AdvantageConfig, signal: str) -> str:
    if signal == "reward":
        return "r_t, the turn's local reward"
    outcome = " + γ^(L−1−t)·R" if config.outcome_in_return else ""
    if config.gamma == 0.0 and not config.outcome_in_return:
        return "r_t, the turn's local reward (its return with γ = 0)"
    return f"G_t = Σ_k γ^k·r_(t+k){outcome}, γ = {config.gamma:g}"


def _alpha_text(a: AlphaSchedule) -> str:
    if a.kind == "constant":
        return f"α = {a.alpha0:g}"
    return (
        f"α from {a.alpha0:g} to {a.alpha1:g} ({a.kind}) over {a.steps} updates, then {a.alpha1:g}"
    )


def describe(config: AdvantageConfig | str) -> str:
    """The equations a preset (a name in `PRESETS`, or any config) actually applies, as text.

    For example `print(describe("grpo"))`: which signal each term normalises, in which groups,
    with which ε and std, how the terms are mixed, and the loss. Terms whose weight is 0 for the
    whole α schedule are said to be unused, as `advantages` skips them.
    """
    c = PRESETS[config] if isinstance(config, str) else config
    uses_local, uses_global = c.uses_local, c.uses_global
    lines = [c.name] + ([f"  source   {c.source}"] if c.source else [])
    if uses_local:
        group = {
            "state": f"same {c.state_key} state key, across task groups"
            + (" and the replay buffer's history" if c.use_buffer else ""),
            "state_in_task": f"same {c.state_key} state key inside the task group",
            "turn": "same task group and turn index",
            "batch": "every step of the batch",
        }[c.local_groups]
        lone = {
            "zero": "0",
            "turn": "its turn group's (same task group and turn index)",
            "batch": "the batch's",
        }[c.singleton]
        if c.local_signal == "clauses":
            lines += [
                "  x_t,c    = the turn's verdict on clause c (+1 pass, −1 violate), where c applies",
                f"  z_t,c    = {_norm_text('x_·,c', 'g', c.local_norm)},  g = {group}",
                f"             a step alone in g gets {lone}",
                "  A_local  = (Σ_c w_c·z_t,c / Σ_c w_c) / its std over the batch,  w_c the "
                "clause weights",
                "             a turn without a local signal gets 0",
            ]
        else:
            lines.append(f"  x_t      = {_signal_text(c, c.local_signal)}")
            if c.form_clauses:
                lines += [
                    f"             = f_t + c_t,  f_t the share of {', '.join(c.form_clauses)} "
                    "(the form)",
                    "  x'_t     = x_t − (mean c over g's turns with t's form verdicts − mean c "
                    "over g)",
                    "             (x_t where no other turn of g has its form)",
                ]
            x = "x'" if c.form_clauses else "x"
            lines += [
                f"  A_local  = {_norm_text(x, 'g', c.local_norm)},  g = {group}",
                f"             a step alone in g gets {lone}; a turn without a local signal gets 0",
            ]
    else:
        lines.append("  A_local  not used (α = 0 throughout)")
    if uses_global:
        y = (
            "R, the trajectory's outcome"
            if c.global_signal == "outcome"
            else _signal_text(c, "return")
        )
        group = "the K rollouts of its task" if c.global_groups == "task" else "the whole batch"
        unit = "one value per trajectory" if c.global_unit == "trajectory" else "one value per step"
        lines += [
            f"  y        = {y}",
            f"  A_global = {_norm_text('y', 'k', c.global_norm)},  k = {group} ({unit})",
        ]
    else:
        lines.append("  A_global not used (α = 1 throughout, convex mix)")
    if not uses_local:
        lines.append("  A        = A_global")
    elif not uses_global:
        lines.append("  A        = A_local")
    elif c.mix == "additive":
        lines.append(f"  A        = A_global + α·A_local,  {_alpha_text(c.alpha)}")
    else:
        lines.append(f"  A        = α·A_local + (1 − α)·A_global,  {_alpha_text(c.alpha)}")
    kl = f" + {c.beta:g}·{c.kl}(π‖π_ref)" if c.beta else ""
    weight = f"min(π/π_old, {c.is_cap:g})·" if c.replay_in_gradient else ""
    if c.clip is not None:
        pg = f"min(ρA, clip(ρ, {1 - c.clip:g}, {1 + c.clip:g})·A)"
        lines.append(f"  loss     = {c.loss_agg} of  −{pg}{kl}  over action tokens, ρ = π/π_old")
    else:
        lines.append(f"  loss     = {c.loss_agg} of  −{weight}A·log π(a){kl}  over action tokens")
    if c.replay_in_gradient:
        lines.append("             replayed history enters with truncated importance weights")
    if c.kl_target is not None:
        lines.append(
            f"             β adapts each iteration: × KL / {c.kl_target:g} (½ … 2), "
            f"within {c.beta:g} … {max(BETA_MAX, c.beta):g}"
        )
    return "\n".join(lines)


def schema() -> dict:
    """JSON schema of `AdvantageConfig`, for editors completing recipe files."""
    return AdvantageConfig.model_json_schema()
