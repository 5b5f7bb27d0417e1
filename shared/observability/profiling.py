"""Named trace ranges and the per-rank torch profiler for ``profile_steps=a-b``.

Every step of the shared loop is cut into the same named ranges, so a trace of any strategy
reads the same way (open ``<run_dir>/profile/rank<r>.json`` in https://ui.perfetto.dev):

    train_step#N      one optimizer step (all its micro-batches)
      data_loading    waiting for the next batch from Ray Data (the data-wait metric)
      host_to_device  copying the batch to the accelerator
      forward         the model's forward pass and loss
      backward        autograd backward
        gradient_sync where the strategy issues its gradient collective (see below)
      optimizer_step  clip, optimizer update, LR schedule, zero_grad

Where the gradient collective lives differs by strategy, so each one names its own:
DDP from a comm hook (one range per gradient bucket, *inside* backward, which is DDP's
overlap), FSDP2 from a custom reduce-scatter (per FSDP unit, inside backward), DeepSpeed
around the engine's gradient reduction at the end of backward. The collectives themselves
also appear under the backend's names (``gloo:all_reduce``, ``nccl:reduce_scatter`` ...,
and on GPU as NCCL kernels on their own stream).

Pure torch, no Ray: the loop runs under torchrun too.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, record_function

from shared import storage

DATA_LOADING = "data_loading"
HOST_TO_DEVICE = "host_to_device"
FORWARD = "forward"
BACKWARD = "backward"
GRADIENT_SYNC = "gradient_sync"
OPTIMIZER_STEP = "optimizer_step"
STEP_RANGES = (DATA_LOADING, HOST_TO_DEVICE, FORWARD, BACKWARD, GRADIENT_SYNC, OPTIMIZER_STEP)

# record_function is a context manager; one name for it everywhere the loop marks a range.
# Outside a profiled step it costs a few microseconds (no profiler listens).
trace_range = record_function

_STEPS = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_profile_steps(text: str) -> tuple[int, int] | None:
    """``"3-5"`` -> (3, 5), ``"7"`` -> (7, 7), ``""`` -> None. Raises ValueError otherwise."""
    text = text.strip()
    if not text:
        return None
    match = _STEPS.match(text)
    if not match:
        raise ValueError(f"not a step range: {text!r}")
    first = int(match.group(1))
    last = int(match.group(2) or first)
    if first < 1 or last < first:
        raise ValueError(f"not a step range: {text!r}")
    return first, last


def in_range(name: str, fn: Callable) -> Callable:
    """``fn`` wrapped so that every call is recorded as the range ``name``."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with trace_range(name):
            return fn(*args, **kwargs)

    return wrapped


def profile_dir(run_dir: str) -> str:
    """``<run_dir>/profile`` (local or object storage: traces are exported on the node and
    uploaded, because the profiler writes plain files)."""
    return storage.join(run_dir, "profile")


class StepProfiler:
    """Records optimizer steps ``first..last`` on this rank; does nothing for other steps.

    The loop calls :meth:`step_starting` before a step's first micro-batch and
    :meth:`step_finished` after its update. The trace is exported when step ``last`` ends:
    ``profile/rank<r>.json`` (Chrome trace format; Perfetto and chrome://tracing open it),
    plus ``profile/rank<r>_cuda_memory.pickle`` on GPU (https://pytorch.org/memory_viz).
    """

    def __init__(self, steps: tuple[int, int] | None, rank: int, device: torch.device, out: str):
        self.steps = steps
        self.rank = rank
        self.device = device
        self.out = out
        self._profiler: torch.profiler.profile | None = None
        self._step_range: record_function | None = None
        self.trace_path: str | None = None

    @classmethod
    def for_run(cls, cfg, rank: int, device: torch.device) -> StepProfiler:
        return cls(parse_profile_steps(cfg.profile_steps), rank, device, profile_dir(cfg.run_dir))

    def _wanted(self, step: int) -> bool:
        return self.steps is not None and self.steps[0] <= step <= self.steps[1]

    def step_starting(self, step: int) -> None:
        if not self._wanted(step) or self._step_range is not None:
            return  # (already started: an epoch ended before this step's first micro-batch)
        if self._profiler is None:  # the first profiled step (or the first after a resume)
            self._start()
        # Our own step marker: the profiler's ProfilerStep#k counts from 0 per profile.
        self._step_range = record_function(f"train_step#{step}")
        self._step_range.__enter__()

    def step_finished(self, step: int) -> None:
        if self._step_range is not None:
            self._step_range.__exit__(None, None, None)
            self._step_range = None
        if self._profiler is not None and step >= self.steps[1]:
            self._stop_and_export()

    def _on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def _start(self) -> None:
        activities = [ProfilerActivity.CPU]
        if self._on_gpu():
            activities.append(ProfilerActivity.CUDA)
            # Every allocation from here on, with its stack: the memory timeline of the steps.
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        # No shapes/stacks: they multiply the trace size and the question here is "where
        # does the step's time go", which the ranges and op names answer.
        self._profiler = torch.profiler.profile(activities=activities)
        self._profiler.start()

    def _stop_and_export(self) -> None:
        self._profiler.stop()
        local_out = storage.node_local_dir(self.out)
        os.makedirs(local_out, exist_ok=True)
        written = [f"rank{self.rank}.json"]
        self._profiler.export_chrome_trace(os.path.join(local_out, written[0]))
        self._profiler = None
        if self._on_gpu():
            written.append(f"rank{self.rank}_cuda_memory.pickle")
            torch.cuda.memory._dump_snapshot(os.path.join(local_out, written[-1]))
            torch.cuda.memory._record_memory_history(enabled=None)
        if storage.is_remote(self.out):  # only this rank's files: others may be mid-write
            for name in written:
                with open(os.path.join(local_out, name), "rb") as f:
                    storage.write_bytes(storage.join(self.out, name), f.read())
        self.trace_path = storage.join(self.out, written[0])
        if self.rank == 0:
            first, last = self.steps
            print(f"profiler: steps {first}-{last} traced to {self.out}/rank<r>.json (one per "
                  "rank; open in https://ui.perfetto.dev)", flush=True)  # fmt: skip

    def close(self) -> None:
        """The run ended inside the profiled range (stop_at_step, end of data): export anyway."""
        if self._profiler is not None:
            self.step_finished(self.steps[1])
