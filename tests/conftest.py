"""Shared test helpers. End-to-end tests run the jobs exactly as a user does: a real driver
process that starts a real local Ray cluster (inside the loopback namespace under
LOOPBACK_ONLY=1, which `make test` passes on to everything started here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Every Ray cluster a test starts (and every job process it runs) reports no usage statistics.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


# Three tiers, one folder each (docs/testing.md): unit/ runs in one process with no Ray, no
# server and no process group; dist/ runs real torch.distributed gloo groups without Ray;
# e2e/ needs Ray, the S3 server or a multi-node cluster. `make test` hands whole files to its
# workers in collection order (--dist loadfile --no-loadscope-reorder): the longest files
# first, so the short unit files fill the end and no worker is left running one long file
# alone. Roughly by their --durations; files not named keep their place after.
SLOWEST_FIRST = (
    "e2e/test_s3.py", "e2e/test_fault_tolerance.py", "e2e/test_elastic.py",
    "e2e/test_deploy.py", "e2e/test_preemption.py", "e2e/test_jobs.py",
    "e2e/test_data_packing.py", "e2e/test_tp2d.py", "dist/test_strategies.py",
    "e2e/test_docs.py", "e2e/test_observability.py", "dist/test_export.py",
    "unit/test_kuberay.py", "dist/test_tp2d.py", "unit/test_docs.py",
)  # fmt: skip
TIER_OF_FOLDER = {"unit": "unit", "dist": "dist", "e2e": "e2e"}
# What a unit test may not use: these fixtures start a server or a Ray cluster.
NOT_IN_UNIT = {"s3_server", "s3_prefix", "ray_local", "job_cluster"}


def tier(item: pytest.Item) -> str:
    return TIER_OF_FOLDER.get(item.path.parent.name, "unit")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = f"{item.path.parent.name}/{item.path.name}"
        return SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)

    for item in items:
        if tier(item) == "e2e":  # `-m "not e2e"` still selects what needs no cluster
            item.add_marker(pytest.mark.e2e)
        elif tier(item) == "unit" and NOT_IN_UNIT & set(item.fixturenames):
            raise pytest.UsageError(
                f"{item.nodeid} uses {sorted(NOT_IN_UNIT & set(item.fixturenames))}: a server "
                "or a Ray cluster belongs in tests/e2e/, not tests/unit/"
            )
    items.sort(key=rank)  # stable: within a file, and among the rest, the order is unchanged


@pytest.fixture(autouse=True)
def _unit_tests_start_no_processes(request, monkeypatch):
    """tests/unit/ stays one process: a Ray cluster or a spawned process group fails here."""
    if tier(request.node) != "unit":
        return

    def refuse(*_args, **_kwargs):
        raise AssertionError(
            "tests/unit/ starts no Ray cluster and no process group: move this test to "
            "tests/dist/ (gloo ranks) or tests/e2e/ (Ray)"
        )

    import torch.multiprocessing

    monkeypatch.setattr(torch.multiprocessing, "spawn", refuse)
    monkeypatch.setattr(torch.multiprocessing, "start_processes", refuse)
    if "ray" in sys.modules:
        monkeypatch.setattr(sys.modules["ray"], "init", refuse)


@dataclass
class JobResult:
    returncode: int
    stdout: str
    stderr: str
    summary: dict | None

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def job_env() -> dict[str, str]:
    """The environment of a job subprocess: this checkout's ``shared`` first (the editable
    install may point at another checkout, e.g. from a git worktree)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


# One Ray cluster per module for the modules that opt in. Starting and stopping a private
# local cluster is about a fifth of a smoke run's CPU (a ddp smoke run: 81-89 CPU-s with its
# own cluster, 66 joining a running one), and the suite is CPU-bound. Modules about training
# results, not about what a fresh local run prints, opt in with the `job_cluster` fixture:
# their `run_job` calls join one head node with this machine's CPUs (what a local cluster
# gets) through `ray_address=`, started on first use. Its processes inherit this process's
# environment, so it is started again when the AWS_* variables (the S3 endpoint) change.
_job_cluster = None  # the running ci.run_cluster.LocalCluster
_job_cluster_aws: dict[str, str] = {}  # the AWS_* variables it was started with
_join_job_cluster = False  # set by the `job_cluster` fixture for its module


