"""Keep the jobs' Containerfiles in step with the one base definition in images/.

``images/requirements.txt`` is the pin list (equal to pyproject.toml, tests/unit/test_pins.py) and
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

# The CUDA major of PyPI's default (manylinux x86_64) torch wheel, by version: what pip's
# `pip --isolated install --dry-run --report torch==X` resolves (2.13.0 requires
# cuda-toolkit==13.0.3, nvidia-nccl-cu13, nvidia-cudnn-cu13). Add a line when bumping torch.
PYPI_TORCH_CUDA_MAJOR = {"2.13.0": 13}
TORCH_INDEX = re.compile(r"--(?:extra-)?index-url[ =]\S*/whl/(cpu|cu\d+)\b")


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


def _cuda_major(tag: str) -> int:
    """``cu128`` -> 12, ``cu130`` -> 13 (the last digit is the minor version)."""
    return int(tag[2:-1])


def base_cuda_major(containerfile: str) -> int | None:
    """The CUDA major of the ``FROM`` image's tag (``...-cu130`` -> 13); None for a CPU image."""
    (base,) = re.findall(r"^FROM (\S+)", containerfile, flags=re.M)
    match = re.search(r"-(cu\d{3})$", base)
    return _cuda_major(match[1]) if match else None


def torch_cuda_major(containerfile: str) -> int | None:
    """The CUDA major of the torch build the Containerfile installs: from a local version
    (``torch==2.13.0+cu128``), a PyTorch wheel index (``--index-url .../whl/cu128``), or else
    PyPI's default build of that version. None for a CPU build."""
    (version,) = re.findall(r"\btorch==(\S+?)(?:\s|\\|$)", containerfile)
    version, _, local = version.partition("+")
    index = TORCH_INDEX.search(containerfile)
    build = local or (index[1] if index else "")
    if build == "cpu":
        return None
    if build.startswith("cu"):
        return _cuda_major(build)
    if version not in PYPI_TORCH_CUDA_MAJOR:
        raise SystemExit(
            f"torch=={version}: which CUDA major PyPI's wheel needs is unknown; add it to "
            "ci/images.py PYPI_TORCH_CUDA_MAJOR (pip --isolated install --dry-run --report)."
        )
    return PYPI_TORCH_CUDA_MAJOR[version]


def cuda_mismatch(containerfile: str) -> str | None:
    """One sentence when the base image's CUDA and torch's CUDA differ, else None."""
    base, torch = base_cuda_major(containerfile), torch_cuda_major(containerfile)
    if base == torch:
        return None
    return (
        f"the base image is CUDA {base or 'none (CPU)'} but torch is installed as a CUDA "
        f"{torch or 'none (CPU)'} build: DeepSpeed refuses to JIT-build its ops when nvcc's "
        "major differs from torch's, and the driver must support the newer one."
    )


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
