"""Dry-run a job at its real world size on one CPU: ``make dry-run JOB=<job> [PROFILE=full]``.

    python -m shared.planner.dryrun --job tp2d --profile full
    python -m shared.planner.dryrun --job tp2d model=llama-7b dp=8 tp=8 num_workers=64

One process plays rank 0 of the job's world (``num_workers``) on PyTorch's fake process group
(``FakeStore``, backend ``fake``): collectives move nothing, so nothing is allocated at real
size. It runs the job's own code path where that is possible without memory:

* the job's config (profile + overrides, validated as the job validates them: a TP size that
  does not divide the heads fails here, with the job's own sentence);
* the job's model builder on the ``meta`` device, then the job's wrapping (``apply_tp`` on the
  (dp, tp) mesh, ``apply_fsdp`` per block and root; ``apply_ddp``, with the constructor's
  cross-rank shape check skipped: it reads values, which meta tensors refuse, and the fake
  group has no other ranks to compare with); the parameter bytes are read from each rank's
  local shards, DDP's gradient buckets from its reducer;
* the job's optimizer (``shared.optim.build_adamw``) takes one step on meta gradients of the
  same layout, so the optimizer state is what AdamW really allocates;
* activations: one real transformer block (TP-sharded for tp2d) runs forward on the CPU at the
  real sequence length and hidden size with micro-batch 1 and 2, and the bytes it keeps for the
  backward (``shared.planner.measure``) are extrapolated to the micro-batch (they are linear in
  it) and multiplied by the layers; the output layer and loss come from the planner formula.
  Its matmuls' outputs are allocated, not computed: the bytes do not depend on the values, and
  bf16 matmuls on a CPU without bf16 units took minutes (a 7B block: 47 s, now 12 s).

FSDP refuses a forward with meta parameters and ``FakeTensorMode`` breaks ``fully_shard`` on
TP-sharded parameters (STACK-FACTS), hence the block-wise route. For the ZeRO job nothing is
traced: DeepSpeed's own offline estimator (``estimate_zero2/3_model_states_mem_needs``) and the
planner are printed side by side, and the table says so. The other framework buffers
(FSDP's gathered blocks, TP's reduce buckets) are the planner's. The verdict compares the
per-rank total with the GPU of the job's compute config (job.yaml) minus 10% headroom; not
fitting exits 1.
"""

from shared.planner.dryrun.jobs import compute_config
from shared.planner.dryrun.report import dry_run, main

__all__ = ["compute_config", "dry_run", "main"]
