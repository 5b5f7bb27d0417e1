"""Run a job on a local two-node Ray cluster through the Ray Jobs API - the way a cluster runs it.

    make run-cluster JOB=ddp [PROFILE=smoke] [ARGS="key=value ..."]

1. ``ray start --head`` and ``ray start --address`` (one worker node) on 127.0.0.1, with token
   auth on and a fresh token, on free ports (another cluster on the machine is left alone);
2. ``ray job submit --working-dir . --runtime-env-json ...`` with job.yaml's entrypoint, env
   vars and excludes - the runtime env Anyscale and KubeRay get - and ``placement_strategy=
   SPREAD`` so the workers land on both nodes; the job's logs stream here;
3. the exit status is the job's; both nodes are stopped by PID (their process groups), never
   with a bare ``ray stop``, which would stop every cluster on the machine.

The head gets CPUs here (unlike the compute configs' ``CPU: 0`` heads) so that the two training
workers can be spread over two nodes on one machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ci.jobspec import REPO, JobSpecError, load

HEAD_CPUS = 1
WORKER_NODE_CPUS = 2
START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCluster:
    """A head and ``worker_nodes`` worker nodes, each a ``ray start --block`` process we own.

    Worker nodes can be lost (``kill_node``: every process of the node, SIGKILL, as when a
    machine disappears) and started again (``start_worker_node``) - the elastic tests."""

    def __init__(self, env: dict, worker_nodes: int = 1, node_resources: dict | None = None,
                 worker_node_cpus: int = WORKER_NODE_CPUS, head_cpus: int = HEAD_CPUS):  # fmt: skip
        self.env = env
        self.worker_nodes = worker_nodes
        self.head_cpus = head_cpus
        self.node_resources = node_resources or {}  # custom resources of each worker node
        # Logical CPUs (Ray's accounting, not cores): Ray Data's read tasks need some left
        # over by the training workers on their node.
        self.worker_node_cpus = worker_node_cpus
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.processes: list[subprocess.Popen] = []
        self.nodes: dict[str, subprocess.Popen] = {}  # worker node name -> its `ray start`
        self._starts = 0
        # One temp dir per node: nodes sharing one would share (and garbage-collect) each
        # other's runtime-env packages, pulling the job's working_dir from under it.
        self.temp_root = Path(tempfile.mkdtemp(prefix="ray-local-"))
        # RAY_TMPDIR: Ray's "latest cluster" record, which its state API trusts, stays private
        # too (see shared/runtime/cluster.py _private_temp_root).
        self.env["RAY_TMPDIR"] = str(self.temp_root)

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def _ray_start(self, temp_name: str, *args: str) -> subprocess.Popen:
        ray = str(Path(sys.executable).with_name("ray"))
        temp_dir = self.temp_root / temp_name
        cmd = [ray, "start", "--block", "--node-ip-address", "127.0.0.1",
               "--temp-dir", str(temp_dir), *args]  # fmt: skip
        # Own process group: stopping it stops everything this node started, and nothing else.
        proc = subprocess.Popen(cmd, env=self.env, start_new_session=True)
        self.processes.append(proc)
        return proc

    def start(self) -> None:
        self._ray_start(
            "head", "--head", "--port", str(self.gcs_port), "--num-cpus", str(self.head_cpus),
            "--include-dashboard", "true", "--dashboard-host", "127.0.0.1",
            "--dashboard-port", str(self.dashboard_port),
            "--dashboard-agent-listen-port", str(free_port()),
            "--ray-client-server-port", str(free_port()),
        )  # fmt: skip
        self._wait_for_nodes(1)
        for i in range(self.worker_nodes):
            self.start_worker_node(f"worker{i}" if self.worker_nodes > 1 else "worker")
        print(f"local cluster up: {1 + self.worker_nodes} nodes, dashboard {self.dashboard}, "
              f"temp dir {self.temp_root}", flush=True)  # fmt: skip

    def start_worker_node(self, name: str) -> None:
        """Start (or start again, after ``kill_node``) the worker node ``name``."""
        for tries_left in (1, 0):
            self._starts += 1
            args = ["--address", self.address, "--num-cpus", str(self.worker_node_cpus),
                    "--dashboard-agent-listen-port", str(free_port())]  # fmt: skip
            if self.node_resources:
                args += ["--resources", json.dumps(self.node_resources)]
            # A fresh temp dir per start: a restarted node must not find the dead one's sockets.
            proc = self.nodes[name] = self._ray_start(f"{name}-{self._starts}", *args)
            try:
                self._wait_for_nodes(len(self.nodes) + 1)
                return
            except RuntimeError:
                # On a loaded machine the raylet can give up waiting for its dashboard agent
                # (20 s); a second start usually makes it.
                if proc.poll() is None or not tries_left:
                    raise
                self.processes.remove(proc)
                print(f"local cluster: node {name} failed to start; starting it again", flush=True)

    def kill_node(self, name: str) -> None:
        """Lose worker node ``name`` at once: SIGKILL its raylet, its workers and everything
        else it started (no drain, no goodbye to the GCS)."""
        proc = self.nodes.pop(name)
        marker = str(Path(proc.args[proc.args.index("--temp-dir") + 1]))
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        for pid in self._pids_mentioning(marker.encode()):  # any that left the group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        self.processes.remove(proc)
        # The GCS notices when the node's health checks fail (RAY_health_check_* settings).
        self._wait_for_nodes(len(self.nodes) + 1, dead_ones_gone=True)

    def _wait_for_nodes(self, count: int, dead_ones_gone: bool = False) -> None:
        """Until ``count`` nodes are alive (or, ``dead_ones_gone``, no more than ``count``)."""
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            if any(p.poll() is not None for p in self.processes):
                raise RuntimeError("a `ray start` process exited during start-up (see above)")
            alive = self._alive_nodes()  # None: the GCS did not answer this time
            if alive is not None and ((alive <= count) if dead_ones_gone else (alive >= count)):
                return
            time.sleep(1)
        raise RuntimeError(f"the local cluster did not reach {count} nodes in {START_TIMEOUT_S} s")

    def _alive_nodes(self) -> int | None:
        proc = subprocess.run(
            [str(Path(sys.executable).with_name("ray")), "list", "nodes", "--address",
             self.dashboard, "--format", "json", "--filter", "state=ALIVE"],
            env=self.env, capture_output=True, text=True,
        )  # fmt: skip
        try:
            return len(json.loads(proc.stdout)) if proc.returncode == 0 else None
        except json.JSONDecodeError:
            return None

    def stop(self, keep_logs: bool) -> None:
        # The worker node first (it drains through the head's GCS), then the head. SIGTERM to
        # `ray start` alone: it drains its node, then stops the daemons it started.
        for proc in reversed(self.processes):
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            # Daemons that outlived their `ray start` parent are still in its process group.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for pid in self.leftover_pids():  # anything that left the group: ours by its address
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if keep_logs:
            print(f"Ray logs of the local cluster: {self.temp_root}/*/session_latest/logs")
        else:
            shutil.rmtree(self.temp_root, ignore_errors=True)

    def leftover_pids(self) -> list[int]:
        """Processes still running that were started for this cluster: every Ray daemon and
        worker carries the head's GCS address, with its port unique on this machine."""
        return self._pids_mentioning(self.address.encode())

    @staticmethod
    def _pids_mentioning(marker: bytes) -> list[int]:
        pids = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                if marker in cmdline.read_bytes():
                    pids.append(int(cmdline.parent.name))
            except OSError:
                continue
        return [pid for pid in pids if pid != os.getpid()]


