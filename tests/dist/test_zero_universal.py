"""A ZeRO checkpoint resumed on another number of ranks (shared/parallel/zero.py): through
DeepSpeed's universal format, on real gloo process groups, against the uninterrupted run.

Global batch 8 every step: 2 ranks x 4 sequences, or 1 rank x 4 sequences x 2 micro-batches.
The uninterrupted run checkpoints after step 2 and trains to step 4; each resume loads that
checkpoint and trains steps 3-4 on the same sequences."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared.config import ZeroConfig
from shared.models.gpt2 import build_gpt2
from shared.parallel import zero
from shared.runtime.worker import seed_everything

VOCAB, SEQ, MICRO, GLOBAL = 512, 32, 4, 8
STEPS, SAVED_AT = 4, 2


def global_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (GLOBAL, SEQ), generator=torch.Generator().manual_seed(step))


def strategy_for(world: int, stage: int) -> zero.ZeroStrategy:
    seed_everything(0)
    model = build_gpt2("gpt2-tiny", VOCAB, SEQ)
    cfg = ZeroConfig(zero_stage=stage, micro_batch_size=MICRO, grad_accum=GLOBAL // MICRO // world,
                     num_workers=world, max_steps=10, warmup_steps=2)  # fmt: skip
    return zero.ZeroStrategy(model, cfg, torch.device("cpu"), torch.float32)


def train_steps(strategy, rank: int, world: int, steps) -> None:
    for step in steps:
        micro_batches = global_batch(step).split(MICRO)[rank::world]
        for n, micro in enumerate(micro_batches, start=1):
            strategy.forward_backward(micro, sync=n == len(micro_batches))
        strategy.optimizer_step()


def full_weights(strategy) -> dict[str, torch.Tensor]:
    import deepspeed

    weights = {}
    for name, param in strategy.model.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):  # a no-op below stage 3
            weights[name] = param.detach().clone()
    return weights


def _worker(rank, world, stage, how, out_dir, init_file):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))  # DeepSpeed's
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        strategy = strategy_for(world, stage)
        checkpoint = os.path.join(out_dir, "checkpoint")
        if how == "uninterrupted":
            train_steps(strategy, rank, world, range(SAVED_AT))
            strategy.save(checkpoint, rank)
            at_checkpoint = full_weights(strategy)
            if rank == 0:
                torch.save(at_checkpoint, os.path.join(out_dir, "at-checkpoint.pt"))
            train_steps(strategy, rank, world, range(SAVED_AT, STEPS))
        elif how == "universal":  # forced, at the same world size: must change nothing
            engine_dir = os.path.join(checkpoint, zero.ENGINE_TAG)
            with zero.universal_checkpoint(engine_dir) as (parent, tag):
                strategy._load_universal(parent, tag)
            train_steps(strategy, rank, world, range(SAVED_AT, STEPS))
        else:  # "resume": what a restarted run does, whatever the world size
            strategy.load(checkpoint)
            train_steps(strategy, rank, world, range(SAVED_AT, STEPS))
        weights = full_weights(strategy)
        if rank == 0:
            torch.save(weights, os.path.join(out_dir, f"{how}-{world}.pt"))
    finally:
        dist.destroy_process_group()


def run(world: int, stage: int, how: str, out_dir) -> dict[str, torch.Tensor]:
    init_file = out_dir / f"init-{how}-{world}"
    mp.spawn(_worker, args=(world, stage, how, str(out_dir), str(init_file)), nprocs=world)
    return torch.load(out_dir / f"{how}-{world}.pt")


@pytest.mark.parametrize("stage", [3, 2])
def test_a_zero_checkpoint_resumes_on_another_number_of_ranks(stage, tmp_path):
    uninterrupted = run(2, stage, "uninterrupted", tmp_path)
    assert zero.saved_world_size(str(tmp_path / "checkpoint" / zero.ENGINE_TAG)) == 2

    # DeepSpeed's universal load, repaired (two defects: every param group got the first's
    # weight decay; all groups shared one AdamW step counter): bitwise what the regular
    # load gives, which is the uninterrupted run.
    universal = run(2, stage, "universal", tmp_path)
    assert all(torch.equal(universal[k], uninterrupted[k]) for k in uninterrupted)

    # On one rank (2 micro-batches per step): the same samples per step, summed in another
    # order, so equal up to fp32 rounding.
    one = run(1, stage, "resume", tmp_path)
    for name in uninterrupted:
        torch.testing.assert_close(one[name], uninterrupted[name], rtol=1e-5, atol=1e-6)
    # The steps after the checkpoint moved every weight (the comparisons are not vacuous).
    at_checkpoint = torch.load(tmp_path / "at-checkpoint.pt")
    assert all(not torch.equal(one[k], at_checkpoint[k]) for k in at_checkpoint)
