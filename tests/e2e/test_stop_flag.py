"""The driver's stop flag (shared/runtime/preemption.py) on a real local Ray cluster, through
what the driver and the loop use: ``start_stop_flag`` and ``StopCheck.stop()``. The flag lives
on the driver's node, rank 0 relays it, and a rank that finds it gone trains on instead of
failing every attempt."""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest
import ray
from ray.util.state import list_actors

from shared.runtime import preemption

FLAG_GONE = (
    "preemption: the driver's stop flag is gone; a SIGTERM to the driver no longer reaches "
    "the workers"
)


def answers_within(check: preemption.StopCheck, seconds: float) -> list[bool]:
    """What ``check.stop()`` says at each of a loop's step boundaries (one per 0.1 s) until it
    says True or ``seconds`` pass."""
    answers, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline and not any(answers):
        answers.append(check.stop())
        time.sleep(0.1)
    return answers


@pytest.fixture
def driver(tmp_path):
    """A driver's run config and its stop flag; the SIGTERM handler it installs is undone."""
    cfg = SimpleNamespace(run_dir=str(tmp_path / "run"), driver_start_time="t0",
                          preemption_grace_s=30)  # fmt: skip
    assert not preemption.stop_requested_locally()  # else every stop() is True anyway
    handler = signal.getsignal(signal.SIGTERM)
    flag = preemption.start_stop_flag(cfg)
    yield cfg, flag
    signal.signal(signal.SIGTERM, handler)
    ray.kill(flag)  # the session's cluster outlives this test


def test_the_stop_flag_lives_on_the_driver_node(ray_local, driver):
    cfg, _ = driver
    context = ray.get_runtime_context()
    # Our own GCS address: left to itself the state API refuses when other clusters run.
    named = list_actors(address=context.gcs_address,
                        filters=[("name", "=", preemption.stop_flag_name(cfg))])  # fmt: skip
    assert [(a.state, a.node_id) for a in named] == [("ALIVE", context.get_node_id())]


def test_rank0_stops_once_the_driver_sets_the_flag(ray_local, driver):
    cfg, flag = driver
    rank0 = preemption.StopCheck(cfg, rank=0, drain_every=1)
    rank1 = preemption.StopCheck(cfg, rank=1, drain_every=1)  # hears it from rank 0's vote
    assert not any(answers_within(rank0, 2.5))  # the flag is asked (once a second) and unset
    ray.get(flag.set.remote())  # what the driver's SIGTERM handler does
    answers = answers_within(rank0, 10)
    assert answers[-1] is True and not any(answers[:-1])
    assert not any(answers_within(rank1, 2.5))  # only rank 0 asks the driver


def test_a_lost_flag_is_said_once_and_the_run_trains_on(ray_local, driver, capsys):
    cfg, flag = driver
    check = preemption.StopCheck(cfg, rank=0, drain_every=1)
    ray.kill(flag)  # what losing the driver's node did to a flag placed elsewhere
    # ray.kill is asynchronous: wait until the state API reports the actor dead.
    context, by_name = ray.get_runtime_context(), [("name", "=", preemption.stop_flag_name(cfg))]
    deadline = time.monotonic() + 30
    while list_actors(address=context.gcs_address, filters=by_name)[0].state != "DEAD":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # Several polls of the dead flag: none stops the run, and the loss is said once.
    assert not any(answers_within(check, 4))
    assert capsys.readouterr().err.splitlines().count(FLAG_GONE) == 1
    # A rank started after the flag is gone (a restarted worker group) trains on silently.
    assert not any(answers_within(preemption.StopCheck(cfg, rank=0, drain_every=1), 2.5))
    assert FLAG_GONE not in capsys.readouterr().err
