"""A run's final weights, whatever the strategy wrote (model.pt, DCP shards, DeepSpeed files)
and wherever it lives (local disk or s3://), for comparing runs tensor by tensor."""

from __future__ import annotations

import torch

from shared.checkpoint import resume
from shared.export.sources import full_state_dict


def final_weights(summary: dict) -> dict[str, torch.Tensor]:
    """The full (unsharded) tensors of the checkpoint SUMMARY names."""
    with resume.open_checkpoint(summary["checkpoint"]) as local:
        return full_state_dict(local)


def assert_bitwise_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]):
    assert got.keys() == expected.keys()
    differ = [name for name in expected if not torch.equal(got[name], expected[name])]
    assert not differ, f"{len(differ)} of {len(expected)} tensors differ, e.g. {differ[:3]}"


def assert_close_weights(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]):
    """Equal up to fp32 rounding: the same samples summed in another order (a resize)."""
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-4)