def _running_job_cluster():
    global _job_cluster, _job_cluster_aws
    from ci.run_cluster import LocalCluster, cluster_env

    aws = {key: value for key, value in os.environ.items() if key.startswith("AWS_")}
    if _job_cluster is not None and aws != _job_cluster_aws:
        _stop_job_cluster()
    if _job_cluster is None:
        env = {**cluster_env(), "PYTHONPATH": job_env()["PYTHONPATH"]}
        cluster = LocalCluster(env, worker_nodes=0, head_cpus=os.cpu_count() or 1)
        cluster.start()
        _job_cluster, _job_cluster_aws = cluster, aws
    return _job_cluster


def _stop_job_cluster() -> None:
    global _job_cluster
    if _job_cluster is not None:
        _job_cluster.stop(keep_logs=False)
        _job_cluster = None


@pytest.fixture(scope="module")
def job_cluster():
    """This module's `run_job` calls join one shared cluster, stopped when the module ends:
    an idle head node's daemons take ~5% of a core (3.3 CPU-s a minute) from the tests after it."""
    global _join_job_cluster
    _join_job_cluster = True
    try:
        yield
    finally:
        _join_job_cluster = False
        _stop_job_cluster()


def job_command(job: str, *overrides: str, storage: Path | str) -> tuple[list[str], dict]:
    """``(argv, env)`` of ``python jobs/<job>/main.py storage_path=... <overrides>``, joining
    the module's shared cluster where the module asked for one (`job_cluster`)."""
    cmd = [
        sys.executable,
        str(REPO / "jobs" / job / "main.py"),
        f"storage_path={storage}",
        *overrides,
    ]
    env = job_env()
    if _join_job_cluster and not any(o.startswith("ray_address=") for o in overrides):
        cluster = _running_job_cluster()
        cmd.append(f"ray_address={cluster.address}")
        env.update({key: cluster.env[key] for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
                                                      "RAY_TMPDIR")})  # fmt: skip
    return cmd, env


def run_job(
    job: str, *overrides: str, storage: Path, timeout: float = 600, interleaved: bool = False
) -> JobResult:
    """``python jobs/<job>/main.py --profile smoke storage_path=... <overrides>``.

    ``interleaved``: stderr goes into stdout in the order it was written, as on a terminal
    (for tests that check what a user sees, line by line)."""
    cmd, env = job_command(job, *overrides, storage=storage)
    stderr = subprocess.STDOUT if interleaved else subprocess.PIPE
    proc = subprocess.run(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=stderr, text=True, timeout=timeout, env=env
    )
    summary = None
    for line in proc.stdout.splitlines():
        if line.startswith("SUMMARY "):
            summary = json.loads(line[len("SUMMARY ") :])
    return JobResult(proc.returncode, proc.stdout, proc.stderr or "", summary)


def tiny_corpus_blocks(directory: str, rows: int, seq_len: int):
    """(token blocks [N, seq_len], tokenizer spec) of a small generated corpus, for the tests
    that run the shared loop without Ray."""
    from shared.data import generate_news_corpus, tokenizer_spec
    from shared.runtime.torchrun import packed_blocks

    source = generate_news_corpus(directory, num_rows=rows, seed=0)
    blocks = packed_blocks(source.dataset, source.tokenizer, "text", seq_len)
    return blocks, tokenizer_spec(source.tokenizer)


@pytest.fixture(scope="session")
def ray_local(tmp_path_factory, s3_server):
    """One real local Ray cluster for the tests that need Ray Data directly, started after the
    S3 server so that its worker processes find the AWS_* variables, as a real cluster's do."""
    from shared.config import BaseConfig
    from shared.runtime.cluster import ray_cluster

    cfg = BaseConfig(storage_path=str(tmp_path_factory.mktemp("ray")))
    with ray_cluster(cfg) as info:
        yield info


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """One real S3 server (SeaweedFS on 127.0.0.1) for the whole session, with the standard
    AWS_* variables set in this process, so job subprocesses and pyarrow find it.

    Run the tests and the server in one network namespace (``ci/loopback.sh`` does not nest
    a new one)."""
    from ci.s3_server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3"), bucket="tests")
    server.start()
    saved = {key: os.environ.get(key) for key in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()


@pytest.fixture
def s3_prefix(s3_server, request) -> str:
    """A fresh ``s3://`` prefix for one test."""
    import uuid

    return f"s3://{s3_server.bucket}/{request.node.name.split('[')[0]}-{uuid.uuid4().hex[:8]}"
