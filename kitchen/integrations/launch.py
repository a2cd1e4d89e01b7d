"""Launch files for many GPUs: accelerate configs (DDP, DeepSpeed ZeRO-2/3, FSDP2) and verl's.

docs/method.md#scaling: when one GPU is not enough, hand over to an existing engine with a documented launch.

Generated, not hand-written: `files()` renders every file from a few parameters and
`write_files()` writes them to `recipes/scale/` (the shipped copies; a test keeps the two
equal). Notebook 07 shows them. What each backend is for:

- **ddp** — one full copy of the model per GPU: fastest while the policy, its optimiser state
  and the rollout KV cache fit on one GPU (the tiny model, 0.5B with LoRA).
- **zero2** — DeepSpeed ZeRO stage 2 (Rajbhandari et al. 2020): optimiser state and gradients
  sharded over GPUs, weights replicated. Generation is as fast as DDP's.
- **zero3** — ZeRO stage 3: weights sharded too, for models that do not fit on one GPU. Each
  rollout gathers the weights once (`ds3_gather_for_generation`); the kit's rollout keeps them
  gathered for all turns of a batch.
- **fsdp2** — PyTorch FSDP2, per-decoder-layer sharding (`Qwen2DecoderLayer`), the same memory
  class as ZeRO-3 without DeepSpeed.

Several nodes: `accelerate` counts `num_processes` over all machines; each node runs the same
command with its own `--machine_rank`, and `--main_process_ip` names node 0 (e.g. under SLURM:
`--machine_rank $SLURM_NODEID --main_process_ip $MASTER_ADDR`).

Choices:
1. The files are generated, not written by hand, so the ones in the repository cannot drift from
   what the code expects (a test compares them).
2. Defaults assume 8 GPUs per node (`GPUS_PER_NODE`); change it and regenerate for other nodes.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from kitchen import paths

GPUS_PER_NODE = 8
BACKENDS = ("ddp", "zero2", "zero3", "fsdp2")


def accelerate_config(
    backend: str,
    *,
    nodes: int = 1,
    gpus_per_node: int = GPUS_PER_NODE,
    mixed_precision: str = "bf16",
) -> dict:
    """An `accelerate launch --config_file` config for `backend` on `nodes` × `gpus_per_node`."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r}: use one of {', '.join(BACKENDS)}")
    cfg: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": {
            "ddp": "MULTI_GPU",
            "zero2": "DEEPSPEED",
            "zero3": "DEEPSPEED",
            "fsdp2": "FSDP",
        }[backend],
        "mixed_precision": mixed_precision,
        "num_machines": nodes,
        "num_processes": nodes * gpus_per_node,  # over all machines
        "machine_rank": 0,  # override per node: --machine_rank
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
        "use_cpu": False,
    }
    if nodes > 1:
        cfg |= {"main_process_ip": "NODE0_IP", "main_process_port": 29500}
    if backend.startswith("zero"):
        stage = int(backend[-1])
        cfg["deepspeed_config"] = {
            "zero_stage": stage,
            "offload_optimizer_device": "none",
            "offload_param_device": "none",
            "zero3_init_flag": stage == 3,
            "zero3_save_16bit_model": stage == 3,
            "deepspeed_multinode_launcher": "standard",
        }
    if backend == "fsdp2":
        cfg["fsdp_config"] = {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "Qwen2DecoderLayer",
            "fsdp_reshard_after_forward": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_offload_params": False,
            "fsdp_activation_checkpointing": False,
        }
    return cfg


