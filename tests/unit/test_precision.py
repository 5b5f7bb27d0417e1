"""The precision decision as a function of the device's properties, for GPUs this machine does
not have: native support only (a T4 emulates bf16), fp16 only where the loss is scaled."""

from __future__ import annotations

import pytest
import torch

from shared.precision import (
    DeviceCaps,
    choose_dtype,
    native_bf16,
    native_fp16,
    precision_support,
    resolve_dtype,
    support_level,
)

CPU = DeviceCaps("cpu")
V100, T4, A100, L4, H100 = (DeviceCaps("cuda", c) for c in [(7, 0), (7, 5), (8, 0), (8, 9), (9, 0)])
P100 = DeviceCaps("cuda", (6, 0))


@pytest.mark.parametrize(
    ("caps", "plain", "zero"),
    [
        (T4, "fp32", "fp16"),  # sm75: bf16 only emulated; fp16 units, but needs loss scaling
        (V100, "fp32", "fp16"),
        (P100, "fp32", "fp32"),  # no tensor cores
        (A100, "bf16", "bf16"),
        (L4, "bf16", "bf16"),
        (H100, "bf16", "bf16"),
        (CPU, "fp32", "fp32"),  # bf16 is emulated on CPU, fp16 refused by DeepSpeed
    ],
)
def test_auto_picks_native_precision_only(caps, plain, zero):
    assert choose_dtype("auto", caps) == plain
    assert choose_dtype("auto", caps, fp16_loss_scaling=True) == zero


def test_native_support_follows_the_compute_capability():
    # torch.cuda.is_bf16_supported() says True on a T4 (it counts emulation): not native.
    assert [native_bf16(c) for c in (T4, V100, A100, H100, CPU)] == [
        False,
        False,
        True,
        True,
        False,
    ]
    assert [native_fp16(c) for c in (P100, V100, T4, A100, CPU)] == [False, True, True, True, False]


def test_explicit_settings_are_kept_except_fp16_off_cuda():
    for caps in (T4, A100, CPU):
        assert choose_dtype("fp32", caps) == "fp32" and choose_dtype("bf16", caps) == "bf16"
    assert choose_dtype("fp16", T4) == "fp16"
    assert choose_dtype("fp16", CPU) == "fp32"


def test_support_levels_and_this_cpu():
    assert support_level(True, True) == "native"
    assert support_level(False, True) == "emulated"  # bf16 on a T4
    assert support_level(False, False) == "no"
    assert precision_support(torch.device("cpu"))["bf16"] == "emulated"
    assert resolve_dtype("auto", torch.device("cpu"), fp16_loss_scaling=True) == torch.float32
