"""AdamW with decoupled weight decay and a warm-up + cosine schedule, as in nanoGPT."""

from __future__ import annotations

import math

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm gains are 1-D and decaying them hurts."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_adamw(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    # foreach=False: one kernel per tensor gives bit-identical results across strategies,
    # which the equivalence tests rely on; the fused paths differ in the last ulp.
    return torch.optim.AdamW(
        param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False
    )


def lr_multiplier(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Linear warm-up to 1, then cosine decay to ``min_ratio`` at ``max_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class WarmupCosine:
    """The LR multiplier of one run: :func:`lr_multiplier`, continued without a jump when a
    resumed run changes ``max_steps``.

    A callable object, not a lambda, on purpose: ``LambdaLR.state_dict()`` saves a callable
    object's fields, so every checkpoint format that saves the scheduler carries the horizon
    the run was trained towards, and :meth:`continue_to` can tell when it changed.

    Continuation (README "Resuming a run"): from the resume step ``r`` the multiplier decays
    by a half-cosine from its value at ``r`` to ``min_ratio`` at the new ``max_steps``. The LR
    at ``r`` is unchanged, it never rises, and the run still ends annealed at ``lr *
    min_lr_ratio``. A run extended after it finished (``r`` = old ``max_steps``) therefore
    continues at the minimum LR.
    """

    def __init__(self, warmup_steps: int, max_steps: int, min_ratio: float):
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.min_ratio = min_ratio
        self.anchor_step: int | None = None  # where the schedule was last continued
        self.anchor_multiplier: float | None = None

    def __call__(self, step: int) -> float:
        if self.anchor_step is None or step < self.anchor_step:
            return lr_multiplier(step, self.warmup_steps, self.max_steps, self.min_ratio)
        progress = min(1.0, (step - self.anchor_step) / max(1, self.max_steps - self.anchor_step))
        span = self.anchor_multiplier - self.min_ratio
        return self.min_ratio + span * 0.5 * (1 + math.cos(math.pi * progress))

    def continue_to(self, step: int, max_steps: int) -> bool:
        """Re-aim the decay at ``max_steps`` from ``step`` on; True if the horizon changed."""
        if max_steps == self.max_steps:
            return False
        if step >= self.warmup_steps:  # during warm-up the horizon does not matter yet
            self.anchor_multiplier = self(step)
            self.anchor_step = step
        self.max_steps = max_steps
        return True


def warmup_cosine(optimizer: torch.optim.Optimizer, cfg) -> torch.optim.lr_scheduler.LambdaLR:
    schedule = WarmupCosine(cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def continue_schedule(scheduler, step: int, max_steps: int) -> bool:
    """After loading a checkpoint: keep the LR continuous if ``max_steps`` changed (see
    :class:`WarmupCosine`). True if it did."""
    changed = False
    for schedule in getattr(scheduler, "lr_lambdas", []):
        if isinstance(schedule, WarmupCosine):
            changed |= schedule.continue_to(step, max_steps)
    return changed
