"""Every job end to end with ``storage_path=s3://...`` on a real S3 server (SeaweedFS on
127.0.0.1), and one driver per run (the lease) with a second and a killed driver.

Run the server and the tests in one network namespace:
``ci/loopback.sh .venv/bin/python -m pytest -p no:xdist tests/e2e/test_s3.py``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, job_env, run_job
from sample_log import committed_samples

from shared import storage

# Jobs join one Ray cluster shared by this module (conftest.py: `job_cluster`).
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("job_cluster")]

STEPS = ("max_steps=8", "checkpoint_every=4", "log_every=4")


def ok(result) -> dict:
    assert result.returncode == 0, result.output[-4000:]
    assert result.summary["status"] == "succeeded"
    return result.summary


def losses(run_dir: str) -> dict[int, float]:
    rows = storage.read_text(storage.join(run_dir, "metrics.jsonl")).splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, rows)}


@pytest.fixture(scope="module")
def bucket(s3_server) -> str:
    return f"s3://{s3_server.bucket}/e2e"


@pytest.fixture(scope="module")
def ddp_run(bucket):
    """8 steps (steps 2-3 profiled). A resume from the bucket: test_one_driver_per_run_on_s3."""
    return ok(run_job("ddp", *STEPS, "run_name=resume", "profile_steps=2-3", storage=bucket))


def test_ddp_on_s3_writes_every_run_file_to_the_bucket(ddp_run, bucket):
    first = ddp_run
    run_dir = f"{bucket}/ddp/resume"
    assert first["run_dir"] == run_dir and first["steps"] == 8
    # The checkpoint Ray Train registered, as a URI a user can open.
    assert first["checkpoint"] == f"{run_dir}/step_000008"
    assert storage.listdir(first["checkpoint"]) == [
        "manifest",
        "model.pt",
        "rng",
        "train_state.json",
    ]
    assert storage.listdir(storage.join(first["checkpoint"], "rng")) == ["rank0.pt", "rank1.pt"]
    state = json.loads(storage.read_text(storage.join(first["checkpoint"], "train_state.json")))
    assert state["step"] == 8 and state["world_size"] == 2
    # Observability: loss curve, data stats, TensorBoard events and profiler traces uploaded.
    assert storage.read_bytes(f"{run_dir}/loss_curve.png")[:8] == b"\x89PNG\r\n\x1a\n"
    assert "MapBatches(read_packed_chunks)" in storage.read_text(f"{run_dir}/data_stats.txt")
    events = storage.listdir(f"{run_dir}/tensorboard")
    assert events and all(name.startswith("events.out.tfevents.") for name in events)
    for rank in (0, 1):
        trace = json.loads(storage.read_text(f"{run_dir}/profile/rank{rank}.json"))
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"train_step#2", "train_step#3"} <= names
    # The generated corpus lives in the bucket too, complete (its marker is written last),
    # and so does the packed dataset the runs read, committed by its manifest.
    corpora = [name for name in storage.listdir(f"{bucket}/_data") if name != "packed"]
    assert len(corpora) == 1
    corpus = f"{bucket}/_data/{corpora[0]}"
    assert storage.listdir(corpus) == ["_COMPLETE", "tokenizer", "train.parquet"]
    (packed,) = storage.listdir(f"{bucket}/_data/packed")
    files = storage.listdir(f"{bucket}/_data/packed/{packed}")
    assert "_MANIFEST.json" in files and "chunk-000000.parquet" in files
    # Nothing landed in a local folder named after the URI (os.makedirs("s3://...")).
    assert not (REPO / "s3:").exists()


@pytest.mark.parametrize(
    "job, extra, marker",
    [
        ("fsdp", (), "dcp"),
        ("zero", ("zero_stage=3",), "engine"),
    ],
)
def test_sharded_job_on_s3_matches_ddp(job, extra, marker, ddp_run, bucket):
    """Every rank's shards reach the bucket, and the math is DDP's (same seed, same data)."""
    summary = ok(run_job(job, *extra, *STEPS, f"run_name={job}", storage=bucket))
    assert summary["checkpoint"] == f"{bucket}/{job}/{job}/step_000008"
    files = storage.listdir(summary["checkpoint"])
    assert "train_state.json" in files and "rng" in files
    if marker == "dcp":
        shards = storage.listdir(storage.join(summary["checkpoint"], "dcp"))
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(shards)
    else:
        assert len(files) > 2
    reference = losses(ddp_run["run_dir"])
    mine = losses(summary["run_dir"])
    assert sorted(mine) == list(range(1, 9))
    for step in mine:
        assert mine[step] == pytest.approx(reference[step], rel=1e-5), step


def test_fault_tolerance_on_s3_recovers_exactly_once(bucket):
    """The job that crashed on s3:// (plain open() of markers, attempts and sample logs); the
    worker raises right after step 4's checkpoint, which Ray Train may not have registered yet
    (its controller polls), so the restart resumes at 4 or from scratch."""
    summary = ok(run_job("fault_tolerance", "max_steps=12", "checkpoint_every=4",
                         "fail_at_step=5", "fail_mode=raise", "log_samples=true",
                         "run_name=ft", storage=bucket))  # fmt: skip
    run_dir = summary["run_dir"]
    assert summary["checkpoint"].startswith("s3://") and summary["steps"] == 12
    assert summary["failures_recovered"] == 1 and summary["attempts"] == 2
    # Step 4's checkpoint, or none if the controller had not registered it yet (it polls).
    assert summary["resumed_from_step"] in (4, None)
    assert storage.listdir(f"{run_dir}/injected_failures") == ["1"]
    attempts = storage.read_text(f"{run_dir}/attempts.jsonl").splitlines()
    assert len(attempts) == 2
    # The sample logs in the bucket: every sample in the final model was trained on once.
    committed = committed_samples(run_dir)
    for epoch, counts in committed.items():
        assert set(counts.values()) == {1}, f"epoch {epoch}: a sample was trained on twice"
    assert sum(len(counts) for counts in committed.values()) == 12 * 32  # x global batch


class Driver:
    """A job driver in the background whose output is read as it comes."""

    def __init__(self, *args: str):
        cmd = [sys.executable, str(REPO / "jobs" / "fault_tolerance" / "main.py"), *args]
        env = job_env()
        self.proc = subprocess.Popen(cmd, cwd=REPO, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env)  # fmt: skip
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, limit_s: float = 1200) -> None:
        deadline = time.monotonic() + limit_s  # a guard against a hang, not an assertion
        while not any(text in line for line in self.lines):
            assert self.proc.poll() is None or self._reader.is_alive(), "".join(self.lines)
            assert time.monotonic() < deadline, "".join(self.lines[-50:])
            time.sleep(0.5)


def test_one_driver_per_run_on_s3(bucket):
    """A second driver is refused while the first lives; after the first is SIGKILLed the
    rerun takes the lease over and resumes from the bucket."""
    args = (f"storage_path={bucket}", "run_name=lease", "max_steps=20", "checkpoint_every=4",
            "fail_at_step=0")  # fmt: skip
    # Slow steps keep the first driver alive (~70 s to go) while the second one starts.
    first = Driver(*args, "sleep_per_step=2")
    try:
        first.wait_for("checkpoint saved at step 4")
        lease = json.loads(storage.read_text(f"{bucket}/fault_tolerance/lease/driver.lease"))
        assert lease["pid"] == first.proc.pid
        second = run_job("fault_tolerance", *args[1:], storage=bucket, timeout=120)
        assert second.returncode == 2, second.output[-3000:]
        errors = [line for line in second.stderr.splitlines() if line.strip()]
        assert len(errors) == 1 and "already being trained by another driver" in errors[0]
        assert f"pid {first.proc.pid}" in errors[0]
        assert second.summary is None  # refused before any cluster or run started
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait()
    rerun = run_job("fault_tolerance", *args[1:], storage=bucket)
    summary = ok(rerun)
    assert "taking over the lease" in rerun.stdout and "is gone" in rerun.stdout
    assert "resumed from checkpoint at step " in rerun.stdout
    resumed = summary["resumed_from_step"]
    assert resumed is not None and resumed >= 4 and summary["steps"] == 20
    assert summary["steps_this_run"] == 20 - resumed
    assert not storage.exists(f"{bucket}/fault_tolerance/lease/driver.lease")
    # The run's files continued in the bucket: summary.json is the SUMMARY line, metrics.jsonl
    # one row per step across both drivers (the killed one's rows past the resume replayed).
    run_dir = summary["run_dir"]
    assert json.loads(storage.read_text(f"{run_dir}/summary.json")) == summary
    assert sorted(losses(run_dir)) == list(range(1, 21))


def test_storage_it_cannot_reach_is_one_sentence_before_any_cluster(s3_server, monkeypatch):
    """Wrong credentials (or no bucket, an endpoint that is down): exit 2 with one line, where
    pyarrow's OSError once ended the run in a traceback without a SUMMARY."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
    result = run_job("ddp", storage="s3://denied/runs", timeout=120)
    assert result.returncode == 2, result.output[-3000:]
    assert result.stderr.startswith("error: storage unreachable before the run started (")
    assert "ACCESS_DENIED" in result.stderr and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output and "Ray dashboard" not in result.stdout
