"""One driver per run: a lease file in the run directory (local disk or object storage).

Two drivers training into one run directory corrupt each other (one deletes the other's
checkpoints, both register results). So before any cluster starts the driver takes
``<run_dir>/driver.lease``: who holds it (a random owner id, host, pid) and until when. A
heartbeat thread renews it every ``LEASE_RENEW_S``; the driver removes it at the end.

A second driver for the same run finds the lease and decides:

* held by a live process on this host (pid and start time match): exit 2 at once;
* held by a process on this host that is gone (a killed driver): take it over at once;
* expired (not renewed for ``LEASE_TTL_S``): take it over;
* held from another host and not expired: watch it for one renewal period; a renewal means
  that driver is alive (exit 2), none means it is gone and the lease is taken over when it
  expires (an Anyscale job retry on a new head node waits here at most ``LEASE_TTL_S``).

Atomicity. On local disk (and NFS with working locks) the read-decide-write runs under an
``flock`` on a lock file beside the lease, so two drivers cannot both win. Object stores
offer no create-if-absent through pyarrow, so there the driver writes its lease, waits
``SETTLE_S`` and reads it back: only the driver whose owner id is in the object goes on. The
race this accepts: two drivers whose writes are more than ``SETTLE_S`` apart yet both read
"free" before either wrote, i.e. two drivers started within about a second of each other
for the same run on object storage. The loser then finds someone else's owner id at its first
renewal and stops its run (it interrupts the main thread with one error line).
"""

from __future__ import annotations

import _thread
import contextlib
import dataclasses
import fcntl
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import psutil

from shared import storage
from shared.config import ConfigError

LEASE_FILE = "driver.lease"
LEASE_TTL_S = 60.0  # a lease not renewed for this long belongs to a dead driver
LEASE_RENEW_S = 10.0  # heartbeat period (well inside the TTL)
SETTLE_S = 1.0  # object storage: wait before reading our write back


class LeaseHeld(ConfigError):
    """Another live driver holds the run (exit 2: it is a usage error, not a failure)."""


@dataclass
class Holder:
    """What a lease file says."""

    owner: str
    host: str
    pid: int
    pid_started: float  # the process's start time: a reused pid is another process
    expires: float  # wall-clock seconds
    renewed: float
    run: str = ""

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            data = json.loads(text)
            return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})
        except (ValueError, TypeError, KeyError):
            return None  # a torn or foreign file: treat as free

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host}"


def _this_process() -> tuple[str, int, float]:
    me = psutil.Process()
    return socket.gethostname(), me.pid, me.create_time()


def _alive_here(holder: Holder) -> bool:
    """The holder is a process on this host that still runs (not a reused pid)."""
    try:
        return abs(psutil.Process(holder.pid).create_time() - holder.pid_started) < 1.0
    except psutil.Error:
        return False