def submit(spec, cluster: LocalCluster, profile: str, overrides: list[str]) -> int:
    """``ray job submit`` with the job.yaml runtime env; streams logs, returns the job's status."""
    storage = f"storage_path={REPO / 'runs'}"
    entrypoint = spec.entrypoint(profile, [storage, "placement_strategy=SPREAD", *overrides])
    runtime_env = spec.runtime_env()
    working_dir = runtime_env.pop("working_dir")
    cmd = [
        str(Path(sys.executable).with_name("ray")), "job", "submit",
        "--address", cluster.dashboard,
        "--submission-id", f"{spec.job}-{time.strftime('%Y%m%d-%H%M%S')}",
        "--working-dir", working_dir,
        "--runtime-env-json", json.dumps(runtime_env),
        "--", *entrypoint,
    ]  # fmt: skip
    print(f"$ ray job submit ... -- {' '.join(entrypoint)}", flush=True)
    return subprocess.run(cmd, env=cluster.env, cwd=REPO).returncode


def cluster_env() -> dict:
    """Token auth on with a fresh token (nodes, the Jobs API client and the driver share it);
    the venv first on PATH, so the entrypoint's ``python`` is the one with the pinned stack."""
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env["RAY_AUTH_MODE"] = "token"
    env["RAY_AUTH_TOKEN"] = secrets.token_hex(16)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    # Stopping comes after the job finished: there is nothing to drain for 30 s.
    env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "5"
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True)
    parser.add_argument("--profile", default="smoke")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    try:
        spec = load(args.job)
        # Bad settings stop here, with the job's own message, before any node starts.
        spec.settings(args.profile, list(args.overrides))
    except JobSpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cluster = LocalCluster(cluster_env())
    status = 1
    try:
        cluster.start()
        status = submit(spec, cluster, args.profile, list(args.overrides))
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        status = 1
    finally:
        cluster.stop(keep_logs=status != 0)
    print(f"run-cluster: job {args.job} {'succeeded' if status == 0 else 'failed'}", flush=True)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
