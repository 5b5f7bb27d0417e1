"""Preemption on a real local Ray cluster: a SIGTERM to a worker or to the
driver checkpoints at the next step boundary and stops cleanly; the rerun resumes from that
step, not from the last periodic checkpoint, and every sample is still trained on once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO, job_command

from e2e.test_fault_tolerance import assert_exactly_once
from shared import checkpoint

# Runs join one Ray cluster shared by this module (conftest.py: `job_cluster`): a SIGTERM to
# the driver or a worker is the question, not the cluster a fresh driver starts.
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("job_cluster")]

# Periodic checkpoints only at step 8: a resume from any other step came from the SIGTERM.
ARGS = ("max_steps=12", "checkpoint_every=8", "log_samples=true", "fail_at_step=0",
        "run_name=preempt")  # fmt: skip


def steps_done(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return 0
    lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return max((r["step"] for r in lines), default=0)


def run_until_sigterm(storage: Path, target: str, after_steps: int) -> tuple[int, dict, str]:
    """Start the job slowly, SIGTERM ``target`` (driver or rank1) once it has done
    ``after_steps`` more steps; return (exit code, summary, output)."""
    run_dir = storage / "fault_tolerance" / "preempt"
    start = steps_done(run_dir)
    cmd, env = job_command("fault_tolerance", *ARGS, "sleep_per_step=0.5", storage=storage)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env=env)  # fmt: skip
    try:
        deadline = time.time() + 300
        while steps_done(run_dir) < start + after_steps:
            assert proc.poll() is None and time.time() < deadline, "the run did not progress"
            time.sleep(0.2)
        pid = proc.pid
        if target != "driver":
            record = json.loads((run_dir / "processes" / f"{target}.json").read_text())
            pid = record["pid"]
        os.kill(pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    summary = next(json.loads(line[len("SUMMARY ") :]) for line in output.splitlines()
                   if line.startswith("SUMMARY "))  # fmt: skip
    return proc.returncode, summary, output


def test_sigterm_to_a_worker_or_the_driver_checkpoints_the_step_and_the_rerun_resumes_it(
    tmp_path,
):
    code, s, output = run_until_sigterm(tmp_path, "rank1", after_steps=2)
    assert code == 143, output[-3000:]
    assert s["status"] == "preempted" and "error" not in s
    first_stop = s["preempted_at_step"]
    assert 2 <= first_stop < 8 and s["steps"] == first_stop
    assert "SIGTERM received" in output
    # Stopped, not failed (Ray's own components may still log tracebacks of theirs).
    assert not any(line.startswith("error:") for line in output.splitlines())
    assert Path(s["checkpoint"]).name == f"step_{first_stop:06d}"
    assert checkpoint.verify_checkpoint(s["checkpoint"]) == first_stop

    code, s, output = run_until_sigterm(tmp_path, "driver", after_steps=1)
    assert code == 143, output[-3000:]
    assert s["status"] == "preempted" and s["resumed_from_step"] == first_stop
    second_stop = s["preempted_at_step"]
    assert first_stop < second_stop < 12 and second_stop != 8
    # The driver's stop checkpoint is the one Ray Train registered (SUMMARY's checkpoint is
    # the fit result's), complete on storage, so a rerun resumes there, as the first rerun
    # resumed at the worker's stop; and every sample up to it was trained on once.
    assert Path(s["checkpoint"]).name == f"step_{second_stop:06d}"
    assert checkpoint.verify_checkpoint(s["checkpoint"]) == second_stop
    assert_exactly_once(s["run_dir"], steps=second_stop)