class Lease:
    """The lease of one run directory. ``acquire`` raises :class:`LeaseHeld` if it is taken."""

    def __init__(self, run_dir: str, ttl_s: float = LEASE_TTL_S, renew_s: float = LEASE_RENEW_S,
                 host: str | None = None):  # fmt: skip
        self.run_dir = run_dir
        self.path = storage.join(run_dir, LEASE_FILE)
        self.ttl_s = ttl_s
        self.renew_s = renew_s
        real_host, self.pid, self.pid_started = _this_process()
        self.host = host or real_host  # a test may stand in for a driver on another host
        self.owner = uuid.uuid4().hex
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.held = False

    # --- reading and writing -------------------------------------------------------------

    def read(self) -> Holder | None:
        try:
            return Holder.parse(storage.read_text(self.path))
        except FileNotFoundError:
            return None
        except OSError:
            if not storage.exists(self.path):
                return None
            raise

    def _write(self) -> None:
        now = time.time()
        holder = Holder(self.owner, self.host, self.pid, self.pid_started, now + self.ttl_s, now,
                        run=self.run_dir)  # fmt: skip
        storage.write_text(self.path, json.dumps(dataclasses.asdict(holder)) + "\n")

    @contextlib.contextmanager
    def _local_lock(self):
        """Local disk: serialise read-decide-write between drivers on this host (and NFS)."""
        if storage.is_remote(self.path):
            yield
            return
        directory = storage.local_path(self.run_dir)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f".{LEASE_FILE}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    # --- taking it ---------------------------------------------------------------------

    def _refuse(self, holder: Holder) -> LeaseHeld:
        return LeaseHeld(
            f"run {self.run_dir} is already being trained by another driver "
            f"({holder.describe()}, lease renewed {time.time() - holder.renewed:.0f} s ago); "
            f"wait for it to finish, stop it, or choose another run_name."
        )

    def _free_or_dead(self, holder: Holder | None) -> bool:
        """Whether the lease can be taken now; raises LeaseHeld for a live holder."""
        if holder is None or holder.owner == self.owner:
            return True
        if holder.host == self.host:
            if _alive_here(holder):
                raise self._refuse(holder)
            print(f"taking over the lease of {self.run_dir}: the driver that held it "
                  f"({holder.describe()}) is gone", flush=True)  # fmt: skip
            return True
        if time.time() > holder.expires:
            print(f"taking over the lease of {self.run_dir}: it expired "
                  f"{time.time() - holder.expires:.0f} s ago ({holder.describe()})",
                  flush=True)  # fmt: skip
            return True
        return False

    def _watch_other_host(self, holder: Holder) -> None:
        """Held from another host, not expired: alive if it is renewed, else wait it out."""
        print(f"the lease of {self.run_dir} is held by {holder.describe()}; waiting up to "
              f"{max(0.0, holder.expires - time.time()):.0f} s to see whether that driver is "
              "alive", flush=True)  # fmt: skip
        while True:
            time.sleep(min(1.0, self.renew_s / 4))
            now_holder = self.read()
            if now_holder is None or now_holder.owner != holder.owner:
                return  # released or taken: decide again
            if now_holder.renewed > holder.renewed:
                raise self._refuse(now_holder)
            if time.time() > now_holder.expires:
                return

    def acquire(self) -> Lease:
        while True:
            with self._local_lock():
                holder = self.read()
                if self._free_or_dead(holder):
                    self._write()
                    break
            self._watch_other_host(holder)
        if storage.is_remote(self.path):  # no create-if-absent: read our write back
            time.sleep(SETTLE_S)
            holder = self.read()
            if holder is None or holder.owner != self.owner:
                if holder is not None:
                    raise self._refuse(holder)
                raise LeaseHeld(f"run {self.run_dir}: the lease vanished while it was being "
                                "taken; another driver is starting the same run.")  # fmt: skip
        self.held = True
        self._thread = threading.Thread(target=self._heartbeat, name="run-lease", daemon=True)
        self._thread.start()
        return self

    # --- keeping and giving it back ------------------------------------------------------

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                with self._local_lock():
                    holder = self.read()
                    if holder is not None and holder.owner != self.owner:
                        self.held = False
                        print(f"error: the lease of {self.run_dir} was taken by "
                              f"{holder.describe()}; stopping this driver so that only one "
                              "trains the run", file=sys.stderr, flush=True)  # fmt: skip
                        _thread.interrupt_main()
                        return
                    self._write()
            except OSError as err:  # storage hiccup: try again at the next beat
                print(f"warning: could not renew the lease of {self.run_dir}: {err}",
                      file=sys.stderr, flush=True)  # fmt: skip

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still ours. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not self.held:
            return
        self.held = False
        try:
            with self._local_lock():
                holder = self.read()
                if holder is not None and holder.owner == self.owner:
                    storage.remove(self.path)
        except OSError as err:
            print(f"warning: could not release the lease of {self.run_dir}: {err} (it expires "
                  f"in {self.ttl_s:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip


def run_lease(cfg) -> Lease:
    """Take the lease of ``cfg.run_dir`` or exit 2 with one sentence (before any cluster)."""
    try:
        return Lease(cfg.run_dir).acquire()
    except LeaseHeld as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