def trl_recipe(kind: str) -> dict:
    """The TRL recipes: `tiny` (the shipped tiny policy, rule-judge reward: runs on a CPU and
    in the multi-process test) and `qwen0.5b` (Qwen2.5-0.5B-Instruct with LoRA and the GRM)."""
    if kind == "tiny":
        kitchen = {
            "name": "trl-tiny",
            "seed": 0,
            "policy": {
                "path": "data/models/policy-tiny",
                "lora": {"r": 16, "alpha": 32, "dropout": 0.0},
            },
            "constitution": "constitutions/concierge.yaml",
            "rollout": {"k": 4, "max_turns": 6, "max_new_tokens": 40},
            "advantage": {"preset": "mapo", "overrides": {"beta": 0.02, "state_key": "abstract"}},
            "buffer": {"capacity": 20000, "max_age": 6, "dedup": True},
            "reward": {"reviewer": "judge", "local_mode": "mean"},
            "train": {"iterations": 30, "tasks_per_iteration": 4, "task_pool": 120, "lr": 5e-4},
            "eval_every": 0,
            "checkpoint_every": 10,
        }
        trl = {"output_dir": "runs/trl-tiny"}
    elif kind == "qwen0.5b":
        kitchen = {
            "name": "trl-qwen0.5b",
            "seed": 0,
            "policy": {
                "path": "Qwen/Qwen2.5-0.5B-Instruct",
                "dtype": "bfloat16",
                "gradient_checkpointing": True,
                "lora": {"r": 32, "alpha": 64, "dropout": 0.05},
            },
            "grm": {"model": "data/models/grm-tiny", "batch_size": 64},
            "constitution": "constitutions/concierge.yaml",
            "rollout": {"k": 8, "max_turns": 8, "max_new_tokens": 128, "batch_size": 64},
            "advantage": {
                "preset": "mapo",
                "overrides": {
                    "beta": 0.02,
                    "alpha": {"kind": "linear", "alpha0": 0.2, "alpha1": 0.5, "steps": 200},
                },
            },
            "buffer": {"capacity": 200000, "max_age": 8, "dedup": True},
            "reward": {"reviewer": "grm", "local_mode": "mean"},
            "train": {"iterations": 300, "tasks_per_iteration": 16, "task_pool": 2000, "lr": 1e-5},
            "eval_every": 0,
            "checkpoint_every": 25,
        }
        trl = {
            "output_dir": "runs/trl-qwen0.5b",
            "report_to": ["tensorboard"],
            "grpo": {"ds3_gather_for_generation": True},
        }
    else:
        raise ValueError(f"unknown TRL recipe {kind!r}: tiny or qwen0.5b")
    return {"kitchen": kitchen, "trl": trl}


def verl_config(*, nodes: int = 1, gpus_per_node: int = GPUS_PER_NODE) -> dict:
    """A verl 0.9 Hydra config (on top of verl's `ppo_trainer`) for MAPO on Qwen2.5-0.5B."""
    return {
        "hydra": {"searchpath": ["pkg://verl.trainer.config"]},
        "defaults": ["ppo_trainer", "_self_"],
        "data": {
            "train_files": "data/verl/train.parquet",
            "val_files": "data/verl/val.parquet",
            "train_batch_size": 64,
            "max_prompt_length": 512,
            "max_response_length": 2048,
            "return_raw_chat": True,
        },
        "actor_rollout_ref": {
            "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct", "enable_gradient_checkpointing": True},
            "actor": {
                "ppo_mini_batch_size": 64,
                "ppo_micro_batch_size_per_gpu": 8,
                "ppo_epochs": 1,
                "use_kl_loss": True,
                "kl_loss_coef": 0.02,
                "kl_loss_type": "low_var_kl",
                "loss_agg_mode": "token-mean",
                "optim": {"lr": 1e-6},
            },
            "ref": {"log_prob_micro_batch_size_per_gpu": 16},
            "rollout": {
                "name": "vllm",
                "n": 8,
                "gpu_memory_utilization": 0.5,
                "log_prob_micro_batch_size_per_gpu": 16,
                "tensor_model_parallel_size": 1,
                "multi_turn": {"enable": True, "max_assistant_turns": 8},
                "agent": {
                    "default_agent_loop": "kitchen_concierge",
                    "agent_loop_config_path": "recipes/scale/verl/agent_loops.yaml",
                },
            },
        },
        "algorithm": {
            "adv_estimator": "mapo",
            "use_kl_in_reward": False,
            "kitchen": {
                "advantage": {
                    "preset": "mapo",
                    "overrides": {
                        "alpha": {"kind": "linear", "alpha0": 0.2, "alpha1": 0.5, "steps": 200}
                    },
                },
                "buffer": {"capacity": 200000, "max_age": 8, "dedup": True},
            },
        },
        "reward": {"reward_manager": {"source": "register", "name": "kitchen_grm"}},
        "kitchen": {"reward": {"reviewer": "judge", "local_mode": "mean"}},
        "trainer": {
            "nnodes": nodes,
            "n_gpus_per_node": gpus_per_node,
            "total_epochs": 1,
            "total_training_steps": 300,
            "project_name": "kitchen",
            "experiment_name": "mapo-qwen0.5b",
            "logger": ["console"],
            "v1": {"trainer_mode": "kitchen_sync"},
        },
    }


