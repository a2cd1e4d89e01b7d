"""Beyond one GPU: the kit's reward and advantage inside existing distributed engines.

docs/method.md#scaling: the kit grows no distributed runtime of its own. When a run outgrows one GPU, the
same recipe — constitution, personalisation, GRM review, local and global rewards, the MAPO
advantage preset — moves to an engine that already shards models and batches:

- `kitchen.integrations.trl` — TRL's `GRPOTrainer` (accelerate: DDP, DeepSpeed ZeRO, FSDP).
  The GRM review is a TRL reward function, multi-turn concierge episodes come from TRL's
  `rollout_func` hook, and `MAPOTrainer` (a small `GRPOTrainer` subclass) replaces the
  trajectory-level GRPO advantage with kitchen's per-turn MAPO advantage.
  `python -m kitchen.integrations.trl --recipe recipes/scale/trl_tiny.yaml`.
- `kitchen.integrations.verl` — verl (Ray): MAPO registered as a verl advantage estimator
  (`register_adv_est("mapo")`) and the review as a verl reward manager (`kitchen_grm`), with
  the per-turn rewards laid out at turn boundaries of verl's token-level rewards. Optional:
  `pip install 'kitchen[verl]'`.
- `kitchen.integrations.episodes` — what both engines see of a concierge episode: the job pool,
  the first prompt, and an episode as one token row (prompt, completion, policy-token mask,
  turn spans).
- `kitchen.integrations.launch` — the `accelerate launch` configs (DeepSpeed ZeRO-2/3, FSDP2;
  several GPUs, several nodes) and the verl launch files, generated from a few parameters;
  the copies shipped in `recipes/scale/` are these functions' output (a test keeps them equal).

Nothing here is imported by the core kit: `import kitchen` works without verl, and TRL is
imported only when this package's TRL module is.

Departures from the kit's own loop (details in each module):
1. Both engines train on one row per episode (prompt, then every turn with the environment's
   replies masked out), the kit on one row per turn; the advantages are equal, the loss
   aggregation only for token-mean.
2. verl's estimator sees only token-level rewards: per-turn rewards and state keys reach MAPO
   only through the kit's small trainer subclass; with verl's stock trainers MAPO keeps its
   global term alone.
"""
