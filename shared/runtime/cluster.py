"""Connect to Ray: join the cluster we are running on, or start a private local one.

* Inside a Ray cluster (Anyscale job, KubeRay RayJob, ``ray job submit``) ``RAY_ADDRESS`` is
  set and we join it. ``ray_address=auto`` joins a cluster started with ``ray start``.
* Otherwise ``ray.init(address="local")`` starts a fresh cluster for this run only, so a run
  never attaches to somebody else's cluster on the same machine, with the dashboard bound to
  127.0.0.1 and token authentication on (a random token per run, nothing written to ~/.ray).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

from shared.config import ConfigError
from shared.observability.log_filter import filtered_output

# Read by Ray Train on the driver and propagated to the controller and every worker.
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")  # the Train API these templates use
os.environ.setdefault("RAY_TRAIN_ENABLE_PRINT_PATCH", "0")  # else rank 0's lines print twice
# The dashboard's "Stack Trace" / "CPU Flame Graph" buttons (py-spy) on a local cluster, which
# binds 127.0.0.1 with token auth. Off by default in Ray 2.60; a joined cluster keeps its own.
os.environ.setdefault("RAY_DASHBOARD_ENABLE_PROFILING", "1")

# Ray Train's controller polls the workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (default 2 s)
# and a worker's `ray.train.report` waits for that poll: its result queue holds one report. On
# a small cluster the 2 s wait dominated (30 smoke steps: 15.6 s -> 5.4 s at 0.2 s); a poll is
# one cheap RPC per worker, so it slows with the worker count back to Ray's default.
USER_POLL_INTERVAL = os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S")


def controller_poll_interval_s(num_workers: int) -> float:
    return min(2.0, max(0.2, num_workers / 100))


def use_controller_poll_interval(num_workers: int) -> None:
    """Read on the driver at ``fit()`` and passed on to the controller; the user's value wins."""
    if USER_POLL_INTERVAL is None:
        os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(
            controller_poll_interval_s(num_workers)
        )


# Ray Data needs at least one CPU that training workers do not reserve, or the pipeline
# waits forever for a CPU ("Active & requested resources: 1/0 CPU").
CPUS_LEFT_FOR_DATA = 1.0


@dataclass
class ClusterInfo:
    address: str  # "local" or what we joined
    started_here: bool
    dashboard_url: str | None


def check_local_resources(cfg) -> None:
    """Before starting a local cluster: will the requested workers fit on this machine?"""
    if cfg.ray_address or os.environ.get("RAY_ADDRESS"):
        return  # a real cluster may autoscale; Ray reports what it cannot place
    cpus = os.cpu_count() or 1
    wanted = cfg.num_workers * cfg.cpus_per_worker
    if wanted > cpus - CPUS_LEFT_FOR_DATA:
        fits = (cpus - CPUS_LEFT_FOR_DATA) / cfg.num_workers
        raise ConfigError(
            f"{cfg.num_workers} workers x cpus_per_worker={cfg.cpus_per_worker:g} reserve "
            f"{wanted:g} of this machine's {cpus} CPUs and leave less than "
            f"{CPUS_LEFT_FOR_DATA:g} for Ray Data; use cpus_per_worker={fits:.2g} or fewer workers."
        )
    if cfg.use_gpu:
        import torch

        if torch.cuda.device_count() < cfg.num_workers:
            raise ConfigError(
                f"use_gpu=true needs {cfg.num_workers} GPUs but this machine has "
                f"{torch.cuda.device_count()}; set use_gpu=false or fewer workers."
            )


def _enable_local_token_auth(token_file: str | None) -> None:
    """Ray 2.60 turns token auth on for new local clusters and writes ~/.ray/auth_token.
    We make the choice explicit: a per-run token in the environment (inherited by the raylet
    and workers), saved beside the run so `ray` CLI calls and the dashboard can use it."""
    if "RAY_AUTH_MODE" in os.environ:
        return  # the user decided (e.g. RAY_AUTH_MODE=disabled)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(16))
    # `import ray` already cached the auth mode and token; re-read them from the environment
    # (what ray.init itself does when it turns token auth on).
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    if token_file:
        os.makedirs(os.path.dirname(token_file), exist_ok=True)
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.environ["RAY_AUTH_TOKEN"])


