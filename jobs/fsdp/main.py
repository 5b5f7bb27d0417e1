"""GPT-2 on AG News with Ray Train + PyTorch FSDP2 and sharded (DCP) checkpoints.

When the model no longer fits one device, keep the data-parallel axis but shard the state:
each of N workers holds 1/N of every parameter, gradient and Adam state, and gathers a
block's full parameters only while it computes that block.

    make run-local JOB=fsdp                                   # smoke: 2 CPU workers
    make run-local JOB=fsdp ARGS="cpu_offload=true activation_checkpointing=true"
    make run-local JOB=fsdp PROFILE=full                      # GPT-2 124M on 4 GPUs
"""

from __future__ import annotations

from shared.config import FSDPConfig, parse_args
from shared.config.profiles import GPT2_AG_NEWS
from shared.loop import train
from shared.parallel.fsdp import FSDPStrategy, apply_fsdp, data_parallel_mesh
from shared.precision import DTYPE_NAMES, resolve_dtype
from shared.runtime.driver import train_on_text
from shared.runtime.worker import start_gpt2_worker

PROFILES = GPT2_AG_NEWS  # the same model and data as ddp, so the two compare step for step


def train_loop_per_worker(config: dict) -> None:
    cfg, session, model = start_gpt2_worker(config)
    model = model.to(session.device)  # FSDP shards what is already on the device
    # bf16 where the hardware has it (decided here, at run time), fp32 otherwise.
    param_dtype = resolve_dtype(cfg.dtype, session.device)
    reduce_dtype = resolve_dtype(cfg.reduce_dtype, session.device)
    if session.rank == 0:
        print(f"FSDP2 mixed precision: params {DTYPE_NAMES[param_dtype]}, "
              f"gradient reduce {DTYPE_NAMES[reduce_dtype]}", flush=True)  # fmt: skip
    # The strategy: shard every block (or group of blocks), then the root, over the dp mesh.
    model = apply_fsdp(
        model,
        data_parallel_mesh(session.device),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reshard_after_forward=cfg.reshard_after_forward,
        cpu_offload=cfg.cpu_offload,
        blocks_per_group=cfg.blocks_per_group,
        activation_checkpointing=cfg.activation_checkpointing,
    )
    train(cfg, FSDPStrategy(model, cfg, session.device, param_dtype), session)


def main() -> None:
    cfg = parse_args("fsdp", FSDPConfig, PROFILES, description=__doc__)
    train_on_text(cfg, train_loop_per_worker)


if __name__ == "__main__":
    main()
