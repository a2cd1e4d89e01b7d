"""Should your agent do RL? The method's first step — three questions — as pure, checkable
functions.

The method asks a team to decide before it builds (docs/method.md#should-you-rl): decide first,
then act; avoid RL for RL's sake. Three questions, each answered here from evidence the team can
bring:

1. **Has SFT plateaued?** If more data, better prompts or few-shot examples still buy a clear
   gain, use them first. RL pays when SFT's gains flatten *and* the remaining problems are
   preference trade-offs and long-horizon decisions. Evidence: the SFT learning curve
   (`plateau`: a power law fitted to its tail, extrapolated to twice the training) and the
   imitation ceiling (`imitation_gap`: how much of what the policy still gets wrong its own SFT
   data — the teacher — also gets wrong, which no amount of imitating it can fix).
2. **Is a reward obtainable?** Maths and code have verifiable rewards. Dialogue seems to have
   none, but a generative reward model (GRM) that checks a constitution clause by clause turns it
   into a review score (`answer_reward`: a verifiable check, or a GRM whose agreement with
   reference verdicts is good enough).
3. **Does the gain cover the cost?** RL's compute, people and iteration time are not small
   (`estimate_cost`: tokens generated, reviews, GPU-hours and memory on a chosen GPU, from
   throughput the kit *measured*, never from invented speeds).

`recommend` turns the three answers into a short recommendation with its reasons. Notebook
`00_should_you_rl.py` is the interactive version.

Throughput records (`data/throughput/*.json`, `ThroughputRecord`) say how fast a device ran the
kit's loop: generated tokens/s in rollouts, tokens/s through the update, reviews/s, and the
command and date that measured them. `python -m kitchen.decide measure RECIPE --out FILE` writes
one from a short training run; the JSON that `benchmarks/bench_gpu.py --out FILE` writes is read
as one too.

Departures from the method (docs/method.md#should-you-rl), and the assumptions this module makes
(each is also printed where it is used):
1. The method gives no test for "SFT has plateaued". Ours: fit `y ≈ c · x^(−b)` (y the held-out
   loss, x the optimiser step) to the last `tail` of the curve; the projected gain of doubling
   the training is `1 − 2^(−b)`; below `min_gain` the curve has plateaued. A learning-rate
   schedule that decays to zero flattens the end of any curve, so this test leans towards
   "plateaued"; a second, longer run is the stronger evidence.
2. "Remaining problems concentrate on preferences" is measured as the share of the policy's
   remaining failures (per clause, plus task success) that its SFT data fails as well.
3. Speeds measured for one model size are scaled to another as compute-bound work:
   tokens/s ∝ 1 / parameters. Small models are overhead- or memory-bound, so scaling a tiny
   model's figure up over-estimates the time a large one needs; scaling down under-estimates it.
4. Memory is a formula, not a measurement: weights by precision, LoRA parameters with their
   gradients and AdamW state, and an activation estimate that is stated with its terms.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from kitchen import paths
from kitchen.config import StrictModel

# --------------------------------------------------------------------------------------------
# Question 1: has SFT plateaued?
# --------------------------------------------------------------------------------------------


class Plateau(BaseModel):
    """The plateau test's result (see `plateau`)."""

    metric: str
    steps: list[float] = Field(description="The tail points the power law was fitted to.")
    values: list[float]
    exponent: float = Field(description="b in y ≈ c · x^(−b) over the tail (y: loss or error).")
    log_c: float = Field(description="log c of the fit, so y(x) = exp(log_c) · x^(−b).")
    higher_is_better: bool = False
    observed_gain: float = Field(description="Relative improvement from the tail's first point.")
    projected_gain: float = Field(description="Relative improvement if training were doubled.")
    min_gain: float
    plateaued: bool


def plateau(
    steps: Sequence[float],
    values: Sequence[float],
    *,
    tail: float = 0.3,
    min_gain: float = 0.05,
    higher_is_better: bool = False,
    metric: str = "eval_loss",
) -> Plateau:
    """Has the learning curve flattened? A power law fitted to its tail, extrapolated.

    With y the loss (or the error 1 − value when `higher_is_better`, for metrics in [0, 1]) and
    x the training step, fit by least squares over the points with x ≥ (1 − tail) · max x (at
    least the last two points with x > 0):

        log y = log c − b · log x
        projected gain of doubling x:   1 − 2^(−b)      (y shrinks by that fraction)
        observed gain over the tail:    1 − y_last / y_first
        plateaued  ⇔  projected gain < min_gain

    b ≤ 0 (the curve went flat or up) gives a projected gain ≤ 0: plateaued. steps, values: [N].
    """
    if len(steps) != len(values):
        raise ValueError(f"steps ({len(steps)}) and values ({len(values)}) differ in length")
    pts = [(float(x), float(y)) for x, y in zip(steps, values, strict=True) if x > 0]
    if higher_is_better:
        pts = [(x, 1.0 - y) for x, y in pts]
    pts = [(x, y) for x, y in pts if y > 0 and math.isfinite(y)]
    if len(pts) < 2:
        raise ValueError("the plateau test needs at least two points with step > 0 and value > 0")
    pts.sort()
    start = (1.0 - tail) * pts[-1][0]
    use = [p for p in pts if p[0] >= start]
    if len(use) < 2:
        use = pts[-2:]
    lx = [math.log(x) for x, _ in use]
    ly = [math.log(y) for _, y in use]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    sxx = sum((a - mx) ** 2 for a in lx)
    b = -sum((a - mx) * (c - my) for a, c in zip(lx, ly, strict=True)) / sxx if sxx else 0.0
    log_c = my + b * mx
    projected = 1.0 - 2.0 ** (-b)
    raw = [y for _, y in use]
    return Plateau(
        metric=metric,
        steps=[x for x, _ in use],
        values=[1.0 - y for y in raw] if higher_is_better else raw,
        exponent=b,
        log_c=log_c,
        higher_is_better=higher_is_better,
        observed_gain=1.0 - raw[-1] / raw[0],
        projected_gain=projected,
        min_gain=min_gain,
        plateaued=projected < min_gain,
    )


