"""What a device can compute in, decided at run time (logged, never assumed)."""

from __future__ import annotations

import contextlib

import torch


def supports_bf16(device: torch.device) -> bool:
    """bf16 with hardware support: CUDA compute capability >= 8.0 (Ampere and later)."""
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def supports_fp16(device: torch.device) -> bool:
    """fp16 tensor cores exist on every CUDA GPU we target; CPU kernels are emulated/slow and
    DeepSpeed refuses fp16 on CPU outright."""
    return device.type == "cuda"


def precision_support(device: torch.device) -> dict[str, str]:
    """'native' (hardware units), 'emulated' (runs, slowly) or 'no', for bf16 and fp16."""
    support = {}
    for name, dtype, native in (
        ("bf16", torch.bfloat16, supports_bf16(device)),
        ("fp16", torch.float16, supports_fp16(device)),
    ):
        try:
            x = torch.ones(8, 8, device=device, dtype=dtype)
            ok = bool(torch.isfinite(x @ x).all())
        except RuntimeError:
            ok = False
        support[name] = "native" if native and ok else ("emulated" if ok else "no")
    return support


def resolve_dtype(setting: str, device: torch.device) -> torch.dtype:
    """``auto`` picks bf16 where the hardware has it, else fp32; ``fp16`` falls back to fp32
    where the device has no fp16 support.

    On CPU bf16 runs but is emulated (~17x slower matmuls on AVX2), so auto stays in fp32 there;
    ``dtype=bf16`` still forces it for testing the code path.
    """
    if setting == "fp32":
        return torch.float32
    if setting == "bf16":
        return torch.bfloat16
    if setting == "fp16":
        if supports_fp16(device):
            return torch.float16
        # DeepSpeed refuses it ("Type fp16 is not supported on your device"): detect, don't crash.
        print(f"dtype=fp16 is not supported on {device.type}; training in fp32 instead", flush=True)
        return torch.float32
    return torch.bfloat16 if supports_bf16(device) else torch.float32


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision for the forward pass (weights stay fp32); a no-op for fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
