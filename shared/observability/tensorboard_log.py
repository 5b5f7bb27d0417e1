"""TensorBoard event files for a run, written by rank 0 under ``<run_dir>/tensorboard/``
(on object storage: written on the node, uploaded at the end; see :class:`TensorBoardLog`).

``make tensorboard`` (or ``tensorboard --logdir runs``) shows every run side by side; each run
is one folder, and a resumed run appends a new event file to the same folder.
"""

from __future__ import annotations

import sys

from shared import storage

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
    "eval_loss": "eval/loss",  # held-out, on evaluation steps only (shared/evaluation.py)
    "eval_ppl": "eval/perplexity",
}


def tensorboard_dir(run_dir: str) -> str:
    """``<run_dir>/tensorboard`` (local, NFS or object storage)."""
    return storage.join(run_dir, "tensorboard")


class TensorBoardLog:
    """One scalar per metric per optimizer step, plus memory (bytes) as it is known.

    For a run on object storage the event file is written on this node's disk (the writer
    appends to it, which object stores cannot do) and uploaded when the log is closed, at the
    end of the run: watch a live run on the node, or the uploaded events afterwards."""

    def __init__(self, logdir: str):
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: rank 0 only

        self.logdir = logdir
        self.local_dir = storage.node_local_dir(logdir)
        if storage.is_remote(logdir):
            print(f"TensorBoard events: written to {self.local_dir} on this node, uploaded to "
                  f"{logdir} at the end of the run", flush=True)  # fmt: skip
        # flush_secs: a run is watched live; the default (120 s) is longer than a smoke run.
        self.writer = SummaryWriter(self.local_dir, flush_secs=10)

    def add_step(self, row: dict, memory_bytes: dict[str, int]) -> None:
        step = row["step"]
        for key, tag in STEP_SCALARS.items():
            if isinstance(row.get(key), int | float):
                self.writer.add_scalar(tag, row[key], step)
        for name, value in memory_bytes.items():
            self.writer.add_scalar(f"memory/{name}_bytes", value, step)

    def close(self) -> None:
        self.writer.close()
        if storage.is_remote(self.logdir):
            try:
                storage.upload_dir(self.local_dir, self.logdir)
            except OSError as err:  # observability must not fail a run that trained
                print(f"warning: TensorBoard events stay in {self.local_dir}: could not upload "
                      f"them to {self.logdir}: {err}", file=sys.stderr, flush=True)  # fmt: skip
