"""What rank 0 writes besides metrics.jsonl (docs/observability.md): TensorBoard scalars every
step, and at the end the loss-curve PNG and Ray Data's statistics."""

from __future__ import annotations

import os
import sys
import tempfile

from shared import storage
from shared.observability.metrics import StepMetrics, peak_memory_bytes, read_metrics
from shared.observability.tensorboard_log import TensorBoardLog, tensorboard_dir
from shared.parallel.base import Strategy

LOSS_CURVE_FILE = "loss_curve.png"
DATA_STATS_FILE = "data_stats.txt"


class RankZeroOutputs:
    """What rank 0 writes besides metrics.jsonl: TensorBoard scalars every step, and at the
    end the loss-curve PNG and the data pipeline's stats. Other ranks get a no-op."""

    def __init__(self, cfg, strategy: Strategy, session):  # session: shared.loop.Session
        self.cfg, self.strategy, self.session = cfg, strategy, session
        self.active = session.rank == 0
        logdir = tensorboard_dir(cfg.run_dir) if cfg.tensorboard else None
        self.tensorboard = TensorBoardLog(logdir) if self.active and logdir else None

    def step(self, row: dict) -> None:
        if self.tensorboard is not None:
            memory = {**peak_memory_bytes(self.session.device),
                      **(self.strategy.measured_state_bytes or {})}  # fmt: skip
            self.tensorboard.add_step(row, memory)

    def finish(self, tracker: StepMetrics) -> None:
        if not self.active:
            return
        if self.tensorboard is not None:
            self.tensorboard.close()
        # Observability must not fail a run that trained: say what could not be written.
        for what, write in (("loss curve", self._loss_curve), ("data stats", self._data_stats)):
            try:
                write(tracker)
            except Exception as err:  # noqa: BLE001
                print(f"warning: no {what}: {type(err).__name__}: {err}", file=sys.stderr,
                      flush=True)  # fmt: skip

    def _loss_curve(self, tracker: StepMetrics) -> None:
        if tracker.path is None or not storage.exists(tracker.path):
            return
        from shared.observability.plots import (
            save_run_plots,  # matplotlib: imported only where it draws
        )

        rows = read_metrics(tracker.path)
        title = f"{self.cfg.job} {self.cfg.run_name}"
        if not storage.is_remote(self.cfg.run_dir):
            path = os.path.join(storage.local_path(self.cfg.run_dir), LOSS_CURVE_FILE)
            save_run_plots(rows, path, title=title)
        else:  # draw locally, then one PUT
            path = storage.join(self.cfg.run_dir, LOSS_CURVE_FILE)
            with tempfile.TemporaryDirectory() as tmp:
                local = os.path.join(tmp, LOSS_CURVE_FILE)
                save_run_plots(rows, local, title=title)
                with open(local, "rb") as f:
                    storage.write_bytes(path, f.read())
        print(f"loss curve: {path}", flush=True)

    def _data_stats(self, tracker: StepMetrics) -> None:
        """Ray Data's full statistics (~60 lines) go to a file; the log gets a pointer, or
        the whole text with ``verbose=true``."""
        stats = getattr(self.session, "data_stats", lambda: None)()
        if not stats:
            return
        path = storage.join(self.cfg.run_dir, DATA_STATS_FILE)
        storage.write_text(path, stats)
        if getattr(self.cfg, "verbose", False):
            print(f"== data pipeline (Ray Data stats of rank 0's shard)\n{stats}", flush=True)
        else:
            print(f"data pipeline stats: {path}", flush=True)
