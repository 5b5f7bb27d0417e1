"""`make stack` against a running job: the train workers' stacks show where they are."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest
from conftest import REPO, job_command

# The job joins one Ray cluster for this module (conftest.py: `job_cluster`): what `make stack`
# finds is the run's own processes (driver, ranks), wherever the cluster came from.
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("job_cluster")]

# The fault_tolerance job sleeps in FaultInjectingStrategy.optimizer_step (shared/runtime/faults.py)
# for sleep_per_step seconds every step: nearly always where a dump finds a worker.
SLEEPING_FRAME = re.compile(r"optimizer_step \(\S*faults\.py:\d+\)")


def make_stack(storage) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["make", "-s", "stack", "JOB=fault_tolerance", f"ARGS=--storage {storage}"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def sections(output: str) -> dict[str, str]:
    """'== rank0 (pid 123)' headed sections of the stack dump, by role."""
    parts = re.split(r"^== (\S+) \(pid \d+\)$", output, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def test_make_stack_shows_where_the_train_workers_are(tmp_path):
    log = tmp_path / "job.log"
    cmd, env = job_command("fault_tolerance", "run_name=hang", "fail_at_step=0", "max_steps=8",
                           "checkpoint_every=8", "sleep_per_step=1.5", "tensorboard=false",
                           storage=tmp_path)  # fmt: skip
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for(lambda: "step 1/8" in log.read_text() or job.poll() is not None, 300,
                 "the first training step")  # fmt: skip
        assert job.poll() is None, log.read_text()[-3000:]
        # A dump can catch a rank in its (short) compute between two sleeps: try a few times.
        for _attempt in range(3):
            result = make_stack(tmp_path)
            assert result.returncode == 0, result.stdout + result.stderr
            found = sections(result.stdout)
            if all(SLEEPING_FRAME.search(found.get(r, "")) for r in ("rank0", "rank1")):
                break
        assert result.stdout.startswith(f"stacks of {tmp_path}/fault_tolerance/hang\n")
        assert set(found) == {"driver", "rank0", "rank1"}, result.stdout
        for rank in ("rank0", "rank1"):
            # The sleeping frame, called from the shared loop, in a Ray Train worker.
            assert SLEEPING_FRAME.search(found[rank]), found[rank]
            assert re.search(r"train \(\S*loop\.py:\d+\)", found[rank]), found[rank]
        # The driver waits in TorchTrainer.fit() while the workers train.
        assert re.search(r"fit \(\S*data_parallel_trainer\.py:\d+\)", found["driver"])
        assert job.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if job.poll() is None:  # Ctrl-C, so the driver stops its run
            job.send_signal(signal.SIGINT)
            try:
                job.wait(timeout=60)
            except subprocess.TimeoutExpired:
                job.kill()
    # Once the job has ended there is nothing to dump, and the command says so.
    after = make_stack(tmp_path)
    assert after.returncode != 0
    assert f"error: no running fault_tolerance job found under {tmp_path}/fault_tolerance/" in (
        after.stderr
    )
