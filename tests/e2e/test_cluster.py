"""shared/runtime/cluster.py settings that Ray Train reads from the driver's environment."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO

from shared.runtime.cluster import controller_poll_interval_s

POLL = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def test_the_controller_polls_often_on_small_clusters_and_at_rays_default_on_large_ones():
    """A worker's ray.train.report waits for the controller's next poll: Ray's 2 s default
    cost the 30-step smoke run 10 s. A poll is one RPC per worker, so it slows with size."""
    assert controller_poll_interval_s(2) == 0.2
    assert controller_poll_interval_s(64) == 0.64
    assert controller_poll_interval_s(400) == 2.0


# A driver that starts a real local cluster through ray_cluster, as every job does before
# fit(), and asks a Ray task what it sees: Ray Train's controller is such a process, and it
# reads the interval from the environment it was started with.
DRIVER_THAT_ASKS = f"""
import os, sys
import ray
from shared.config import TrainConfig
from shared.runtime.cluster import ray_cluster

print("before the run:", os.environ.get("{POLL}"))
with ray_cluster(TrainConfig(num_workers=int(sys.argv[1]), storage_path=sys.argv[2])):
    seen = ray.remote(num_cpus=0)(lambda: os.environ.get("{POLL}"))
    print("in a Ray task:", ray.get(seen.remote()))
"""


def test_a_run_sets_the_poll_interval_for_its_workers_before_ray_starts(tmp_path):
    """In a fresh process, so that no earlier run in this session has set it already; 64
    workers, so the value is the size-dependent one, not a constant."""
    env = {k: v for k, v in os.environ.items() if k not in (POLL, "RAY_ADDRESS")}
    out = subprocess.run([sys.executable, "-c", DRIVER_THAT_ASKS, "64", str(tmp_path)], env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith(("before", "in a Ray"))]
    assert lines == ["before the run: None", "in a Ray task: 0.64"]


def interval_after_a_run_setup(user_value: str | None) -> str:
    code = ("import os; from shared.runtime.cluster import use_controller_poll_interval as use; "
            f"use(num_workers=2); print(os.environ['{POLL}'])")  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != POLL}
    if user_value is not None:
        env[POLL] = user_value
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                         text=True, check=True)  # fmt: skip
    return out.stdout.strip()


def test_the_users_poll_interval_wins():
    assert interval_after_a_run_setup(None) == "0.2"
    assert interval_after_a_run_setup("5") == "5"
