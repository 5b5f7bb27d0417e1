"""Checkpoints you can trust, on a real local Ray cluster: a corrupt latest checkpoint is
skipped for the previous good one, and a worker killed while writing sharded (DCP)
checkpoints leaves a run that still ends bitwise equal to the uninterrupted one."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import run_job

# Jobs join one Ray cluster shared by this module (conftest.py: `job_cluster`).
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("job_cluster")]


def ok(result) -> dict:
    assert result.returncode == 0, result.output[-4000:]
    assert result.summary["status"] == "succeeded"
    return result.summary


def test_corrupt_latest_checkpoint_resumes_from_the_previous_one(tmp_path):
    common = ("run_name=corrupt", "checkpoint_every=4", "log_every=4")
    first = ok(run_job("ddp", *common, "max_steps=8", storage=tmp_path))
    latest = Path(first["checkpoint"])
    assert latest.name == "step_000008"
    model = latest / "model.pt"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])  # a torn upload

    result = run_job("ddp", *common, "max_steps=12", storage=tmp_path)
    s = ok(result)
    warnings = [line for line in result.output.splitlines() if "warning: checkpoint" in line]
    assert len(warnings) == 1, warnings
    assert "step_000008 fails verification: model.pt has" in warnings[0]
    assert "resuming from step_000004" in warnings[0]
    assert s["resumed_from_step"] == 4 and s["steps"] == 12
    state = json.loads(Path(s["checkpoint"], "train_state.json").read_text())
    assert state["step"] == 12


FT_COMMON = ("strategy=fsdp", "max_steps=12", "checkpoint_every=4", "log_samples=true")


def dcp_weights(checkpoint_dir: str, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The model part of a DCP checkpoint, gathered into one process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{Path(checkpoint_dir).name}-{len(list(tmp_path.iterdir()))}.pt"
    dcp_to_torch_save(Path(checkpoint_dir, "dcp"), out)
    return torch.load(out, weights_only=False)["model"]


def test_worker_killed_during_a_dcp_checkpoint_write_ends_bitwise_equal(tmp_path):
    from shared import checkpoint

    reference = ok(run_job("fault_tolerance", *FT_COMMON, "fail_at_step=0", "run_name=ref",
                           storage=tmp_path))  # fmt: skip
    # Rank 1 is SIGKILLed after its DCP shard is written, before its manifest: step 8 is on
    # storage incomplete, the group restarts (max_failures=1) and redoes the steps.
    result = run_job("fault_tolerance", *FT_COMMON, "fail_at_step=8", "fail_mode=sigkill",
                     "fail_during_checkpoint=true", "max_failures=1", "run_name=killed",
                     storage=tmp_path)  # fmt: skip
    s = ok(result)
    assert "FAULT INJECTION 1/1: rank 1 dies at step 8 while writing its checkpoint" in (
        result.stdout
    )
    assert s["failures_recovered"] == 1 and s["steps"] == 12
    assert s["samples_per_epoch"] == reference["samples_per_epoch"]
    expected = dcp_weights(reference["checkpoint"], tmp_path)
    got = dcp_weights(s["checkpoint"], tmp_path)
    assert expected.keys() == got.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    # Every checkpoint the run kept verifies; nothing staged is left on the node.
    assert checkpoint.verify_checkpoint(s["checkpoint"]) == 12
    staging = Path(tempfile.gettempdir(), "ray-train-templates", checkpoint.run_key(s["run_dir"]))
    assert not list(staging.glob("attempt-*/rank*/step_*"))