AGENT_LOOPS = [
    {"name": "kitchen_concierge", "_target_": "kitchen.integrations.verl.ConciergeAgentLoop"}
]

_HEADER = "# Generated by kitchen.integrations.launch ({what}); regenerate, don't edit.\n"

RUN_VERL = """#!/usr/bin/env bash
# MAPO on verl 0.9 (Ray): Qwen2.5-0.5B-Instruct, concierge episodes, the kit's reward and advantage.
# Needs verl's GPU stack: pip install 'kitchen[verl]' 'verl[vllm]==0.9.1'
# Generated by kitchen.integrations.launch; regenerate, don't edit.
set -euo pipefail
cd "$(dirname "$0")/../../.."
# 1. the task pool of a kitchen recipe as verl parquet files (prompt, agent_name, extra_info)
python -m kitchen.integrations.verl data --recipe recipes/tiny_mapo.yaml --out data/verl
# 2. one node: ray starts itself. Several nodes: `ray start --head` on node 0,
#    `ray start --address NODE0_IP:6379` on the others, then run this on node 0 with
#    NNODES=<nodes>.
export VERL_USE_EXTERNAL_MODULES=kitchen.integrations.verl  # registers mapo, kitchen_grm, ...
python -m verl.trainer.main_ppo \\
  --config-path "$PWD/recipes/scale/verl" --config-name mapo_qwen0.5b \\
  trainer.nnodes="${NNODES:-1}" trainer.n_gpus_per_node="${GPUS_PER_NODE:-8}" "$@"
"""


def _yaml(data) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=100)


def files() -> dict[str, str]:
    """Every launch file, relative to `recipes/scale/`, with its text."""
    out: dict[str, str] = {}
    for backend in BACKENDS:
        out[f"accelerate/{backend}.yaml"] = _HEADER.format(
            what=f"{backend}, 1 node x {GPUS_PER_NODE} GPUs"
        ) + _yaml(accelerate_config(backend))
    for backend in ("zero3", "fsdp2"):
        out[f"accelerate/{backend}-2nodes.yaml"] = _HEADER.format(
            what=f"{backend}, 2 nodes x {GPUS_PER_NODE} GPUs; set main_process_ip"
        ) + _yaml(accelerate_config(backend, nodes=2))
    for kind in ("tiny", "qwen0.5b"):
        out[f"trl_{kind}.yaml"] = _HEADER.format(what=f"TRL recipe {kind}") + _yaml(
            trl_recipe(kind)
        )
    out["verl/mapo_qwen0.5b.yaml"] = _HEADER.format(what="verl config") + _yaml(verl_config())
    out["verl/agent_loops.yaml"] = _HEADER.format(what="verl agent loops") + _yaml(AGENT_LOOPS)
    out["verl/run_mapo.sh"] = RUN_VERL
    return out


def commands() -> dict[str, str]:
    """The launch command of each setup (what recipes/scale/README.md documents)."""
    acc = "accelerate launch --config_file recipes/scale/accelerate/{f}.yaml"
    run = "-m kitchen.integrations.trl --recipe recipes/scale/trl_qwen0.5b.yaml"
    return {
        "cpu (the tiny recipe)": "python -m kitchen.integrations.trl --recipe "
        "recipes/scale/trl_tiny.yaml",
        "cpu, 2 processes": "torchrun --nproc_per_node 2 -m kitchen.integrations.trl --recipe "
        "recipes/scale/trl_tiny.yaml",
        **{f"1 node, {b}": f"{acc.format(f=b)} {run}" for b in BACKENDS},
        **{
            f"2 nodes, {b} (on node R)": f"{acc.format(f=b + '-2nodes')} --machine_rank R "
            f"--main_process_ip NODE0_IP {run}"
            for b in ("zero3", "fsdp2")
        },
        "verl, 1 node": "bash recipes/scale/verl/run_mapo.sh",
        "verl, 2 nodes (after ray start)": "NNODES=2 bash recipes/scale/verl/run_mapo.sh",
    }


def write_files(folder: str | Path | None = None) -> list[Path]:
    """Write `files()` under `folder` (default: the kit's recipes/scale/); returns the paths."""
    root = Path(folder) if folder else paths.HOME / "recipes" / "scale"
    written = []
    for rel, text in files().items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        if p.suffix == ".sh":
            p.chmod(0o755)
        written.append(p)
    return written
