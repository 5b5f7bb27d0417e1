"""Keep the jobs' Containerfiles in step with the one base definition in images/.

``images/requirements.txt`` is the pin list (equal to pyproject.toml, tests/test_pins.py) and
``images/Containerfile`` the base image. Anyscale builds a Containerfile as text, without a
build context, so the pins cannot be COPYed in: they are written into the file's
``pip install`` lines, and every job gets a copy (a job folder copied on its own still builds).

    make containerfiles        # after editing images/: rewrite images/ and jobs/*/Containerfile
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from ci.jobspec import REPO, job_names

BASE = REPO / "images" / "Containerfile"
REQUIREMENTS = REPO / "images" / "requirements.txt"
PIN_LINE = re.compile(r"^\s+[A-Za-z0-9_.\-\[\]]+==\S+( \\)?$")


def pinned_requirements() -> list[str]:
    lines = (line.split("#")[0].strip() for line in REQUIREMENTS.read_text().splitlines())
    return [line for line in lines if line]


def base_containerfile() -> str:
    """images/Containerfile with its ``pip install`` pin lines rewritten from requirements.txt."""
    lines = BASE.read_text().splitlines()
    pin_rows = [i for i, line in enumerate(lines) if PIN_LINE.match(line)]
    if not pin_rows:
        raise SystemExit(f"{BASE.relative_to(REPO)} has no indented 'name==version' pin lines.")
    pins = pinned_requirements()
    rendered = [f"      {pin}" + (" \\" if i < len(pins) - 1 else "") for i, pin in enumerate(pins)]
    lines[pin_rows[0] : pin_rows[-1] + 1] = rendered
    return "\n".join(lines) + "\n"


def job_containerfile(job: str) -> str:
    return (
        f"# jobs/{job}: a copy of images/Containerfile written by `make containerfiles`;\n"
        "# edit images/Containerfile or images/requirements.txt, not this file.\n"
        + base_containerfile()
    )


def expected_files() -> dict[Path, str]:
    files = {BASE: base_containerfile()}
    for job in job_names():
        files[REPO / "jobs" / job / "Containerfile"] = job_containerfile(job)
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description="Rewrite the Containerfiles from images/.")
    parser.add_argument("--check", action="store_true", help="only report files out of date")
    args = parser.parse_args()
    expected = expected_files()
    stale = [p for p, text in expected.items() if not p.exists() or p.read_text() != text]
    names = ", ".join(str(p.relative_to(REPO)) for p in stale) or "none"
    if args.check:
        if stale:
            raise SystemExit(f"out of date, run `make containerfiles`: {names}")
        print("Containerfiles are up to date")
        return
    for path in stale:
        path.write_text(expected[path])
    print(f"rewritten: {names}")


if __name__ == "__main__":
    main()
