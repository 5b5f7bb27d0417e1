"""The contract between the shared training loop and a parallelism strategy.

The loop owns the schedule (epochs, accumulation, logging, when to checkpoint); a strategy
owns what differs between DDP, FSDP2, DeepSpeed and TP: how a micro-batch's forward/backward
runs, how the optimizer steps, what a checkpoint contains, and how much model state each
rank holds.

Each strategy also marks its phases as named trace ranges (shared/observability/profiling.py):
forward, backward, gradient_sync (wherever its gradient collective is issued) and
optimizer_step, so a profile of any strategy reads the same way. A new strategy that overrides
``forward_backward`` or ``optimizer_step`` keeps those ranges.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from shared import optim
from shared.observability.profiling import BACKWARD, FORWARD, OPTIMIZER_STEP, trace_range
from shared.precision import autocast


class Strategy:
    """Defaults fit any strategy that wraps a torch module and uses a torch optimizer."""

    name = "base"

    def __init__(self, model: nn.Module, cfg, device: torch.device, dtype: torch.dtype):
        self.cfg = cfg
        self.model = model
        self.device = device
        self.dtype = dtype
        self.optimizer = optim.build_adamw(model, cfg.lr, cfg.weight_decay)
        self.scheduler = optim.warmup_cosine(self.optimizer, cfg)
        # Filled in at the first optimizer step, when grads and Adam states all exist.
        self.measured_state_bytes: dict[str, int] | None = None

    # --- one micro-batch -------------------------------------------------------------------
    def loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Next-token loss (the model shifts labels by one internally)."""
        with autocast(self.device, self.dtype):
            return self.model(input_ids=input_ids, labels=input_ids).loss

    def gradient_sync(self, sync: bool):
        """Context for a backward; ``sync=False`` lets a strategy skip gradient communication
        on micro-batches that are not the last of an accumulation window."""
        return contextlib.nullcontext()

    def forward_backward(self, input_ids: torch.Tensor, sync: bool) -> torch.Tensor:
        """Accumulate this micro-batch's gradients; return its (detached) mean loss."""
        with self.gradient_sync(sync):
            with trace_range(FORWARD):
                loss = self.loss(input_ids)
            with trace_range(BACKWARD):
                (loss / self.cfg.grad_accum).backward()
        return loss.detach()

    # --- one optimizer step ---------------------------------------------------------------
    def clip_grad_norm(self) -> float:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def optimizer_step(self) -> float:
        """Clip, step, advance the LR schedule, clear grads; return the pre-clip grad norm."""
        with trace_range(OPTIMIZER_STEP):
            grad_norm = self.clip_grad_norm()
            self.optimizer.step()
            if self.measured_state_bytes is None:
                self.measured_state_bytes = self.model_state_bytes()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def current_lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    # --- checkpoints -----------------------------------------------------------------------
    def save(self, directory: str, rank: int) -> None:
        raise NotImplementedError

    def load(self, directory: str) -> None:
        raise NotImplementedError

    # --- memory ----------------------------------------------------------------------------
    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds locally."""
        from shared.observability.metrics import tensor_bytes

        params = list(self.model.parameters())
        optimizer_tensors = [
            v
            for state in self.optimizer.state.values()
            for v in state.values()
            if torch.is_tensor(v)
        ]
        return {
            "params": tensor_bytes(params),
            "grads": tensor_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": tensor_bytes(optimizer_tensors),
        }
