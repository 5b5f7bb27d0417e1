"""The driver's stop flag (shared/runtime/preemption.py) on a real local Ray cluster: it lives
on the driver's node, and a rank that finds it gone trains on instead of failing every
attempt."""

from __future__ import annotations

import time
from types import SimpleNamespace

import ray
from ray.util.state import list_actors

from shared.runtime import preemption


def test_the_stop_flag_lives_on_the_driver_node_and_its_loss_is_not_fatal(ray_local, tmp_path):
    cfg = SimpleNamespace(run_dir=str(tmp_path / "run"), driver_start_time="t0")
    flag = preemption.start_stop_flag(cfg)
    try:
        name = preemption.stop_flag_name(cfg)
        context = ray.get_runtime_context()
        # Our own GCS address: left to itself the state API refuses when other clusters run.
        by_name = [("name", "=", name)]
        (actor,) = list_actors(address=context.gcs_address, filters=by_name)
        assert actor.node_id == context.get_node_id()

        check = preemption.StopCheck(cfg, rank=0, drain_every=1)
        flag.set.remote()
        deadline = time.time() + 30
        while not check._driver_asked():  # polled without blocking, at most once a second
            assert time.time() < deadline
            time.sleep(0.2)

        ray.kill(flag)  # what losing the driver's node did to a flag placed elsewhere
        # ray.kill is asynchronous: until the actor is dead it may still answer "stop asked".
        deadline = time.time() + 30
        while list_actors(address=context.gcs_address, filters=by_name)[0].state != "DEAD":
            assert time.time() < deadline
            time.sleep(0.2)
        check._next_poll = 0.0
        deadline = time.time() + 30
        while check._flag is not None:
            assert check._driver_asked() is False
            assert time.time() < deadline
            time.sleep(0.2)
        assert check._driver_asked() is False
    finally:
        import signal

        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # start_stop_flag installed a handler
