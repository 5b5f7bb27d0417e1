"""Python stacks of a running job's driver and train workers: ``make stack JOB=ddp``.

The first thing to look at when a job hangs: every process's current Python stack shows
who waits in which collective (or data iterator, or checkpoint write) and who never got there.

How it finds the processes: the driver and every train worker write one small JSON file
into ``<run_dir>/processes/`` (for a run on object storage: the node-local mirror of the run
directory, see ``storage.node_local_dir``) when they start (:func:`register_process`); this
command picks the newest run of the job whose driver is still alive (or ``--run NAME``) and runs
``py-spy dump --pid`` on each process that lives on this machine. No Ray connection is
needed, so it works when Ray itself is stuck. Unlike ``ray stack`` it dumps only this job's
processes, not every Ray worker on the machine.

py-spy reads another process's memory (ptrace): it works as the same user where ptrace is
allowed (containers running as root, most CI); elsewhere run ``sudo make stack ...``. For
processes on other nodes it prints the command to run there (or use the Ray dashboard's
"Stack Trace" link on the worker's row).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys

import psutil

from shared.storage import node_local_dir

PROCESSES_DIR = "processes"
DRIVER = "driver"


def register_process(run_dir: str, role: str) -> None:
    """Record this process (``driver`` or ``rank<r>``) for ``make stack``. A restarted worker
    group overwrites its ranks' files. Best effort: never fails the job."""
    # Process ids only mean something on their node: for a run on object storage the records
    # go to this node's mirror of the run directory (storage.node_local_dir).
    run_dir = node_local_dir(run_dir)
    me = psutil.Process()
    record = {
        "role": role,
        "pid": me.pid,
        "host": socket.gethostname(),
        "started": me.create_time(),
    }
    try:
        directory = os.path.join(run_dir, PROCESSES_DIR)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{role}.json.tmp")
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(directory, f"{role}.json"))
    except OSError as err:
        print(f"warning: could not register {role} for `make stack`: {err}", file=sys.stderr)


def read_processes(run_dir: str) -> list[dict]:
    """The registered processes, driver first, then ranks in order."""
    directory = os.path.join(run_dir, PROCESSES_DIR)
    if not os.path.isdir(directory):
        return []
    records = []
    for name in os.listdir(directory):
        if name.endswith(".json") and not name.startswith("."):
            with open(os.path.join(directory, name)) as f:
                records.append(json.load(f))

    def order(record: dict) -> tuple[int, int]:
        role = record["role"]
        return (0, 0) if role == DRIVER else (1, int(role.removeprefix("rank") or 0))

    return sorted(records, key=order)


def is_running(record: dict) -> bool:
    """Alive on this host and the same process (a reused PID has another start time)."""
    if record["host"] != socket.gethostname():
        return False
    try:
        return abs(psutil.Process(record["pid"]).create_time() - record["started"]) < 1.0
    except psutil.Error:
        return False


def find_running_run(job_dir: str) -> str | None:
    """The newest run directory under ``job_dir`` whose driver is alive on this host."""
    if not os.path.isdir(job_dir):
        return None
    candidates = []
    for name in os.listdir(job_dir):
        driver = os.path.join(job_dir, name, PROCESSES_DIR, f"{DRIVER}.json")
        if os.path.exists(driver):
            with open(driver) as f:
                if is_running(json.load(f)):
                    candidates.append((os.path.getmtime(driver), os.path.join(job_dir, name)))
    return max(candidates)[1] if candidates else None


def py_spy() -> str | None:
    """py-spy from this venv (pinned), else from PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    return beside if os.access(beside, os.X_OK) else shutil.which("py-spy")


def dump(record: dict, pyspy: str, native: bool) -> str:
    """py-spy's stack dump of one process (all its threads), or why there is none."""
    if record["host"] != socket.gethostname():
        return (f"on host {record['host']}: run `py-spy dump --pid {record['pid']}` there, "
                "or use the Ray dashboard's Stack Trace for that worker")  # fmt: skip
    if not is_running(record):
        return "not running"
    cmd = [pyspy, "dump", "--pid", str(record["pid"])] + (["--native"] if native else [])
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "py-spy did not finish within 60 s (the process may be stuck in the kernel)"
    if proc.returncode != 0:
        hint = " (no permission to trace it? try with sudo)" if "ermission" in proc.stderr else ""
        return f"py-spy failed{hint}: {proc.stderr.strip() or proc.stdout.strip()}"
    return proc.stdout.rstrip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make stack", description=__doc__.splitlines()[0])
    parser.add_argument("--job", required=True, help="job name (folder under jobs/)")
    parser.add_argument("--run", default="", help="run name; default: the newest running one")
    parser.add_argument("--storage", default="runs", help="storage_path the job runs with")
    parser.add_argument("--native", action="store_true", help="include C/C++ frames")
    args = parser.parse_args(argv)

    job_dir = node_local_dir(os.path.join(args.storage, args.job))
    run_dir = os.path.join(job_dir, args.run) if args.run else find_running_run(job_dir)
    if run_dir is None:
        print(f"error: no running {args.job} job found under {job_dir}/ (is it running, with "
              f"this storage_path?)", file=sys.stderr)  # fmt: skip
        return 1
    records = read_processes(run_dir)
    if not records:
        print(f"error: {run_dir} has no {PROCESSES_DIR}/ records", file=sys.stderr)
        return 1
    pyspy = py_spy()
    if pyspy is None:
        print("error: py-spy is not installed (it is pinned in pyproject.toml)", file=sys.stderr)
        return 1
    print(f"stacks of {run_dir}")
    for record in records:
        print(f"\n== {record['role']} (pid {record['pid']})")
        print(dump(record, pyspy, args.native), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
