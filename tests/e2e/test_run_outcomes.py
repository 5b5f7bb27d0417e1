"""Runs whose outcome is the question, not a fresh driver's output: they join one head node for
the module (conftest.py: `job_cluster`), as a job on an existing cluster does."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import run_job

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("job_cluster")]


def test_env_check_reports_topology_bandwidth_and_matmul(tmp_path):
    result = run_job("env_check", "allreduce_sizes_mb=0.01,1", storage=tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    for heading in ("== nodes", "== workers", "== all-reduce across 2 workers"):
        assert heading in result.stdout
    assert "run env_check/" in result.stdout and "collective_timeout_s=1800.0" in result.stdout
    report = json.loads(Path(result.summary["report"]).read_text())
    assert len(report["nodes"]) == 1 and report["nodes"][0]["role"] == "head"
    assert report["nodes"][0]["cpus"] == os.cpu_count()
    assert len(report["workers"]) == 2
    for worker in report["workers"]:
        assert worker["torch"] == torch.__version__ and worker["backend"] == "gloo"
        assert worker["bf16"] in ("native", "emulated", "no")
        assert worker["matmul_tflops"]["fp32"] > 0
    assert [r["bytes"] for r in report["allreduce"]] == [10484, 1048576]  # whole fp32 elements
    assert all(r["busbw_GBps"] > 0 and r["time_ms"] > 0 for r in report["allreduce"])
    assert result.summary["status"] == "succeeded" and result.summary["world_size"] == 2


def test_a_diverging_run_fails_with_status_diverged(tmp_path):
    result = run_job("ddp", "lr=1e9", "max_steps=10", "run_name=div", storage=tmp_path)
    assert result.returncode == 1
    s = result.summary
    assert s["status"] == "diverged" and s["checkpoint"] is None
    step = s["diverged_at_step"]
    # One line names the step and says what is safe to resume from.
    named = [
        line
        for line in result.output.splitlines()
        if f"diverged at step {step}" in line and not line.startswith("SUMMARY ")
    ]
    assert named == [
        f"error: TrainingDiverged: training diverged at step {step} "
        f"({s['divergence']}); this step was not saved; last good checkpoint: none"
    ]
    assert result.stdout.splitlines()[-1].startswith("SUMMARY {")

    def refuse(constant):
        raise ValueError(constant)

    run_dir = Path(s["run_dir"])
    assert json.loads((run_dir / "summary.json").read_text(), parse_constant=refuse) == s
    rows = [json.loads(line, parse_constant=refuse)
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    assert rows[-1]["step"] == step and rows[-1]["nonfinite"]
    assert not [name for name in os.listdir(run_dir) if name.startswith("step_")]
