"""Where a run's start-up goes, second by second: SUMMARY's ``startup_s``.

Marks are wall-clock times (``time.time()``: one clock for the driver and the workers of a
node, NTP-close across nodes). The driver's marks travel to the workers inside the config;
rank 0 adds its own and reports the phase between each mark and the one before it in time,
named after the mark that ends it. A run without some marks (torchrun has no cluster start
and prepares its data after its processes start) still adds up to its time to first step.
"""

from __future__ import annotations

import itertools
import time

# (mark, the phase that ends at it), in the order a Ray Train run passes them.
PHASES = (
    ("launch", None),  # the driver parsed its settings (cfg.driver_start_time)
    ("cluster_ready", "cluster_start"),  # preflight checks, local Ray cluster start or attach
    ("data_ready", "data_preparation"),  # pack the dataset, or find it cached
    ("fit_start", "driver_setup"),  # trainer construction
    ("worker_start", "worker_group_start"),  # Train controller, worker actors, process group
    ("model_ready", "model_build"),  # model, strategy wrap, checkpoint or init_from load
    ("first_batch", "first_batch"),  # the data pipeline's first micro-batch on this rank
    ("first_step", "first_step"),  # forward, backward, optimizer step of step 1
)
KNOWN_MARKS = tuple(mark for mark, _ in PHASES)


def mark(cfg, name: str) -> None:
    """Record a driver-side mark in the config (the workers receive it with the config)."""
    assert name in KNOWN_MARKS, name
    cfg.startup_marks = {**cfg.startup_marks, name: time.time()}


def breakdown(marks: dict[str, float | None]) -> dict[str, float]:
    """Seconds per phase between consecutive marks (in time), plus their ``total``."""
    ends = dict(PHASES)
    present = sorted((at, name) for name, at in marks.items() if at is not None)
    phases = {ends[name] or name: round(at - before, 3)
              for (before, _), (at, name) in itertools.pairwise(present)}  # fmt: skip
    if phases:
        phases["total"] = round(present[-1][0] - present[0][0], 3)
    return phases
