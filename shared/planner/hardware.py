"""Precision (bytes per parameter of each model state) and the GPUs the planner knows."""

from __future__ import annotations

from dataclasses import dataclass

from shared.planner.units import format_size


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
    # fp16 holds the same bytes as bf16 (the loss scaler's state is a few scalars).
    "fp16": Precision("fp16", param=2, grad=2, adam=8, master=4, activation=2),
}


@dataclass(frozen=True)
class GPU:
    """A GPU model as one node of a cloud instance offers it."""

    name: str
    memory: int  # bytes usable by CUDA: the total nvidia-smi reports
    bf16: bool  # native bf16 tensor cores (Ampere and later; a T4 only emulates bf16)
    link: str  # intra-node GPU-to-GPU path: "nvlink" or "pcie" (what TP traffic crosses)

    def describe(self) -> str:
        return (
            f"{self.name} ({format_size(self.memory)}, "
            f"{'native bf16' if self.bf16 else 'fp16 only, no native bf16'}, "
            f"{'NVLink' if self.link == 'nvlink' else 'PCIe'} inside a node)"
        )


MiB = 1024**2
LINKS = ("nvlink", "pcie")  # what TP traffic crosses inside a node

# Memory as nvidia-smi reports it on each card (MiB); bf16 from the compute capability
# (sm75 T4: no; sm80+ yes); links from the AWS/GCP instances that carry them (g4dn T4, g6 L4,
# g5 A10G: PCIe; p4d/p4de A100, p5 H100, p5e H200: NVLink/NVSwitch).
GPUS = {
    "t4": GPU("T4", 15360 * MiB, bf16=False, link="pcie"),
    "l4": GPU("L4", 23034 * MiB, bf16=True, link="pcie"),
    "a10g": GPU("A10G", 23028 * MiB, bf16=True, link="pcie"),
    "a100-40g": GPU("A100 40GB", 40960 * MiB, bf16=True, link="nvlink"),
    "a100-80g": GPU("A100 80GB", 81920 * MiB, bf16=True, link="nvlink"),
    "h100": GPU("H100 80GB", 81559 * MiB, bf16=True, link="nvlink"),
    "h200": GPU("H200 141GB", 143771 * MiB, bf16=True, link="nvlink"),
}
