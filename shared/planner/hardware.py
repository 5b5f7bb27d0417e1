"""Precision (bytes per parameter of each model state)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    name: str
    param: int  # the working copy forward/backward use
    grad: int
    adam: int  # exp_avg + exp_avg_sq, fp32
    master: int  # fp32 master weights (mixed precision only)
    activation: int  # bytes per activation element

    def describe(self) -> str:
        if self.name == "fp32":
            return "fp32 (4 + 4 + 8 bytes/param; DeepSpeed adds a 4-byte fp32 master)"
        return (
            f"{self.name} mixed precision ({self.param} + {self.grad} + "
            f"{self.adam + self.master} bytes/param)"
        )


PRECISIONS = {
    "fp32": Precision("fp32", param=4, grad=4, adam=8, master=0, activation=4),
    # The ZeRO paper's mixed-precision Adam: 2 + 2 + K with K = 12 (master 4, m 4, v 4).
    # torch autocast DDP and FSDP2's MixedPrecisionPolicy hold the same 16 bytes as fp32
    # params + grads (4 + 4) and Adam (8); the split between the columns is the paper's.
    "bf16": Precision("bf16", param=2, grad=2, adam=8, master=4, activation=2),
}
