"""Elastic batch sizes: the same global batch at every world size a run may get.

With ``ScalingConfig(num_workers=(min, max))`` Ray Train may start or restart the worker group
at any size in the range. A step must mean the same at every size (same sequences, same LR
schedule), so each size gets its own micro-batch x grad_accum with
``micro_batch x grad_accum x world_size == global_batch`` and the micro-batch no larger than
configured (the memory budget). A size where no such pair exists is refused before the
cluster starts, not discovered when an attempt at that size fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchShape:
    micro_batch_size: int  # sequences per rank per forward/backward
    grad_accum: int  # micro-batches per optimizer step


def batch_shape(global_batch: int, world_size: int, max_micro_batch: int) -> BatchShape | None:
    """The largest micro-batch (fewest accumulation steps) that keeps ``global_batch`` on
    ``world_size`` ranks, or None if ``global_batch`` does not split over that many ranks."""
    if global_batch % world_size:
        return None
    per_rank = global_batch // world_size
    micro = max(m for m in range(1, min(max_micro_batch, per_rank) + 1) if per_rank % m == 0)
    return BatchShape(micro, per_rank // micro)


def batch_table(
    global_batch: int, min_workers: int, num_workers: int, max_micro_batch: int
) -> dict[int, BatchShape | None]:
    """World size -> its batch shape (None where it cannot keep the global batch)."""
    return {w: batch_shape(global_batch, w, max_micro_batch)
            for w in range(min_workers, num_workers + 1)}  # fmt: skip


def refusal(
    global_batch: int, min_workers: int, num_workers: int, max_micro_batch: int
) -> str | None:
    """One sentence naming the first world size that cannot keep the global batch, with a
    global batch that works for the whole range; None if every size works."""
    table = batch_table(global_batch, min_workers, num_workers, max_micro_batch)
    bad = [w for w, shape in table.items() if shape is None]
    if not bad:
        return None
    every = math.lcm(*range(min_workers, num_workers + 1))
    fits = every * math.ceil(global_batch / every)
    micro = batch_shape(fits, num_workers, max_micro_batch)
    return (
        f"elastic world size {bad[0]} (min_workers={min_workers}..num_workers={num_workers}) "
        f"cannot keep the global batch of {global_batch} sequences ({global_batch} is not a "
        f"multiple of {bad[0]}); use a global batch divisible by every size in the range, "
        f"for example {fits} = micro_batch_size={micro.micro_batch_size} x "
        f"grad_accum={micro.grad_accum} x num_workers={num_workers}, or set "
        "keep_global_batch=false."
    )
