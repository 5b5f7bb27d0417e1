"""TensorBoard event files for a run, written by rank 0 under ``<run_dir>/tensorboard/``.

``make tensorboard`` (or ``tensorboard --logdir runs``) shows every run side by side; each run
is one folder, and a resumed run appends a new event file to the same folder.
"""

from __future__ import annotations

import os

# metrics.jsonl key -> TensorBoard tag. Grouped by prefix: TensorBoard draws one section each.
STEP_SCALARS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
    "mfu": "throughput/mfu",
    "step_time_s": "time/step_time_s",
    "data_wait_s": "time/data_wait_s",
    "data_wait_fraction": "time/data_wait_fraction",  # data wait / step time: input-bound share
}


def tensorboard_dir(run_dir: str) -> str | None:
    """Only for a filesystem run dir (local or NFS), like metrics.jsonl."""
    return None if "://" in run_dir else os.path.join(run_dir, "tensorboard")


class TensorBoardLog:
    """One scalar per metric per optimizer step, plus memory (bytes) as it is known."""

    def __init__(self, logdir: str):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: rank 0 only

        # flush_secs: a run is watched live; the default (120 s) is longer than a smoke run.
        self.writer = SummaryWriter(logdir, flush_secs=10)

    def add_step(self, row: dict, memory_bytes: dict[str, int]) -> None:
        step = row["step"]
        for key, tag in STEP_SCALARS.items():
            if isinstance(row.get(key), int | float):
                self.writer.add_scalar(tag, row[key], step)
        for name, value in memory_bytes.items():
            self.writer.add_scalar(f"memory/{name}_bytes", value, step)

    def close(self) -> None:
        self.writer.close()
