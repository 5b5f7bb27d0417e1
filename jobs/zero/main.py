"""GPT-2 on AG News with Ray Train + DeepSpeed ZeRO stages 1/2/3 and CPU offload.

ZeRO removes DDP's redundancy one piece at a time: stage 1 partitions the optimizer states
across the N workers, stage 2 also the gradients, stage 3 also the parameters. Offload moves
partitions to CPU memory when even 1/N does not fit on the device.

    make run-local JOB=zero                               # smoke: ZeRO-3, 2 CPU workers
    make run-local JOB=zero ARGS="zero_stage=1"           # or 2; offload_optimizer=true ...
    make run-local JOB=zero PROFILE=full                  # GPT-2 124M on 4 GPUs, bf16
"""

from __future__ import annotations

from shared.config import ZeroConfig, parse_args
from shared.config.profiles import GPT2_AG_NEWS
from shared.loop import train
from shared.parallel.zero import ZeroStrategy
from shared.precision import DTYPE_NAMES, resolve_dtype
from shared.runtime.driver import train_on_text
from shared.runtime.worker import start_gpt2_worker

PROFILES = {name: {**profile, "zero_stage": 3} for name, profile in GPT2_AG_NEWS.items()}


def train_loop_per_worker(config: dict) -> None:
    cfg, session, model = start_gpt2_worker(config)
    # bf16 where the hardware has it natively; fp16 with DeepSpeed's dynamic loss scaling on
    # GPUs with fp16 units only (T4); fp32 otherwise (DeepSpeed refuses fp16 on CPU).
    dtype = resolve_dtype(cfg.dtype, session.device, fp16_loss_scaling=True)
    # The strategy: deepspeed.initialize builds the ZeRO engine from the config dict, inside
    # the gloo/NCCL process group Ray Train already created.
    strategy = ZeroStrategy(model, cfg, session.device, dtype)
    if session.rank == 0:
        print(f"DeepSpeed ZeRO stage {cfg.zero_stage} in {DTYPE_NAMES[dtype]}: "
              f"{strategy.ds_config['zero_optimization']}", flush=True)  # fmt: skip
    train(cfg, strategy, session)


def main() -> None:
    cfg = parse_args("zero", ZeroConfig, PROFILES, description=__doc__)
    train_on_text(cfg, train_loop_per_worker)


if __name__ == "__main__":
    main()
