"""The Anyscale side of the Makefile: submit a job, register the compute-config catalogue.

    make submit JOB=zero [WAIT=1]   # anyscale job submit -f jobs/zero/job.yaml [--wait]
    make compute-configs            # anyscale compute-config create -f compute_configs/X.yaml -n X

Both stop with one line saying how to log in when there are no credentials, instead of the
CLI's traceback. Run from the repository root: job.yaml paths are relative to it. ``make submit``
runs this from a small venv with only the ``anyscale`` CLI (build/anyscale-cli), so no training
package is built while the token is in the environment. ``--max-wait-s`` (the GitHub workflow
passes its own limit) refuses ``--wait`` for a job whose ``timeout_s`` could outlast the waiter.
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
    "no Anyscale credentials: run `build/anyscale-cli/bin/anyscale login` (after `make "
    "anyscale-cli`) or export ANYSCALE_CLI_TOKEN (an API key from the Anyscale console)."
)


def has_credentials() -> bool:
    return bool(os.environ.get("ANYSCALE_CLI_TOKEN")) or CREDENTIALS_FILE.exists()


def anyscale(*args: str) -> int:
    cli = str(Path(sys.executable).with_name("anyscale"))
    return subprocess.run([cli, *args], cwd=REPO).returncode


def wait_problem(job: str, timeout_s: int, max_wait_s: float) -> str | None:
    """One sentence when waiting for the job could outlast the caller's own limit."""
    if max_wait_s and timeout_s > max_wait_s:
        return (
            f"jobs/{job}/job.yaml's timeout_s={timeout_s} is longer than the {max_wait_s:.0f} s "
            "this caller can wait; submit without --wait (WAIT=) and follow it with "
            f"`anyscale job status --name {job.replace('_', '-')}`."
        )
    return None


def submit(job: str, wait: bool, max_wait_s: float = 0) -> int:
    spec = load(job)  # a job.yaml the SDK cannot parse fails here, with the file named
    if wait and (problem := wait_problem(job, spec.config.timeout_s, max_wait_s)):
        raise JobSpecError(problem)
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
    submit_parser.add_argument(
        "--max-wait-s",
        type=float,
        default=0,
        help="refuse --wait when job.yaml's timeout_s exceeds this",
    )
    sub.add_parser("compute-configs")
    args = parser.parse_args(argv)
    if not has_credentials():
        print(f"error: {LOGIN_HINT}", file=sys.stderr)
        return 2
    try:
        if args.command == "submit":
            return submit(args.job, args.wait, args.max_wait_s)
        return register_compute_configs()
    except JobSpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
