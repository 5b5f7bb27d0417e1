"""Divergence: a non-finite loss, gradient norm or weight stops the run at that step, on every
rank together (shared/loop.py decides what to save and report)."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from shared.parallel.base import Strategy


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if it is True on one: a stop decision all ranks take together, so
    no rank is left waiting in a collective the others skipped."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = torch.tensor(float(flag), device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())
    return flag


def weights_finite(strategy: Strategy) -> bool:
    """This rank's parameters (its shard for FSDP/TP, its partition for ZeRO-3) are finite."""
    for param in strategy.model.parameters():
        local = getattr(param, "ds_tensor", None)  # DeepSpeed ZeRO-3 partition
        if local is None:
            local = param.to_local() if hasattr(param, "to_local") else param
        if local.numel() and not bool(torch.isfinite(local.detach()).all()):
            return False
    return True


def nonfinite_reason(strategy: Strategy, row: dict, saving: bool) -> str:
    """Why this step diverged on this rank ('' if it did not). Loss and gradient norm are
    already global (all-reduced); weights are checked when this step writes a checkpoint."""
    checked = {"loss": row["loss"]}
    # fp16 loss scaling skips steps whose gradients overflowed: an inf norm there is expected.
    if strategy.dtype != torch.float16 and row["grad_norm"] is not None:
        checked["grad_norm"] = row["grad_norm"]
    bad = [f"{name} {value}" for name, value in checked.items() if not math.isfinite(value)]
    if not bad and saving and not weights_finite(strategy):
        bad.append("non-finite weights")
    return ", ".join(bad)
