"""The deployment paths that run here: a two-node local cluster through the Ray Jobs API, and a
starter project exported out of the monorepo."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.e2e


def _summary(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("SUMMARY ")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1][len("SUMMARY ") :])


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue
    return pids


def test_run_cluster_spreads_the_workers_over_two_nodes_and_cleans_up(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "ci.run_cluster", "--job", "ddp", "max_steps=10",
         f"run_name=cluster-{os.getpid()}"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = _summary(proc.stdout)
    assert summary["status"] == "succeeded" and summary["steps"] == 10
    assert summary["worker_nodes"] == 2  # placement_strategy=SPREAD over head + worker node
    assert summary["final_loss"] < summary["initial_loss"]
    assert "ray job submit" in proc.stdout and "run-cluster: job ddp succeeded" in proc.stdout
    # Both nodes were stopped: nothing that belonged to this cluster is still running.
    (temp_dir,) = re.findall(r"temp dir (\S+)", proc.stdout)
    assert _processes_mentioning(temp_dir) == []
    assert not Path(temp_dir).exists()  # logs are kept only when the job failed


def test_exported_starter_runs_outside_the_monorepo(tmp_path):
    dest = tmp_path / "my-ddp"
    proc = subprocess.run(
        [sys.executable, "-m", "ci.template", "--job", "ddp", "--dest", str(dest)],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    expected = ["jobs/ddp/main.py", "jobs/ddp/job.yaml", "jobs/ddp/Containerfile",
                "shared/loop.py", "pyproject.toml", "Makefile", "README.md",
                "ci/setup.sh"]  # fmt: skip
    for name in expected:
        assert (dest / name).is_file(), name
    assert not (dest / "shared/parallel/zero.py").exists()  # only what ddp imports
    assert not (dest / "tests").exists()
    # job.yaml's paths work from the export's root, as the SDK resolves them.
    from anyscale.job.models import JobConfig

    config = JobConfig.from_yaml(str(dest / "jobs/ddp/job.yaml"))
    assert (dest / config.containerfile).is_file()

    # Run the smoke profile there, with the export's own `shared` first on the path.
    env = {**os.environ, "PYTHONPATH": str(dest), "PYTHONUNBUFFERED": "1"}
    which = subprocess.run(
        [sys.executable, "-c", "import shared; print(shared.__file__)"],
        cwd=dest, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert Path(which.stdout.strip()).is_relative_to(dest)
    run = subprocess.run(
        [sys.executable, "jobs/ddp/main.py", "max_steps=10", "storage_path=runs"],
        cwd=dest, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    summary = _summary(run.stdout)
    assert summary["status"] == "succeeded"
    assert summary["final_loss"] < summary["initial_loss"]
    assert Path(summary["run_dir"]).is_relative_to(dest / "runs")
    assert str(REPO / "shared") not in run.stdout + run.stderr  # no trace of the monorepo copy