def _private_temp_root() -> tuple[str, bool]:
    """A Ray temp root for this local cluster only (every Ray process inherits it).

    Ray records "the latest cluster" in ``<temp root>/ray/ray_current_cluster``, and its state
    API - which Ray Train's placement-group cleaner calls - connects to the cluster named
    there. With the shared /tmp, a second cluster on the machine (a test run, another job)
    takes that slot, and every such call stalls for tens of seconds. Returns (root, created)."""
    if "RAY_TMPDIR" not in os.environ:
        # Under /tmp, not $TMPDIR: Ray's unix socket paths must stay under ~107 characters.
        os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        return os.environ["RAY_TMPDIR"], True
    return os.environ["RAY_TMPDIR"], False


@contextlib.contextmanager
def ray_cluster(cfg, token_file: str | None = None) -> Iterator[ClusterInfo]:
    """Connect (or start), yield, and always disconnect; a local cluster is stopped."""
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS", "")
    use_controller_poll_interval(getattr(cfg, "num_workers", 1))
    temp_root, created_temp_root = "", False
    logs_dir = "the Ray cluster's log files"
    if not address:
        temp_root, created_temp_root = _private_temp_root()
        logs_dir = f"{temp_root}/ray/session_latest/logs"
    # Known-benign Ray/torch lines and worker tracebacks are kept out of the driver's output
    # (shared/observability/log_filter.py); the log files keep everything.
    with filtered_output(logs_dir, enabled=not getattr(cfg, "verbose", False)):
        yield from _connect(cfg, address, token_file, temp_root, created_temp_root)


def _connect(cfg, address, token_file, temp_root, created_temp_root):
    import ray

    quiet = {"log_to_driver": True, "configure_logging": True, "logging_level": "WARNING"}
    if address:
        context = ray.init(address=address, **quiet)
        info = ClusterInfo(address, False, getattr(context, "dashboard_url", None))
    else:
        _enable_local_token_auth(token_file)
        context = ray.init(
            address="local",
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            _node_ip_address="127.0.0.1",
            **quiet,
        )
        info = ClusterInfo("local", True, context.dashboard_url)
        print(f"Ray logs: {temp_root}/ray/session_latest/logs (kept if the run fails)", flush=True)
    _quiet_ray_data()
    if info.dashboard_url:
        url = info.dashboard_url if "://" in info.dashboard_url else f"http://{info.dashboard_url}"
        auth = f" (token auth: token in {token_file})" if token_file and info.started_here else ""
        print(f"Ray dashboard: {url}{auth}", flush=True)
    try:
        yield info
    except BaseException:
        created_temp_root = False  # keep a failed run's Ray logs
        raise
    finally:
        ray.shutdown()
        if created_temp_root:
            shutil.rmtree(temp_root, ignore_errors=True)
            del os.environ["RAY_TMPDIR"]


def _quiet_ray_data() -> None:
    """Progress bars are for terminals; in CI logs they are thousands of lines."""
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = sys.stdout.isatty()
    # Blocks arrive in a fixed order, so a run (and its resume) sees the same sequence.
    ctx.execution_options.preserve_order = True


def train_worker_nodes() -> int | None:
    """How many nodes this driver's Ray Train workers ran on (Ray's state API keeps dead
    actors too, so this works after ``fit()``); None if the state API is unavailable."""
    import ray
    from ray.util.state import list_actors

    context = ray.get_runtime_context()
    filters = [("class_name", "=", "RayTrainWorker"), ("job_id", "=", context.get_job_id())]
    try:
        # Our own GCS address: left to find "the" cluster, the state API scans the machine and
        # stalls for a minute when other clusters run beside this one.
        actors = list_actors(
            address=context.gcs_address, filters=filters, detail=True, limit=10_000,
            timeout=10, raise_on_missing_output=False,
        )  # fmt: skip
    except Exception:  # noqa: BLE001 - informational only; the run itself succeeded
        return None
    return len({actor.node_id for actor in actors}) or None


def topology() -> list[dict]:
    """One row per alive node: role, address, CPUs, GPUs, accelerator type, memory."""
    import ray

    rows = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        res = node.get("Resources", {})
        accel = sorted(
            k.removeprefix("accelerator_type:") for k in res if k.startswith("accelerator_type:")
        )
        rows.append(
            {
                "node_id": node["NodeID"][:12],
                "role": "head" if "node:__internal_head__" in res else "worker",
                "address": node.get("NodeManagerAddress"),
                "cpus": res.get("CPU", 0),
                "gpus": res.get("GPU", 0),
                "accelerator": ",".join(accel) or "-",
                "memory_gib": round(res.get("memory", 0) / 2**30, 1),
                "object_store_gib": round(res.get("object_store_memory", 0) / 2**30, 1),
            }
        )
    return sorted(rows, key=lambda r: (r["role"] != "head", r["node_id"]))