def load_sft_log(path: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """The rows of an SFT trainer log (`kitchen sft` writes runs/<name>/log.jsonl); by default
    the shipped cold-start run's, `data/models/policy-tiny/sft_log.jsonl`."""
    from kitchen.files import read_jsonl

    return list(read_jsonl(path or paths.DATA / "models" / "policy-tiny" / "sft_log.jsonl"))


def imitation_gap(
    policy: Mapping[str, float], teacher: Mapping[str, float]
) -> list[dict[str, float | str]]:
    """Per metric in both (pass rates, success: higher is better, in [0, 1]) — where the
    policy's remaining failures come from:

        remaining = 1 − policy
        imitable  = max(teacher − policy, 0)   what imitating the SFT data better could still gain
        beyond    = 1 − max(teacher, policy)   what the SFT data gets wrong too: out of SFT's reach

    Returns rows {metric, policy, teacher, remaining, imitable, beyond}, in `policy`'s order.
    """
    rows = []
    for k, p in policy.items():
        if k not in teacher:
            continue
        t = teacher[k]
        rows.append(
            {
                "metric": k,
                "policy": p,
                "teacher": t,
                "remaining": 1.0 - p,
                "imitable": max(t - p, 0.0),
                "beyond": 1.0 - max(t, p),
            }
        )
    return rows


def beyond_share(rows: Sequence[Mapping[str, Any]]) -> float:
    """Σ beyond / Σ remaining over `imitation_gap` rows: the share of what is left that SFT on
    the same data cannot reach (0 when nothing is left)."""
    remaining = sum(r["remaining"] for r in rows)
    return sum(r["beyond"] for r in rows) / remaining if remaining > 0 else 0.0


def sft_ceiling(
    policy: str | os.PathLike | None = None,
    tasks: int = 30,
    samples: int = 1,
    seed: int = 1234,
    threads: int | None = 1,
) -> tuple[Any, Any]:
    """The SFT policy and its teacher on held-out tasks and profiles, both judged by the rules.

    The teacher is the scripted agent that wrote the SFT data: `scripted.episodes(n, "heldout",
    seed=0)` replays the first n dialogues of `data/sft/eval.jsonl`. The policy plays
    `evaluate.eval_jobs` (the same held-out split, its own draw of tasks). Returns
    (policy report, teacher report), `kitchen.evaluate.PolicyReport`s. `threads`: torch's CPU
    threads while playing (restored after; one is fastest for the tiny policy, see
    `Recipe.torch_threads`; None leaves torch's setting).
    """
    import torch

    from kitchen.evaluate import EvalConfig, eval_jobs, policy_report
    from kitchen.models import ModelSpec, load_model
    from kitchen.rollout import RolloutConfig, rollout
    from kitchen.scripted import episodes

    cfg = EvalConfig(tasks=tasks, samples=samples, seed=seed)
    model, tok = load_model(ModelSpec(path=str(policy or paths.DATA / "models" / "policy-tiny")))
    model.eval()
    jobs = eval_jobs(cfg)
    before = torch.get_num_threads()
    try:
        if threads:
            torch.set_num_threads(threads)
        trajs, _ = rollout(
            model, tok, jobs, RolloutConfig(k=samples), seed=seed, group_prefix="eval:"
        )
    finally:
        torch.set_num_threads(before)
    pcs = [pc for _, pc, _ in jobs for _ in range(samples)]
    teacher = episodes(len(trajs), "heldout", seed=0)
    return (
        policy_report(trajs, pcs),
        policy_report([t for t, _ in teacher], [pc for _, pc in teacher]),
    )


def rates(report: Any) -> dict[str, float]:
    """A `PolicyReport` as {"success": …, clause id: pass rate, …} for `imitation_gap`."""
    return {"success": report.success} | dict(report.clause_pass)


# --------------------------------------------------------------------------------------------
# The answers
# --------------------------------------------------------------------------------------------


class Answer(BaseModel):
    """One question's answer: yes (True), no (False) or not known yet (None), with reasons."""

    question: str
    ok: bool | None
    summary: str
    reasons: list[str] = Field(default_factory=list)

    def markdown(self, number: int) -> str:
        """`**Question N — question** summary` and the reasons as a bullet list."""
        head = f"**Question {number} — {self.question}** {self.summary}\n\n"
        return head + "\n".join(f"- {r}" for r in self.reasons)


def answer_sft(
    curve: Plateau,
    beyond: float | None = None,
    *,
    cheaper_fixes_help: bool = False,
    min_beyond: float = 0.5,
) -> Answer:
    """Question 1. Yes when the curve has plateaued, the remaining failures lie mostly beyond the
    SFT data (`beyond` ≥ `min_beyond`, when known), and the team reports no cheaper fix (more
    data, prompts, few-shot examples) still helping."""
    q = "Has SFT plateaued?"
    reasons = [
        f"learning curve ({curve.metric}): doubling the training is projected to improve it by "
        f"{curve.projected_gain:.1%} (power law over steps "
        f"{curve.steps[0]:.0f}–{curve.steps[-1]:.0f}; threshold {curve.min_gain:.0%}); the last "
        f"stretch improved it by {curve.observed_gain:.1%}"
    ]
    if beyond is not None:
        reasons.append(
            f"{beyond:.0%} of the policy's remaining failures are failures of its SFT data too "
            f"(out of imitation's reach; threshold {min_beyond:.0%})"
        )
    if cheaper_fixes_help:
        reasons.append("the team reports that more data, prompts or few-shot examples still help")
    if cheaper_fixes_help:
        return Answer(
            question=q, ok=False, summary="no — cheaper fixes still work", reasons=reasons
        )
    if not curve.plateaued:
        return Answer(
            question=q, ok=False, summary="no — the SFT curve is still falling", reasons=reasons
        )
    if beyond is not None and beyond < min_beyond:
        return Answer(
            question=q,
            ok=False,
            summary="not yet — most of what is left is imitable (a better SFT run could fix it)",
            reasons=reasons,
        )
    return Answer(question=q, ok=True, summary="yes — SFT has flattened", reasons=reasons)


def grm_kappa(path: str | os.PathLike | None = None) -> tuple[float | None, str]:
    """Cohen's κ of the GRM from a calibration report (`kitchen grm calibrate --out FILE`; by
    default `data/models/grm-tiny/calibration.json`): against human labels when the report has
    them, else against the rule judge. Returns (κ, where it came from) or (None, why not)."""
    p = Path(path or paths.DATA / "models" / "grm-tiny" / "calibration.json")
    if not p.is_file():
        return None, f"no calibration report at {p}"
    doc = json.loads(p.read_text())
    for ref in ("human", "judge"):
        if doc.get(ref):
            return float(doc[ref]["kappa"]), f"{doc.get('command', p.name)}, against the {ref}"
    return None, f"{p}: no agreement figures"


def answer_reward(
    *,
    verifiable: bool,
    constitution_valid: bool,
    grm_kappa: float | None,
    min_kappa: float = 0.6,
) -> Answer:
    """Question 2. Yes when the whole task is verifiable by a program, or when a valid
    constitution and a GRM that agrees with reference verdicts (Cohen's κ ≥ `min_kappa`; 0.6 is
    about where Landis & Koch's (1977) "substantial agreement", 0.61–0.80, starts) turn it into a review score. Unknown
    (None) while no GRM has been calibrated."""
    q = "Is a reward obtainable?"
    if verifiable:
        return Answer(
            question=q,
            ok=True,
            summary="yes — a program can check the task",
            reasons=["a verifiable reward: RL's classic case (maths, code)"],
        )
    reasons = [
        "the task is not fully verifiable: the reward must come from a GRM reviewing a "
        "constitution clause by clause (docs/method.md#grm)"
    ]
    if not constitution_valid:
        reasons.append("the constitution does not validate yet (notebook 01)")
        return Answer(
            question=q, ok=False, summary="no — write the constitution first", reasons=reasons
        )
    reasons.append("the constitution validates")
    if grm_kappa is None:
        reasons.append("no GRM calibration yet: train and calibrate one (notebook 03)")
        return Answer(question=q, ok=None, summary="not known — calibrate a GRM", reasons=reasons)
    reasons.append(f"GRM agreement with the reference: κ = {grm_kappa:.2f} (threshold {min_kappa})")
    if grm_kappa < min_kappa:
        return Answer(
            question=q, ok=False, summary="no — the GRM disagrees too often", reasons=reasons
        )
    return Answer(question=q, ok=True, summary="yes — through the GRM", reasons=reasons)


def answer_cost(cost: CostEstimate, budget_gpu_hours: float | None) -> Answer:
    """Question 3. Yes when the estimate fits the device's memory and the budget; unknown when
    there is no throughput measurement for the device (or no budget given)."""
    q = "Does the gain cover the cost?"
    reasons = [
        f"{cost.iterations} iterations: {cost.generated_tokens:,.0f} generated tokens, "
        f"{cost.reviews:,.0f} GRM reviews, {cost.update_tokens:,.0f} tokens through the update"
    ]
    reasons.append(
        f"memory (formula): {cost.memory.total_gb:.1f} GB of {cost.memory.device_gb:.0f} GB"
        if cost.memory.device_gb
        else f"memory (formula): {cost.memory.total_gb:.1f} GB"
    )
    if cost.memory.device_gb and not cost.memory.fits:
        return Answer(
            question=q,
            ok=False,
            summary="no — it does not fit the device's memory",
            reasons=[*reasons, "try QLoRA, gradient checkpointing or smaller batches"],
        )
    if cost.hours is None:
        return Answer(question=q, ok=None, summary="not known — " + cost.missing, reasons=reasons)
    reasons.append(f"time: {cost.hours:,.1f} device-hours ({cost.source})")
    if budget_gpu_hours is None:
        return Answer(question=q, ok=None, summary="not known — give a budget", reasons=reasons)
    reasons.append(f"budget: {budget_gpu_hours:,.1f} device-hours")
    if cost.hours > budget_gpu_hours:
        return Answer(
            question=q,
            ok=False,
            summary="no — over budget: smaller K, fewer iterations or a smaller model",
            reasons=reasons,
        )
    return Answer(question=q, ok=True, summary="yes — within budget", reasons=reasons)


class Recommendation(BaseModel):
    """The outcome: a verdict, one line, and the answers behind it."""

    verdict: Literal["do RL", "not yet", "don't"]
    headline: str
    answers: list[Answer]

    def text(self) -> str:
        """The recommendation as Markdown: headline, then each question with its reasons."""
        lines = [f"**{self.verdict}** — {self.headline}", ""]
        for a in self.answers:
            lines.append(f"- **{a.question}** {a.summary}")
            lines += [f"  - {r}" for r in a.reasons]
        return "\n".join(lines)


def recommend(sft: Answer, reward: Answer, cost: Answer) -> Recommendation:
    """The method's first step as a rule (docs/method.md#should-you-rl): RL when all three answers
    are yes.

    - a "no" on the reward → "don't" (yet): without a reward there is nothing to optimise;
    - a "no" on SFT → "not yet": cheaper fixes first ("don't hand prompt engineering's problems
      to RL");
    - a "no" on cost → "not yet": shrink the run or raise the budget;
    - any unknown → "not yet", naming what to measure;
    - all yes → "do RL".
    """
    answers = [sft, reward, cost]
    if reward.ok is False:
        return Recommendation(
            verdict="don't",
            headline="no reward to optimise yet: " + reward.summary.split("— ")[-1],
            answers=answers,
        )
    if sft.ok is False:
        return Recommendation(
            verdict="not yet",
            headline="SFT has not run out of road: " + sft.summary.split("— ")[-1],
            answers=answers,
        )
    if cost.ok is False:
        return Recommendation(
            verdict="not yet",
            headline="the run does not fit: " + cost.summary.split("— ")[-1],
            answers=answers,
        )
    unknown = [a for a in answers if a.ok is None]
    if unknown:
        return Recommendation(
            verdict="not yet",
            headline="evidence missing: " + "; ".join(a.summary.split("— ")[-1] for a in unknown),
            answers=answers,
        )
    return Recommendation(
        verdict="do RL",
        headline="SFT has flattened, a reward is obtainable, and the run fits the budget",
        answers=answers,
    )


# --------------------------------------------------------------------------------------------
# Question 3: what a run costs — model shapes, devices, measured throughput
# --------------------------------------------------------------------------------------------


class Architecture(BaseModel):
    """A decoder-only transformer's shape (Qwen2 / Llama style: GQA attention, SwiGLU MLP)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = Field(description="Input embedding and output head share weights.")
    qkv_bias: bool = Field(description="Qwen2 has biases on q, k, v; Llama has none.")
    head_dim: int | None = None
    source: str = ""

    @property
    def hd(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one decoder block."""
        h, q, kv, i = self.hidden, self.heads * self.hd, self.kv_heads * self.hd, self.intermediate
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def linear_parameters(self) -> int:
        """Parameters in the decoder blocks' linear layers (what 4-bit quantisation packs)."""
        per = sum(a * b for a, b in self.linear_shapes().values())
        if self.qkv_bias:
            per += self.heads * self.hd + 2 * self.kv_heads * self.hd
        return per * self.layers

    def parameters(self) -> int:
        """Exact parameter count: blocks, two RMSNorms per block, the final norm, embeddings."""
        emb = self.vocab * self.hidden * (1 if self.tied else 2)
        return self.linear_parameters() + self.layers * 2 * self.hidden + self.hidden + emb

    def lora_parameters(self, r: int) -> int:
        """LoRA (`target_modules: all-linear`): r · (in + out) per adapted linear layer."""
        return self.layers * sum(r * (a + b) for a, b in self.linear_shapes().values())

    @classmethod
    def from_config(cls, path: str | os.PathLike, name: str | None = None) -> Architecture:
        """Read a Hugging Face `config.json` (a file or the folder holding it)."""
        p = Path(path)
        cfg = json.loads((p / "config.json" if p.is_dir() else p).read_text())
        return cls(
            name=name or p.name,
            hidden=cfg["hidden_size"],
            layers=cfg["num_hidden_layers"],
            heads=cfg["num_attention_heads"],
            kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            intermediate=cfg["intermediate_size"],
            vocab=cfg["vocab_size"],
            tied=cfg.get("tie_word_embeddings", False),
            qkv_bias=cfg.get("model_type") == "qwen2" or cfg.get("attention_bias", False),
            head_dim=cfg.get("head_dim"),
            source=str(p),
        )


def _qwen(name: str, h: int, layers: int, heads: int, kv: int, i: int, vocab: int, tied: bool):
    return Architecture(
        name=name, hidden=h, layers=layers, heads=heads, kv_heads=kv, intermediate=i,
        vocab=vocab, tied=tied, qkv_bias=True,
        source=f"config.json of Qwen/{name} on the Hugging Face hub",
    )  # fmt: skip


# Published configurations (config.json on the hub); parameter counts follow from the shapes.
ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        _qwen("Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, True),
        _qwen("Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, True),
        _qwen("Qwen2.5-3B", 2048, 36, 16, 2, 11008, 151936, True),
        _qwen("Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False),
        _qwen("Qwen2.5-14B", 5120, 48, 40, 8, 13824, 152064, False),
        Architecture(
            name="Llama-3.1-8B", hidden=4096, layers=32, heads=32, kv_heads=8,
            intermediate=14336, vocab=128256, tied=False, qkv_bias=False,
            source="config.json of meta-llama/Llama-3.1-8B on the Hugging Face hub",
        ),
    )
}  # fmt: skip


def architectures() -> dict[str, Architecture]:
    """The shipped tiny models (read from their config.json) and the published shapes above."""
    out = {}
    for name in ("policy-tiny", "grm-tiny"):
        folder = paths.DATA / "models" / name
        if (folder / "config.json").is_file():
            out[name] = Architecture.from_config(folder, name=name)
    return out | ARCHITECTURES


def architecture_of(path: str, archs: Mapping[str, Architecture] | None = None) -> str | None:
    """The `architectures()` key for a checkpoint path or hub name ('Qwen/Qwen2.5-1.5B-Instruct'
    → 'Qwen2.5-1.5B'), or None when it is none of them."""
    archs = archs or architectures()
    if Path(path).name in archs:
        return Path(path).name
    return next(
        (k for k in sorted(archs, key=len, reverse=True) if k.lower() in path.lower()), None
    )


# Memory as printed on the vendors' spec sheets, in GB (10^9 bytes).
GPUS: dict[str, float] = {
    "H200": 141,
    "H100 80GB": 80,
    "A100 80GB": 80,
    "A100 40GB": 40,
    "L40S": 48,
    "A10G": 24,
    "L4": 24,
    "RTX 4090": 24,
    "T4": 16,
}


class ThroughputRecord(BaseModel):
    """How fast one device ran the kit's loop: one file in `data/throughput/`.

    Speeds are medians over a run's iterations after warm-up. `update_tokens_per_s` counts every
    token of the packed sequences (prompt and actions) through the policy's forward and backward
    plus the KL reference's forward, as `speed/update_tokens_per_s` does.
    """

    device: str = Field(description="'cpu', or the GPU's name as torch.cuda reports it.")
    hardware: str = Field("", description="Cores, threads, library versions, load.")
    model: str = Field(description="What was measured (a checkpoint, or a shape).")
    parameters: int = Field(ge=1, description="Its parameter count.")
    quantization: Literal["none", "nf4", "int8"] = "none"
    rollout_tokens_per_s: float = Field(gt=0, description="Generated tokens/s in rollouts.")
    update_tokens_per_s: float = Field(gt=0, description="Tokens/s through the update.")
    review_tokens_per_s: float | None = Field(None, description="GRM tokens written per second.")
    reviews_per_s: float | None = Field(None, description="Reviews (trajectories) per second.")
    reviewer: str = Field("judge", description="'judge' (rule judge), 'grm' or 'grm-adapter'.")
    peak_memory_gb: float | None = Field(None, description="Measured peak device memory (GB).")
    workload: dict[str, float] = Field(
        default_factory=dict,
        description="The measured dialogues' shape: turns, generated_tokens_per_turn, "
        "other_tokens_per_turn (diner, tools, template).",
    )
    iterations: int = Field(0, description="Iterations the medians are over.")
    command: str = Field(description="The command that measured it.")
    date: str = Field(description="When (YYYY-MM-DD).")
    notes: str = ""
    path: str = Field("", exclude=True, description="The file it was read from.")


def _from_bench_gpu(doc: dict[str, Any], path: Path) -> ThroughputRecord:
    """`benchmarks/bench_gpu.py --out FILE` output → a record (medians after the first
    iteration, which pays for CUDA warm-up)."""
    shape = doc.get("shape", "qwen2.5-0.5b")
    if shape == "small":  # bench_gpu.py --small: its SMALL shape
        arch = Architecture(
            name="bench-small", hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256,
            vocab=4096, tied=True, qkv_bias=True,
        )  # fmt: skip
    else:
        arch = ARCHITECTURES["Qwen2.5-0.5B"]
    its = doc["iterations"][1:] or doc["iterations"]
    if not its:
        raise ValueError(
            f"{path}: bench_gpu.py measured no iteration (phases: {doc.get('phases', {})}); "
            "rerun it with more time (GPU_CHECK_BUDGET_S) or fewer --iterations"
        )

    def med(k: str) -> float | None:
        xs = [r[k] for r in its if r.get(k)]
        return statistics.median(xs) if xs else None

    reviews = med("reviews_per_s")
    # random weights rarely stop: each review line is taken to fill its token budget
    work = doc.get("settings") or {}
    budget = work.get("review", 64 if shape == "small" else 256)
    episodes = doc.get("episodes_per_rollout") or 0
    lines = med("review_lines")
    per_review = budget * (lines / episodes if lines and episodes else work.get("turns", 1))
    return ThroughputRecord(
        device=doc.get("device", "unknown"),
        hardware=doc.get("hardware", ""),
        model=f"random weights, {shape} shape",
        parameters=doc.get("parameters") or arch.parameters(),
        quantization="nf4" if doc.get("device", "cpu").lower() != "cpu" else "none",
        rollout_tokens_per_s=med("rollout_tokens_per_s"),
        update_tokens_per_s=med("update_tokens_per_s"),
        reviews_per_s=reviews,
        review_tokens_per_s=reviews * per_review if reviews else None,
        reviewer="grm-adapter",
        peak_memory_gb=doc["peak_gb_policy_ref_grm"] * 2**30 / 1e9
        if doc.get("peak_gb_policy_ref_grm")
        else None,
        iterations=len(its),
        command=doc.get("command", f"python benchmarks/bench_gpu.py --out {path}"),
        date=doc.get("date", "not recorded"),
        notes=f"bench_gpu.py: {shape}-shaped policy (nf4 QLoRA on a GPU), GRM as a second "
        f"adapter on the same base; review tokens assume every review line fills its "
        f"{budget}-token budget ({per_review:.0f} tokens per reviewed trajectory).",
        path=str(path),
    )


def read_throughput(path: str | os.PathLike) -> ThroughputRecord:
    """One record: a `ThroughputRecord` JSON file, or `bench_gpu.py`'s output."""
    p = Path(path)
    doc = json.loads(p.read_text())
    if "iterations" in doc and isinstance(doc["iterations"], list):
        return _from_bench_gpu(doc, p)
    return ThroughputRecord.model_validate(doc | {"path": str(p)})


def load_throughput(folder: str | os.PathLike | None = None) -> list[ThroughputRecord]:
    """Every record in `folder` (default `data/throughput/`), sorted by file name."""
    folder = Path(folder or paths.DATA / "throughput")
    return [read_throughput(p) for p in sorted(folder.glob("*.json"))] if folder.is_dir() else []


def for_device(
    records: Sequence[ThroughputRecord], device: str, parameters: int | None = None
) -> ThroughputRecord | None:
    """The record for `device` ('cpu' or a `GPUS` key, matched against the name torch reports:
    'H100 80GB' matches 'NVIDIA H100 80GB HBM3'), the one whose model size is nearest to
    `parameters` when there are several; None when the device was never measured."""
    words = device.lower().replace("gb", "").split()
    if device.lower() == "cpu":
        found = [r for r in records if r.device.lower() == "cpu"]
    else:
        found = [r for r in records if all(w in r.device.lower() for w in words)]
    if not found:
        return None
    if parameters is None:
        return found[0]
    return min(found, key=lambda r: abs(math.log(r.parameters / parameters)))


class CostInputs(StrictModel):
    """What the calculator needs. Defaults: `recipes/gpu_qwen_qlora.yaml` (Qwen2.5-1.5B, QLoRA,
    K 8, 8 turns of at most 160 tokens, 16 tasks × 100 iterations, GRM adapter on the same base,
    reviews of at most 384 tokens) — budgets, so the estimate is an upper bound."""

    policy: str = Field("Qwen2.5-1.5B", description="A key of `architectures()`.")
    grm: str | None = Field(None, description="The GRM's architecture; None: the policy's.")
    grm_shares_base: bool = Field(
        True, description="GRM = a second LoRA adapter on the policy's base (one GPU)."
    )
    method: Literal["lora", "qlora"] = Field("qlora", description="bf16 LoRA or 4-bit NF4 QLoRA.")
    lora_r: int = Field(16, ge=1)
    k: int = Field(8, ge=1, description="Samples per task (the task group).")
    tasks_per_iteration: int = Field(16, ge=1)
    iterations: int = Field(100, ge=1)
    turns: float = Field(8, gt=0, description="Assistant turns per dialogue.")
    tokens_per_turn: float = Field(160, gt=0, description="Tokens the policy writes per turn.")
    other_tokens_per_turn: float = Field(
        40,
        ge=0,
        description="Tokens the diner, the tools and the chat template add per turn (39 measured "
        "on the concierge world with the tiny tokenizer: data/throughput/cpu.json).",
    )
    review_tokens: float = Field(384, gt=0, description="Tokens the GRM writes per review.")
    votes: int = Field(
        1, ge=0, description="GRM reviews per trajectory (>1: majority vote; 0: the rule judge)."
    )
    minibatch: int = Field(32, ge=1, description="Step samples per optimiser step.")
    rollout_batch: int = Field(64, ge=1, description="Episodes generated together.")
    review_batch: int = Field(32, ge=1, description="Trajectories reviewed together.")
    gradient_checkpointing: bool = True
    device: str = Field("H100 80GB", description="'cpu' or a key of `GPUS`.")

    @classmethod
    def from_recipe(
        cls, recipe: Any, workload: Mapping[str, float] | None = None, **changes: Any
    ) -> CostInputs:
        """The inputs a training recipe (`kitchen.train.Recipe`) implies. Dialogue shape from
        `workload` (a throughput record's measured turns and tokens per turn) where given, else
        the recipe's budgets (`max_turns`, `max_new_tokens`: an upper bound). Reviews: the GRM's
        `samples` per trajectory, or none when the rule judge reviews."""
        archs = architectures()
        w = dict(workload or {})
        policy = architecture_of(recipe.policy.path, archs)
        if policy is None:
            raise ValueError(f"{recipe.policy.path}: unknown shape; pick one of {', '.join(archs)}")
        shares = bool(recipe.grm.adapter)
        grm = None if shares else architecture_of(recipe.grm.model, archs)
        values = {
            "policy": policy,
            "grm": grm,
            "grm_shares_base": shares,
            "method": "qlora" if recipe.policy.quantization == "nf4" else "lora",
            "lora_r": recipe.policy.lora.r,
            "k": recipe.rollout.k,
            "tasks_per_iteration": recipe.train.tasks_per_iteration,
            "iterations": recipe.train.iterations,
            "turns": w.get("turns", recipe.rollout.max_turns),
            "tokens_per_turn": w.get("generated_tokens_per_turn", recipe.rollout.max_new_tokens),
            "other_tokens_per_turn": w.get("other_tokens_per_turn", 40),
            # a review writes one line per turn, each within the GRM's line budget
            "review_tokens": recipe.grm.max_new_tokens * w.get("turns", recipe.rollout.max_turns),
            "votes": recipe.grm.samples if recipe.reward.reviewer == "grm" else 0,
            "minibatch": recipe.train.minibatch,
            "rollout_batch": recipe.rollout.batch_size,
            "review_batch": recipe.grm.batch_size,
            "gradient_checkpointing": recipe.policy.gradient_checkpointing,
        }
        return cls.model_validate(values | changes)


class MemoryEstimate(BaseModel):
    """Peak device memory by formula (GB = 10^9 bytes); `parts` name each term's formula."""

    parts: dict[str, float]
    formulas: dict[str, str]
    total_gb: float
    device_gb: float | None
    fits: bool | None


class CostEstimate(BaseModel):
    """Counts per run, time from a measured record (or why not), memory by formula."""

    iterations: int
    episodes: float
    generated_tokens: float
    reviews: float
    review_tokens: float
    update_tokens: float
    seconds: dict[str, float] | None = Field(
        None, description="Per run: rollout, review, update seconds (None without a record)."
    )
    hours: float | None
    source: str = Field("", description="Which measurement, and how it was scaled.")
    assumptions: list[str] = Field(default_factory=list)
    missing: str = Field("", description="What to run when there is no measurement.")
    memory: MemoryEstimate


NF4_BITS = 4.127  # 4-bit NF4 weights + double-quantised block constants (QLoRA paper, §3)


def estimate_memory(inp: CostInputs, arch: Architecture, grm: Architecture) -> MemoryEstimate:
    """Peak memory on the device, by formula (every term listed in `formulas`).

        weights    QLoRA: linear params × 4.127 bits + the rest (embeddings, norms) × 2 B;
                   LoRA: all params × 2 B (bf16). A GRM on its own base adds its weights.
        adapters   policy LoRA × 16 B (fp32 weight, gradient, AdamW m and v);
                   GRM adapter × 4 B (fp32, frozen during RL)
        update     B = ceil(minibatch / turns) packed sequences of S = turns × (tokens_per_turn +
                   other_tokens_per_turn) tokens. Per token and layer autograd keeps about
                   12·h + 8·i + 4·kv bytes of bf16 activations (attention in/out, q/k/v, the two
                   norms' inputs, the SwiGLU gate/up/product); with gradient checkpointing only
                   2·h bytes per layer plus one layer's full set. Logits: 4 B × B × S × vocab
                   (the float32 copy `token_logprobs` keeps for the backward).
        rollout    KV cache: rollout_batch × S × layers × 2 (k and v) × kv_heads × head_dim × 2 B
        review     KV cache of the GRM: review_batch × (S + review_tokens) × its layers × …
        peak       weights + adapters + max(update, rollout, review)

    Not counted: the CUDA context, allocator fragmentation and framework buffers — keep headroom.
    """
    gb = 1e9

    def weights(a: Architecture) -> float:
        if inp.method == "qlora":
            lin = a.linear_parameters()
            return lin * NF4_BITS / 8 + (a.parameters() - lin) * 2
        return a.parameters() * 2

    seq = inp.turns * (inp.tokens_per_turn + inp.other_tokens_per_turn)
    b = math.ceil(inp.minibatch / inp.turns)
    h, i, kv = arch.hidden, arch.intermediate, arch.kv_heads * arch.hd
    per_layer = 12 * h + 8 * i + 4 * kv  # bytes per token
    if inp.gradient_checkpointing:
        act = b * seq * (arch.layers * 2 * h + per_layer)
    else:
        act = b * seq * arch.layers * per_layer
    logits = 4 * b * seq * arch.vocab

    def kv_cache(a: Architecture, batch: int, tokens: float) -> float:
        return batch * tokens * a.layers * 2 * a.kv_heads * a.hd * 2

    has_grm = inp.votes > 0  # 0: the rule judge reviews, no GRM on the device
    parts = {
        "weights": weights(arch) / gb,
        "grm weights": weights(grm) / gb if has_grm and not inp.grm_shares_base else 0.0,
        "policy adapter + AdamW": arch.lora_parameters(inp.lora_r) * 16 / gb,
        "grm adapter": grm.lora_parameters(inp.lora_r) * 4 / gb
        if has_grm and inp.grm_shares_base
        else 0.0,
        "update activations": act / gb,
        "update logits": logits / gb,
        "rollout KV cache": kv_cache(arch, inp.rollout_batch, seq) / gb,
        "review KV cache": kv_cache(grm, inp.review_batch, seq + inp.review_tokens) / gb
        if has_grm
        else 0.0,
    }
    formulas = {
        "weights": "linear params × 4.127 bits + other params × 2 B"
        if inp.method == "qlora"
        else "params × 2 B (bf16)",
        "grm weights": "its own base, same precision" if not inp.grm_shares_base else "shared: 0",
        "policy adapter + AdamW": f"LoRA r={inp.lora_r} params × 16 B",
        "grm adapter": f"LoRA r={inp.lora_r} params × 4 B",
        "update activations": f"{b} seq × {seq:.0f} tok × "
        + (
            "(layers × 2h + one layer's 12h+8i+4kv) B"
            if inp.gradient_checkpointing
            else "layers × (12h+8i+4kv) B"
        ),
        "update logits": f"{b} seq × {seq:.0f} tok × vocab × 4 B",
        "rollout KV cache": f"{inp.rollout_batch} × {seq:.0f} tok × layers × 2 × kv_heads × hd × 2 B",
        "review KV cache": f"{inp.review_batch} × {seq + inp.review_tokens:.0f} tok × GRM layers "
        "× 2 × kv_heads × hd × 2 B",
    }
    fixed = sum(
        parts[k] for k in ("weights", "grm weights", "policy adapter + AdamW", "grm adapter")
    )
    total = fixed + max(
        parts["update activations"] + parts["update logits"],
        parts["rollout KV cache"],
        parts["review KV cache"],
    )
    cap = GPUS.get(inp.device)
    return MemoryEstimate(
        parts=parts,
        formulas=formulas,
        total_gb=total,
        device_gb=cap,
        fits=None if cap is None else total <= cap,
    )


def estimate_cost(
    inp: CostInputs,
    records: Sequence[ThroughputRecord],
    archs: Mapping[str, Architecture] | None = None,
) -> CostEstimate:
    """Tokens, reviews, device-hours and memory of a run described by `inp`.

    Per iteration, with E = tasks_per_iteration × K episodes and S = turns × (tokens_per_turn +
    other_tokens_per_turn) tokens per dialogue:

        generated tokens = E × turns × tokens_per_turn
        reviews          = E × votes;   review tokens = reviews × review_tokens
        update tokens    = E × S        (each dialogue packed into one sequence)
        seconds          = generated / rollout_tps + review tokens / review_tps + update / update_tps

    Speeds come from the record for `inp.device` (`for_device`), scaled to the model's size as
    compute-bound work (tps × P_measured / P): the policy's for rollouts and updates, the GRM's for
    reviews. A record without a review figure lends its rollout figure to reviews (a review is
    generation too). No record → `hours` is None and `missing` says what to run.
    """
    archs = archs or architectures()
    arch = archs[inp.policy]
    grm = archs[inp.grm or inp.policy]
    e = inp.tasks_per_iteration * inp.k
    seq = inp.turns * (inp.tokens_per_turn + inp.other_tokens_per_turn)
    n = inp.iterations
    counts = {
        "episodes": n * e,
        "generated_tokens": n * e * inp.turns * inp.tokens_per_turn,
        "reviews": n * e * inp.votes,
        "review_tokens": n * e * inp.votes * inp.review_tokens,
        "update_tokens": n * e * seq,
    }
    memory = estimate_memory(inp, arch, grm)
    rec = for_device(records, inp.device, arch.parameters())
    if rec is None:
        cmd = (
            "python -m kitchen.decide measure data/throughput/cpu-tiny.recipe.yaml "
            "--out data/throughput/cpu.json"
            if inp.device == "cpu"
            else "python benchmarks/bench_gpu.py --out data/throughput/"
            f"{inp.device.split()[0].lower()}.json"
        )
        return CostEstimate(
            iterations=n,
            **counts,
            hours=None,
            missing=f"no {inp.device} measurement recorded yet: run `{cmd}` on one",
            memory=memory,
        )
    p = arch.parameters()
    pg = grm.parameters()
    rollout_tps = rec.rollout_tokens_per_s * rec.parameters / p
    update_tps = rec.update_tokens_per_s * rec.parameters / p
    if rec.review_tokens_per_s:
        review_tps = rec.review_tokens_per_s * rec.parameters / pg
        review_from = "its review figure"
    else:
        review_tps = rec.rollout_tokens_per_s * rec.parameters / pg
        review_from = "its rollout figure (no GRM review measured: a review is generation too)"
    seconds = {
        "rollout": counts["generated_tokens"] / rollout_tps,
        "review": counts["review_tokens"] / review_tps,
        "update": counts["update_tokens"] / update_tps,
    }
    assumptions = []
    if rec.parameters != p or rec.parameters != pg:
        assumptions.append(
            f"speeds measured on a {rec.parameters:,}-parameter model, scaled to "
            f"{p:,} (policy) and {pg:,} (GRM) parameters as compute-bound work: tokens/s ∝ "
            "1/parameters"
            + (
                " — from a much smaller model this over-estimates the time"
                if rec.parameters < min(p, pg) / 10
                else ""
            )
        )
    measured_q = {"none": "lora", "nf4": "qlora", "int8": "int8"}[rec.quantization]
    if rec.device != "cpu" and measured_q != inp.method:
        assumptions.append(
            f"measured with {rec.quantization}; {inp.method} is taken to run at the same speed"
        )
    assumptions.append(f"reviews use {review_from}")
    return CostEstimate(
        iterations=n,
        **counts,
        seconds=seconds,
        hours=sum(seconds.values()) / 3600,
        source=f"{Path(rec.path).name or rec.device}: {rec.device}, {rec.model}, measured "
        f"{rec.date} by `{rec.command}`",
        assumptions=assumptions,
        memory=memory,
    )


# --------------------------------------------------------------------------------------------
# Measuring: a short run → a throughput record
# --------------------------------------------------------------------------------------------


def measure(
    recipe: Any, *, warmup: int = 1, command: str = "", folder: str | None = None
) -> ThroughputRecord:
    """Run `recipe` (a `kitchen.train.Recipe`) for its iterations and record its speeds.

    The speeds are the medians of the loop's own `speed/*` metrics over the iterations after
    `warmup`; the workload (turns, generated and other tokens per turn) is measured on the same
    iterations' dialogues with the policy's tokenizer.
    """
    import datetime
    import platform
    import tempfile

    import torch

    from kitchen.rollout import render_prompt
    from kitchen.train import Run

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(recipe, folder=folder or tmp, progress=False)
        speeds: dict[str, list[float]] = {}
        turns = generated = total = dialogues = 0
        for it in range(recipe.train.iterations):
            m = run.step()
            if it < warmup:
                continue
            for k in ("speed/rollout_tokens_per_s", "speed/update_tokens_per_s"):
                speeds.setdefault(k, []).append(m[k])
            speeds.setdefault("speed/reviews_per_s", []).append(m["speed/reviews_per_s"])
            for t in run.last["trajectories"]:
                ids = run.tok(render_prompt(run.tok, t.messages), add_special_tokens=False)
                dialogues += 1
                turns += len(t.turns)
                generated += sum(len(ti.tokens or []) for ti in t.turns)
                total += len(ids["input_ids"])
    n_params = sum(p.numel() for n, p in run.model.named_parameters() if "lora_" not in n)
    device = "cpu" if run.model.device.type == "cpu" else torch.cuda.get_device_name()
    reviewer = recipe.reward.reviewer
    return ThroughputRecord(
        device=device,
        hardware=f"{os.cpu_count()} CPU cores ({platform.machine()}), torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), load average {load:.1f} at the start",
        model=recipe.policy.path,
        parameters=n_params,
        quantization=recipe.policy.quantization,
        rollout_tokens_per_s=statistics.median(speeds["speed/rollout_tokens_per_s"]),
        update_tokens_per_s=statistics.median(speeds["speed/update_tokens_per_s"]),
        reviews_per_s=statistics.median(speeds["speed/reviews_per_s"])
        if reviewer == "grm"
        else None,
        reviewer=reviewer,
        workload={
            "turns": turns / dialogues,
            "generated_tokens_per_turn": generated / turns,
            "other_tokens_per_turn": (total - generated) / turns,
        },
        iterations=len(speeds["speed/rollout_tokens_per_s"]),
        command=command,
        date=datetime.date.today().isoformat(),
        notes=f"reviewer: {reviewer}"
        + (" (the rule judge: no GRM review speed measured)" if reviewer == "judge" else ""),
    )


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m kitchen.decide measure RECIPE --out FILE [--warmup N]`."""
    import argparse

    from kitchen.train import load_recipe

    ap = argparse.ArgumentParser(
        prog="python -m kitchen.decide", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("measure", help="run a short recipe and write a throughput record")
    p.add_argument("recipe", help="a training recipe YAML (a short one: a few iterations)")
    p.add_argument(
        "--out", required=True, help="the record to write, e.g. data/throughput/cpu.json"
    )
    p.add_argument("--warmup", type=int, default=1, help="iterations left out of the medians")
    args = ap.parse_args(argv)
    command = f"python -m kitchen.decide measure {args.recipe} --out {args.out}"
    if args.warmup != 1:
        command += f" --warmup {args.warmup}"
    rec = measure(load_recipe(args.recipe), warmup=args.warmup, command=command)
    from kitchen.files import atomic_write_text

    atomic_write_text(args.out, rec.model_dump_json(indent=2) + "\n")
    print(rec.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
