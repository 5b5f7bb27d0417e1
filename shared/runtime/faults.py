"""Failure injection for testing recovery: make one rank die at a chosen step.

One-shot by default: before dying, the failing rank writes a marker file into the run
directory (local or object storage, through :mod:`shared.storage`), so the restarted attempt
(which replays the same steps) does not fail again.
``fail_times=N`` lets N attempts fail, to exhaust ``max_failures``.
"""

from __future__ import annotations

import os
import signal
import time

from shared import storage
from shared.parallel.base import Strategy


class InjectedFailure(RuntimeError):
    """Raised by fail_mode=raise."""


class FailureInjector:
    def __init__(self, cfg, rank: int):
        self.cfg = cfg
        self.rank = rank
        self.marker_dir = storage.join(cfg.run_dir, "injected_failures")

    def fired(self) -> int:
        return len([n for n in storage.listdir(self.marker_dir) if not n.startswith(".")])

    def maybe_fail(self, step: int, during_checkpoint: bool) -> None:
        cfg = self.cfg
        if (
            cfg.fail_at_step != step
            or cfg.fail_during_checkpoint != during_checkpoint
            or self.rank != cfg.fail_rank
            or self.fired() >= cfg.fail_times
        ):
            return
        n = self.fired() + 1
        # Complete on storage before the process dies (a whole-file write or one PUT).
        storage.write_text(storage.join(self.marker_dir, f"{n}"),
                           f"rank {self.rank} step {step} mode {cfg.fail_mode}\n")  # fmt: skip
        where = "while writing its checkpoint" if during_checkpoint else "after its update"
        print(f"FAULT INJECTION {n}/{cfg.fail_times}: rank {self.rank} dies at step {step} "
              f"{where} (fail_mode={cfg.fail_mode})", flush=True)  # fmt: skip
        time.sleep(0.2)  # let the line reach the driver's log
        if cfg.fail_mode == "exit":
            os._exit(1)
        if cfg.fail_mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise InjectedFailure(f"injected failure on rank {self.rank} at step {step}")


class FaultInjectingStrategy:
    """Wraps a Strategy; dies where the injector says. Everything else is delegated."""

    def __init__(self, strategy: Strategy, injector: FailureInjector, sleep_per_step: float = 0.0):
        self._strategy = strategy
        self._injector = injector
        self._sleep = sleep_per_step

    def __getattr__(self, name):
        return getattr(self._strategy, name)

    def optimizer_step(self):
        grad_norm = self._strategy.optimizer_step()
        step = self._strategy.scheduler.last_epoch  # steps taken so far, restored on resume
        if self._sleep:
            time.sleep(self._sleep)
        self._injector.maybe_fail(step, during_checkpoint=False)
        return grad_norm

    def save(self, directory: str, rank: int) -> None:
        self._strategy.save(directory, rank)  # a complete model file, then die before the rest
        self._injector.maybe_fail(self._strategy.scheduler.last_epoch, during_checkpoint=True)
