"""GPT-2 on AG News with Ray Data + Ray Train DDP.

Data parallelism in one picture: every worker holds a full copy of the model, trains on its
own shard of each batch, and DDP all-reduces the gradients so every copy takes the same step.

    make run-local JOB=ddp                      # smoke: tiny GPT-2, generated news, 2 CPU workers
    make run-local JOB=ddp PROFILE=full         # GPT-2 124M from the hub on AG News
    python jobs/ddp/main.py num_workers=4 lr=6e-4 grad_accum=4
"""

from __future__ import annotations

import ray.train.torch

from shared.config import TrainConfig, parse_args
from shared.config.profiles import GPT2_AG_NEWS
from shared.loop import train
from shared.parallel.ddp import DDPStrategy
from shared.precision import resolve_dtype
from shared.runtime.driver import train_on_text
from shared.runtime.worker import start_gpt2_worker

PROFILES = GPT2_AG_NEWS  # shared with fsdp and zero: same model, same data


def train_loop_per_worker(config: dict) -> None:
    """Runs on every worker. Ray Train has already created the process group (gloo on CPU,
    NCCL on GPU) and set the device."""
    cfg, session, model = start_gpt2_worker(config)
    # The strategy: move to this worker's device and wrap in DistributedDataParallel.
    model = ray.train.torch.prepare_model(model)
    strategy = DDPStrategy(model, cfg, session.device, resolve_dtype(cfg.dtype, session.device))
    train(cfg, strategy, session)


def main() -> None:
    cfg = parse_args("ddp", TrainConfig, PROFILES, description=__doc__)
    # Driver: generated or hub data -> Ray Data pipeline -> TorchTrainer.fit() -> SUMMARY line.
    train_on_text(cfg, train_loop_per_worker)


if __name__ == "__main__":
    main()
