"""What a device can compute in, decided at run time (logged, never assumed).

The decision is a pure function of the device's properties (``DeviceCaps``: its type and CUDA
compute capability), so it is tested for GPUs this machine does not have. Native means hardware
units: bf16 from compute capability 8.0 (Ampere: A100, A10G, L4, H100), fp16 tensor cores from
7.0 (V100, T4). ``torch.cuda.is_bf16_supported()`` counts emulation by default and says True on
a T4 (sm75), where bf16 runs several times slower than fp16: only native support counts here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

BF16_NATIVE_FROM = (8, 0)  # Ampere
FP16_NATIVE_FROM = (7, 0)  # Volta tensor cores; T4 (Turing, 7.5) has them


@dataclass(frozen=True)
class DeviceCaps:
    """The properties the precision decision depends on."""

    type: str  # "cuda", "cpu", ...
    capability: tuple[int, int] | None = None  # CUDA compute capability (major, minor)


def device_caps(device: torch.device) -> DeviceCaps:
    if device.type == "cuda":
        return DeviceCaps("cuda", tuple(torch.cuda.get_device_capability(device)))
    return DeviceCaps(device.type)


def native_bf16(caps: DeviceCaps) -> bool:
    return (
        caps.type == "cuda" and caps.capability is not None and caps.capability >= BF16_NATIVE_FROM
    )


def native_fp16(caps: DeviceCaps) -> bool:
    return (
        caps.type == "cuda" and caps.capability is not None and caps.capability >= FP16_NATIVE_FROM
    )


def choose_dtype(setting: str, caps: DeviceCaps, fp16_loss_scaling: bool = False) -> str:
    """The compute dtype (``fp32``/``bf16``/``fp16``) for a ``dtype`` setting on a device.

    ``auto``: bf16 where the hardware has it natively; else fp16 where it has fp16 units and the
    job scales the loss (DeepSpeed's dynamic loss scaling: ZeRO), since fp16 without it lets
    small gradients underflow; else fp32. On CPU bf16 is emulated (~17x slower matmuls on AVX2),
    so auto stays in fp32 there; ``dtype=bf16`` still forces it for testing the code path.
    ``fp16`` falls back to fp32 off CUDA (DeepSpeed refuses fp16 on CPU).
    """
    if setting in ("fp32", "bf16"):
        return setting
    if setting == "fp16":
        return "fp16" if caps.type == "cuda" else "fp32"
    if native_bf16(caps):
        return "bf16"
    if fp16_loss_scaling and native_fp16(caps):
        return "fp16"
    return "fp32"


def supports_bf16(device: torch.device) -> bool:
    """Native bf16 (hardware units), not emulation."""
    caps = device_caps(device)
    return native_bf16(caps) and torch.cuda.is_bf16_supported(including_emulation=False)


def supports_fp16(device: torch.device) -> bool:
    """fp16 tensor cores (compute capability >= 7.0); on CPU fp16 kernels are emulated/slow and
    DeepSpeed refuses fp16 outright."""
    return native_fp16(device_caps(device))


def support_level(native: bool, runs: bool) -> str:
    return "native" if native and runs else ("emulated" if runs else "no")


def precision_support(device: torch.device) -> dict[str, str]:
    """'native' (hardware units), 'emulated' (runs, slowly) or 'no', for bf16 and fp16."""
    support = {}
    for name, dtype, native in (
        ("bf16", torch.bfloat16, supports_bf16(device)),
        ("fp16", torch.float16, supports_fp16(device)),
    ):
        try:
            x = torch.ones(8, 8, device=device, dtype=dtype)
            runs = bool(torch.isfinite(x @ x).all())
        except RuntimeError:
            runs = False
        support[name] = support_level(native, runs)
    return support


def resolve_dtype(
    setting: str, device: torch.device, fp16_loss_scaling: bool = False
) -> torch.dtype:
    """``choose_dtype`` for this process's device, as a torch dtype (says when fp16 falls back)."""
    chosen = choose_dtype(setting, device_caps(device), fp16_loss_scaling)
    if setting == "fp16" and chosen == "fp32":
        # DeepSpeed refuses it ("Type fp16 is not supported on your device"): detect, don't crash.
        print(f"dtype=fp16 is not supported on {device.type}; training in fp32 instead", flush=True)
    return DTYPES[chosen]


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the forward pass (weights stay fp32); a no-op for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
