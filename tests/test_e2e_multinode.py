"""A head and two worker nodes on one machine (issue 15, item 2): lose a worker node's raylet
mid-epoch, keep training on the survivors at the same global batch, grow back when the node
returns, and end within fp32 tolerance of an uninterrupted 4-worker run, every sample once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import REPO, run_job
from test_e2e_fault_tolerance import committed_batches

from ci.run_cluster import LocalCluster, cluster_env, free_port

pytestmark = pytest.mark.e2e

SLOTS = "trainer"  # a custom resource only the worker nodes have: 2 training workers each
# 48 = 6 x 2 x 4 keeps its global batch at 2, 3 and 4 workers (64 would be refused at 3).
ARGS = ("min_workers=2", "num_workers=4", "micro_batch_size=6", "grad_accum=2",
        "cpus_per_worker=0.25", f'worker_resources={{"{SLOTS}": 1}}', "placement_strategy=SPREAD",
        "elastic_resize_interval_s=5", "max_steps=30", "checkpoint_every=4", "log_samples=true",
        "fail_at_step=0", "max_failures=3")  # fmt: skip
MICRO_BATCHES_PER_STEP = 48 // 6


class ThreeNodeCluster(LocalCluster):
    """Head (logical CPUs for Ray Data: every worker runs its own unsplit pipeline, and with
    one head CPU Ray Data found no budget for its reads) + worker nodes to kill and add."""

    def __init__(self):
        super().__init__(cluster_env())
        self.nodes: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        self._ray_start("head", "--head", "--port", str(self.gcs_port), "--num-cpus", "8",
                        "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
                        "--dashboard-port", str(self.dashboard_port),
                        "--dashboard-agent-listen-port", str(free_port()),
                        "--ray-client-server-port", str(free_port()))  # fmt: skip
        self._wait_for_nodes(1)
        self.add_node("worker1")
        self.add_node("worker2")

    def _wait_for_nodes(self, count: int) -> None:
        """Like the base class, but only the node just started may not have exited (a killed
        node's ``ray start`` is gone on purpose)."""
        deadline = time.time() + 180
        while self._alive_nodes() < count:
            if self.processes[-1].poll() is not None:
                raise RuntimeError("a `ray start` process exited during start-up (see above)")
            if time.time() > deadline:
                raise RuntimeError(f"the local cluster did not reach {count} nodes")
            time.sleep(2)

    def add_node(self, name: str, tries: int = 3) -> None:
        """Start a worker node and wait until it is alive. On a loaded machine a raylet can
        miss Ray's fixed 30 s registration window; that start is retried."""
        alive = self._alive_nodes()
        for attempt in range(tries):
            node = f"{name}-{attempt}"
            self._ray_start(node, "--address", f"127.0.0.1:{self.gcs_port}", "--num-cpus", "2",
                            "--resources", json.dumps({SLOTS: 2}),
                            "--dashboard-agent-listen-port", str(free_port()))  # fmt: skip
            self.nodes[name] = self.processes[-1]
            try:
                self._wait_for_nodes(alive + 1)
                return
            except RuntimeError:
                if self.nodes[name].poll() is None or attempt == tries - 1:
                    raise
                self.processes.remove(self.nodes[name])

    def kill_raylet(self, name: str) -> int:
        """SIGKILL the node's raylet (found in the node's own process group); its workers go
        with it, as when a machine disappears."""
        group = self.nodes[name].pid
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            pid = int(cmdline.parent.name)
            try:
                if os.getpgid(pid) == group and b"/raylet" in cmdline.read_bytes().split(b"\0")[0]:
                    os.kill(pid, signal.SIGKILL)
                    return pid
            except OSError:
                continue
        raise AssertionError(f"no raylet in {name}'s process group")


def read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for(condition, what: str, proc: subprocess.Popen, log: Path, timeout=1200) -> None:
    deadline = time.time() + timeout
    while not condition():
        tail = log.read_text()[-3000:] if log.exists() else ""
        assert proc.poll() is None, f"the driver ended before {what}:\n{tail}"
        assert time.time() < deadline, f"timed out waiting for {what}:\n{tail}"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cluster(monkeypatch_module):
    c = ThreeNodeCluster()
    try:
        c.start()
        for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_TMPDIR"):
            monkeypatch_module.setenv(key, c.env[key])
        yield c
    finally:
        c.stop(keep_logs=False)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.skip(
    reason="issue 15 item 2: not yet seen passing. On the shared 2-core machine (load 80-170) "
    "each worker's Ray Data pipeline took ~350 s before the first step, so the run never reached "
    "the node kill within the session; unskip and run alone on a quiet machine."
)
def test_node_loss_shrinks_then_regrows_with_the_same_batch_and_data(cluster, tmp_path):
    address = f"ray_address=127.0.0.1:{cluster.gcs_port}"
    run_dir = tmp_path / "fault_tolerance" / "nodes"
    cmd = [sys.executable, str(REPO / "jobs/fault_tolerance/main.py"), f"storage_path={tmp_path}",
           *ARGS, address, "run_name=nodes", "sleep_per_step=1.0"]  # fmt: skip
    log = tmp_path / "driver.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
    try:
        metrics, attempts = run_dir / "metrics.jsonl", run_dir / "attempts.jsonl"
        wait_for(lambda: any(r["step"] >= 6 for r in read_jsonl(metrics)), "step 6", proc, log)
        cluster.kill_raylet("worker2")
        wait_for(lambda: [a["world_size"] for a in read_jsonl(attempts)][-1:] == [2],
                 "a 2-worker attempt", proc, log)  # fmt: skip
        cluster.add_node("worker2-again")
        wait_for(lambda: [a["world_size"] for a in read_jsonl(attempts)][-1:] == [4],
                 "the group to grow back to 4 workers", proc, log)  # fmt: skip
        proc.wait(timeout=1200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    output = log.read_text()
    assert proc.returncode == 0, output[-4000:]
    summary = json.loads(next(line for line in output.splitlines()
                              if line.startswith("SUMMARY "))[len("SUMMARY ") :])  # fmt: skip
    assert summary["steps"] == 30 and summary["world_size"] == 4
    sizes = [a["world_size"] for a in read_jsonl(run_dir / "attempts.jsonl")]
    assert sizes[0] == 4 and 2 in sizes and sizes[-1] == 4, sizes
    assert "keeping the global batch at 48 sequences with grad_accum=4" in output

    # Exactly once: every global micro-batch index of every epoch committed once, none missing.
    committed = committed_batches(str(run_dir))
    total = 0
    for epoch, counts in committed.items():
        assert set(counts.values()) == {1}, f"epoch {epoch}: a batch was trained on twice"
        assert sorted(counts) == list(range(len(counts))), f"epoch {epoch}: a batch was skipped"
        total += len(counts)
    assert total == 30 * MICRO_BATCHES_PER_STEP

    reference = run_job("fault_tolerance", *ARGS, address, "run_name=reference",
                        storage=tmp_path, timeout=1800)  # fmt: skip
    assert reference.returncode == 0, reference.output[-4000:]
    ref = reference.summary
    assert ref["world_size"] == 4 and ref["samples_seen"] == summary["samples_seen"]
    assert summary["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-4, abs=1e-5)
    assert Counter(sizes)[4] >= 2
