"""Fault tolerance: a worker dies mid-epoch, Ray Train restarts the group, training resumes
from the last checkpoint on exactly the samples it had not yet trained on.

    make run-local JOB=fault_tolerance                          # rank 1 dies at step 13; recovers
    make run-local JOB=fault_tolerance ARGS="fail_mode=sigkill fail_at_step=11"
    make run-local JOB=fault_tolerance ARGS="fail_at_step=0"    # no failure: the reference run

What makes the resumed run identical to an uninterrupted one (see README.md):
  * checkpoints every N steps with model, optimizer, LR schedule, step, epoch, every rank's
    RNG and the data position (samples consumed in the epoch);
  * a data order that does not depend on the world size (shared/data/order.py), so the rest
    of the epoch can be re-dealt to however many workers come back;
  * the same global batch at any world size (grad_accum adjusts), so a step means the same.
"""

from __future__ import annotations

import dataclasses
import json
import os

import ray.train
import ray.train.torch

from shared import storage
from shared.checkpoint import TRAIN_STATE_FILE
from shared.config import FaultToleranceConfig, parse_args
from shared.config.profiles import GPT2_AG_NEWS
from shared.loop import train
from shared.models.gpt2 import build_gpt2
from shared.parallel.ddp import DDPStrategy
from shared.parallel.fsdp import FSDPStrategy, apply_fsdp, data_parallel_mesh
from shared.precision import resolve_dtype
from shared.runtime import elastic
from shared.runtime.driver import JobRun, train_on_text
from shared.runtime.faults import FailureInjector, FaultInjectingStrategy
from shared.runtime.worker import RaySession, seed_everything

ATTEMPTS_FILE = "attempts.jsonl"

PROFILES = {
    # One epoch is ~20 steps; rank 1 dies after step 13's update, 3 steps after the step-10
    # checkpoint, so 3 steps are redone and the rest of epoch 0 is re-dealt.
    "smoke": {
        **GPT2_AG_NEWS["smoke"],
        "checkpoint_every": 5,
        "fail_at_step": 13,
        "max_failures": 2,
    },
    "full": {**GPT2_AG_NEWS["full"], "checkpoint_every": 200, "max_failures": 5},
}


def for_this_world(
    cfg: FaultToleranceConfig, world_size: int, global_batch: int
) -> FaultToleranceConfig:
    """The config for the worker group Ray actually started (elastic: any size in range),
    keeping ``global_batch`` sequences per step (the checkpoint's, when resuming)."""
    if not cfg.keep_global_batch:
        if world_size == cfg.num_workers:
            return cfg
        now = cfg.micro_batch_size * cfg.grad_accum * world_size
        print(f"world size {world_size} (configured {cfg.num_workers}): keeping the per-worker "
              f"batch; the global batch is now {now} sequences (consider scaling the learning "
              "rate)", flush=True)  # fmt: skip
        return dataclasses.replace(cfg, num_workers=world_size)
    shape = elastic.batch_shape(global_batch, world_size, cfg.micro_batch_size)
    if shape is None:  # only a checkpoint's batch can get here: the config was checked
        raise ValueError(f"global batch {global_batch} is not a multiple of {world_size} workers")
    if (world_size, shape.grad_accum) != (cfg.num_workers, cfg.grad_accum):
        micro = (f" and micro_batch_size={shape.micro_batch_size}"
                 if shape.micro_batch_size != cfg.micro_batch_size else "")  # fmt: skip
        print(f"world size {world_size} (configured {cfg.num_workers}): keeping the global batch "
              f"at {global_batch} sequences with grad_accum={shape.grad_accum}{micro}",
              flush=True)  # fmt: skip
    return dataclasses.replace(cfg, num_workers=world_size, grad_accum=shape.grad_accum,
                               micro_batch_size=shape.micro_batch_size)  # fmt: skip


def saved_global_batch(session) -> int | None:
    """The global batch size the latest checkpoint was trained with, if there is one."""
    with session.latest_checkpoint() as directory:
        if directory is None:
            return None
        with open(os.path.join(directory, TRAIN_STATE_FILE)) as f:
            return json.load(f).get("global_batch_size") or None


def train_loop_per_worker(config: dict) -> None:
    cfg: FaultToleranceConfig = config["cfg"]
    session = RaySession(cfg, config["packed"])
    # Elastic or resized: the same global batch as the checkpoint (or as configured).
    cfg = for_this_world(
        cfg, session.world_size, saved_global_batch(session) or cfg.global_batch_size
    )
    session.cfg = cfg
    session.use_batch_size(cfg.micro_batch_size)
    injector = FailureInjector(cfg, session.rank)
    if session.rank == 0:
        # One line per worker-group start: small enough to rewrite on object storage.
        storage.append_text(storage.join(cfg.run_dir, ATTEMPTS_FILE),
                            json.dumps({"attempt": session.attempt,
                                        "driver": cfg.driver_start_time,
                                        "world_size": session.world_size}) + "\n")  # fmt: skip
        if injector.fired():
            print(f"worker group restarted by Ray Train after {injector.fired()} injected "
                  "failure(s); resuming from the latest checkpoint", flush=True)  # fmt: skip

    seed_everything(cfg.seed)
    model = build_gpt2(
        cfg.model, config["vocab_size"], cfg.seq_len, cfg.pretrained, config["eos_token_id"]
    )
    dtype = resolve_dtype(cfg.dtype, session.device)
    if cfg.strategy == "fsdp":  # sharded state: every rank writes DCP shards
        model = apply_fsdp(model.to(session.device), data_parallel_mesh(session.device))
        strategy = FSDPStrategy(model, cfg, session.device, dtype)
    else:
        model = ray.train.torch.prepare_model(model)
        strategy = DDPStrategy(model, cfg, session.device, dtype)
    train(cfg, FaultInjectingStrategy(strategy, injector, cfg.sleep_per_step), session)


def failures_recovered(cfg: FaultToleranceConfig) -> dict:
    """Worker-group restarts during this driver's run (each attempt logs one line)."""
    path = storage.join(cfg.run_dir, ATTEMPTS_FILE)
    if not storage.exists(path):
        return {"failures_recovered": 0}
    attempts = [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]
    mine = [a for a in attempts if a["driver"] == cfg.driver_start_time]
    return {"failures_recovered": max(0, len(mine) - 1), "attempts": len(mine)}


def main() -> None:
    cfg = parse_args("fault_tolerance", FaultToleranceConfig, PROFILES, description=__doc__)
    run = JobRun(cfg, summary_hook=lambda: failures_recovered(cfg))
    # Every worker reads only its slice of each global batch of the epoch's order, which does
    # not depend on the world size: the rest of an epoch can go to any number of workers.
    train_on_text(cfg, train_loop_per_worker, run=run)


if __name__ == "__main__":
    main()
