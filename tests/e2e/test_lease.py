"""One driver per run: the run lease on local disk and on a real S3 server (SeaweedFS).

The "other driver" is a real second Python process wherever one host can show it; a driver
on another host is stood in for by a lease with another host name (this machine is one host).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO

from shared import storage
from shared.runtime.lease import LEASE_FILE, Holder, Lease, LeaseHeld

HOLD_AND_WAIT = """
import sys, time
from shared.runtime.lease import Lease
Lease(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(600)
"""
SECOND_DRIVER = """
import sys, types
from shared.runtime.lease import run_lease
run_lease(types.SimpleNamespace(run_dir=sys.argv[1])).release()
print("acquired", flush=True)
"""


@pytest.fixture(params=["local", "s3"])
def run_dir(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "job" / "run")
    return storage.join(request.getfixturevalue("s3_prefix"), "job", "run")


def python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)  # fmt: skip


def test_second_driver_exits_2_while_the_first_lives(run_dir):
    first = Lease(run_dir).acquire()
    holder = Holder.parse(storage.read_text(storage.join(run_dir, LEASE_FILE)))
    assert holder.owner == first.owner and holder.pid == first.pid
    second = python(SECOND_DRIVER, run_dir)
    out, err = second.communicate(timeout=120)
    assert second.returncode == 2, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: run ") and "already being trained" in err
    assert f"pid {first.pid}" in err
    first.release()
    assert not storage.exists(storage.join(run_dir, LEASE_FILE))
    # Released: the next driver takes it.
    third = python(SECOND_DRIVER, run_dir)
    out, err = third.communicate(timeout=120)
    assert third.returncode == 0 and out.strip() == "acquired", err


def test_lease_of_a_killed_driver_is_taken_over(run_dir):
    holder_proc = python(HOLD_AND_WAIT, run_dir)
    assert holder_proc.stdout.readline().strip() == "held"
    dead = Holder.parse(storage.read_text(storage.join(run_dir, LEASE_FILE)))
    assert dead.pid == holder_proc.pid
    holder_proc.send_signal(signal.SIGKILL)
    holder_proc.wait()
    lease = Lease(run_dir).acquire()  # the same host: the pid is gone, no need to wait
    try:
        now = Holder.parse(storage.read_text(storage.join(run_dir, LEASE_FILE)))
        assert now.owner == lease.owner != dead.owner
    finally:
        lease.release()


def test_expired_lease_from_another_host_is_taken_over(run_dir):
    stale = Holder("0" * 32, "another-host", 4242, 1.0, expires=time.time() - 5,
                   renewed=time.time() - 65)  # fmt: skip
    storage.write_text(storage.join(run_dir, LEASE_FILE), json.dumps(stale.__dict__))
    lease = Lease(run_dir).acquire()
    try:
        assert Holder.parse(storage.read_text(lease.path)).owner == lease.owner
    finally:
        lease.release()


def current_holder(path: str) -> Holder:
    """The lease's holder. A read that overlaps a renewal (every 0.5 s here) once came back
    unparseable from the local S3 server under a loaded CI run: read again, for 5 s."""
    deadline = time.monotonic() + 5
    while (holder := Holder.parse(storage.read_text(path))) is None:
        assert time.monotonic() < deadline, f"{path} never held a parseable lease"
        time.sleep(0.05)
    return holder


def test_renewed_lease_from_another_host_is_refused(run_dir):
    """A live driver elsewhere shows itself by renewing the lease: the newcomer exits."""
    elsewhere = Lease(run_dir, renew_s=0.5, host="another-host").acquire()
    try:
        with pytest.raises(LeaseHeld, match="pid .* on host another-host"):
            Lease(run_dir).acquire()
        assert current_holder(elsewhere.path).owner == elsewhere.owner
    finally:
        elsewhere.release()
