"""The Anyscale side of the Makefile: submit a job, register the compute-config catalogue.

    make submit JOB=zero [WAIT=1]   # anyscale job submit -f jobs/zero/job.yaml [--wait]
    make compute-configs            # anyscale compute-config create -f compute_configs/X.yaml -n X

Both stop with one line saying how to log in when there are no credentials, instead of the
CLI's traceback. Run from the repository root: job.yaml paths are relative to it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from ci.jobspec import REPO, JobSpecError, load

CREDENTIALS_FILE = Path.home() / ".anyscale" / "credentials.json"
LOGIN_HINT = (
    "no Anyscale credentials: run `.venv/bin/anyscale login` or export ANYSCALE_CLI_TOKEN "
    "(an API key from the Anyscale console)."
)


def has_credentials() -> bool:
    return bool(os.environ.get("ANYSCALE_CLI_TOKEN")) or CREDENTIALS_FILE.exists()


def anyscale(*args: str) -> int:
    cli = str(Path(sys.executable).with_name("anyscale"))
    return subprocess.run([cli, *args], cwd=REPO).returncode


def submit(job: str, wait: bool) -> int:
    load(job)  # a job.yaml the SDK cannot parse fails here, with the file named
    return anyscale("job", "submit", "-f", f"jobs/{job}/job.yaml", *(["--wait"] if wait else []))


def register_compute_configs() -> int:
    """Create (or add a new version of) each catalogue entry under its file name."""
    for path in sorted((REPO / "compute_configs").glob("*.yaml")):
        status = anyscale("compute-config", "create", "-f", str(path.relative_to(REPO)),
                          "-n", path.stem)  # fmt: skip
        if status != 0:
            return status
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    submit_parser = sub.add_parser("submit")
    submit_parser.add_argument("--job", required=True)
    submit_parser.add_argument("--wait", action="store_true")
    sub.add_parser("compute-configs")
    args = parser.parse_args(argv)
    if not has_credentials():
        print(f"error: {LOGIN_HINT}", file=sys.stderr)
        return 2
    try:
        if args.command == "submit":
            return submit(args.job, args.wait)
        return register_compute_configs()
    except JobSpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
