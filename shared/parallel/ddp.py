"""Distributed data parallel: every rank holds the whole model; gradients are all-reduced.

Communication per optimizer step: one all-reduce of all gradients (bucketed and overlapped
with the backward pass by DDP). Memory per rank: the full parameters, gradients and Adam
states - nothing is sharded. Use it while the model + optimizer fit on one device.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel

from shared import checkpoint
from shared.models.structure import unwrap
from shared.observability.profiling import GRADIENT_SYNC, trace_range
from shared.parallel.base import Strategy


def apply_ddp(model: nn.Module, device: torch.device) -> nn.Module:
    """Wrap for DDP outside Ray (torchrun). Under Ray Train use ``ray.train.torch.prepare_model``,
    which does the same and moves the model to the worker's device."""
    model = model.to(device)
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return model
    return DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )


def allreduce_in_named_range(process_group, bucket):
    """DDP's own all-reduce (average) of one gradient bucket, marked ``gradient_sync``.

    DDP launches a bucket's all-reduce from inside the backward pass as soon as the bucket's
    gradients are ready, so in a trace these ranges sit inside ``backward``: that is the
    overlap of communication with the rest of the backward. The range covers the launch;
    the collective itself runs asynchronously (``gloo:all_reduce`` / NCCL kernels)."""
    with trace_range(GRADIENT_SYNC):
        return allreduce_hook(process_group, bucket)


class DDPStrategy(Strategy):
    """Replicated model; rank 0 saves the one copy of the state that every rank shares."""

    name = "ddp"

    def __init__(self, model: nn.Module, cfg, device: torch.device, dtype: torch.dtype):
        super().__init__(model, cfg, device, dtype)
        if isinstance(model, DistributedDataParallel):
            # state=None: the default process group (the one Ray Train or torchrun made).
            model.register_comm_hook(None, allreduce_in_named_range)

    def gradient_sync(self, sync: bool):
        # Skipping the all-reduce on all but the last micro-batch of an accumulation window
        # makes accumulation cost one all-reduce per optimizer step instead of grad_accum.
        if not sync and isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return super().gradient_sync(sync)

    def save(self, directory: str, rank: int) -> None:
        if rank == 0:
            checkpoint.save_model_optimizer(
                directory, unwrap(self.model), self.optimizer, self.scheduler
            )

    def load(self, directory: str) -> None:
        checkpoint.load_model_optimizer(
            directory, unwrap(self.model), self.optimizer, self.scheduler
        )
