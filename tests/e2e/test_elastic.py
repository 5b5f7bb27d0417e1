"""Elastic training on a real three-node Ray cluster.

A head and two worker nodes on 127.0.0.1 (``ci/run_cluster.py``), each worker node with two
``trainer`` slots; the real S3 server (SeaweedFS) is the only storage the runs use. The
fault_tolerance job runs with ``min_workers=2 num_workers=4``:

1. it starts on 4 workers (two per worker node);
2. one worker node is lost (every process of it SIGKILLed, raylet included) mid-epoch: Ray
   Train restarts the group on the 2 workers that fit, from the latest checkpoint, with the
   same global batch (grad_accum doubles);
3. the node starts again: Train V2's resize monitor grows the group back to 4 workers;

and the run trains on exactly the samples of an uninterrupted 4-worker run, each once, to the
same weights up to fp32 rounding.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO, job_env
from sample_log import committed_samples
from weights import assert_close_weights, final_weights

from ci.run_cluster import LocalCluster, cluster_env
from shared import storage

pytestmark = pytest.mark.e2e

# Global batch 48 = 4 workers x 4 x grad_accum 3 = 2 workers x 4 x grad_accum 6.
SETTINGS = ("num_workers=4", "micro_batch_size=4", "grad_accum=3", "cpus_per_worker=0.5",
            'worker_resources={"trainer": 1}', "checkpoint_every=4", "max_steps=32",
            "log_samples=true", "fail_at_step=0", "eval_every=0", "log_every=4")  # fmt: skip
ELASTIC = ("min_workers=2", "elastic_resize_interval_s=5", "max_failures=4", "sleep_per_step=1")


@pytest.fixture(scope="module")
def cluster(s3_server):
    env = {**cluster_env(), "PYTHONPATH": job_env()["PYTHONPATH"]}  # workers import shared/
    # A lost node is declared dead after ~3 s of failed health checks (default ~30 s).
    env.update(RAY_health_check_period_ms="1000", RAY_health_check_timeout_ms="1000",
               RAY_health_check_failure_threshold="3")  # fmt: skip
    # Right after the loss Ray Train may still try 4 workers; give up on that sooner (60 s).
    env["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = "30"
    local = LocalCluster(env, worker_nodes=2, node_resources={"trainer": 2}, worker_node_cpus=4)
    try:
        local.start()
        yield local
    finally:
        local.stop(keep_logs=False)


def job(cluster: LocalCluster, storage_path: str, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, str(REPO / "jobs/fault_tolerance/main.py"),
           f"storage_path={storage_path}", f"ray_address={cluster.address}", *SETTINGS,
           *overrides]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env=cluster.env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)  # fmt: skip


def finish(proc: subprocess.Popen, lines: list[str] | None = None, timeout: float = 600) -> dict:
    """Wait for the driver; its SUMMARY (output lines collected into ``lines`` if given)."""
    if lines is None:
        lines = proc.communicate(timeout=timeout)[0].splitlines()
    else:
        proc.wait(timeout=timeout)
    output = "\n".join(lines)
    assert proc.returncode == 0, output[-5000:]
    (summary,) = [json.loads(line[8:]) for line in lines if line.startswith("SUMMARY ")]
    assert summary["status"] == "succeeded", output[-5000:]
    return summary


def attempts(run_dir: str) -> list[int]:
    """World size of each worker-group start, in order."""
    path = storage.join(run_dir, "attempts.jsonl")
    text = storage.read_text(path) if storage.exists(path) else ""
    return [json.loads(line)["world_size"] for line in text.splitlines() if line.strip()]


def wait_for(condition, what: str, proc: subprocess.Popen, lines: list[str], timeout=300):
    deadline = time.time() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}:\n" + "\n".join(lines[-80:])
        assert time.time() < deadline, f"no {what} in {timeout} s:\n" + "\n".join(lines[-80:])
        time.sleep(0.5)


def test_losing_and_regaining_a_node_keeps_the_batch_and_trains_each_sample_once(
    cluster, s3_prefix
):
    reference = finish(job(cluster, s3_prefix, "run_name=reference"))
    assert reference["world_size"] == 4 and reference["worker_nodes"] == 2

    proc = job(cluster, s3_prefix, "run_name=elastic", *ELASTIC)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip() for line in proc.stdout))
    reader.start()
    run_dir = f"{s3_prefix}/fault_tolerance/elastic"
    try:
        # Mid-epoch (an epoch is ~13 steps of 48), with checkpoint 8 safely registered.
        wait_for(lambda: storage.exists(f"{run_dir}/step_000008/train_state.json"),
                 "checkpoint at step 8", proc, lines)  # fmt: skip
        cluster.kill_node("worker1")
        wait_for(lambda: attempts(run_dir)[-1:] == [2], "2-worker group", proc, lines)
        cluster.start_worker_node("worker1")
        wait_for(lambda: attempts(run_dir)[-1:] == [4], "regrown 4-worker group", proc, lines)
        summary = finish(proc, lines)
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=60)
    output = "\n".join(lines)

    assert attempts(run_dir) == [4, 2, 4]
    assert summary["failures_recovered"] == 2 and summary["steps"] == 32
    assert "world size 2 (configured 4): keeping the global batch at 48 sequences with " \
           "grad_accum=6" in output  # fmt: skip
    # Exactly once: the committed samples are the uninterrupted run's, each trained once.
    committed = committed_samples(run_dir)
    assert committed == committed_samples(reference["run_dir"])
    assert all(set(counts.values()) == {1} for counts in committed.values())
    assert sum(len(counts) for counts in committed.values()) == 32 * 48
    # The same samples per step, summed in another order at 2 workers: fp32 rounding only.
    assert summary["final_loss"] == pytest.approx(reference["final_loss"], rel=1e-4)
    assert_close_weights(final_weights(summary), final_weights(reference))
