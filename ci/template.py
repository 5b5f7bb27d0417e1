"""Export one job as a standalone starter project.

    make template JOB=fsdp DEST=../my-fsdp-job

The export keeps the monorepo's layout, so every path in the job's files (job.yaml's
``containerfile`` and ``entrypoint``, the README's commands) works unchanged from ``DEST``:

    DEST/jobs/<job>/      main.py, job.yaml, Containerfile, README.md (copied)
    DEST/shared/          only the modules the job imports, directly or indirectly
    DEST/ci/              setup.sh and loopback.sh (what the Makefile calls)
    DEST/pyproject.toml   the same exact pins; DEST/constraints.txt likewise
    DEST/Makefile         setup, run-local, submit, clean
    DEST/README.md        what it is and the first commands
"""

from __future__ import annotations

import argparse
import ast
import shutil
import sys
import tomllib
from pathlib import Path

from ci.jobspec import REPO, JobSpecError, job_names

COPIED = ["ci/setup.sh", "ci/loopback.sh", "constraints.txt", ".gitignore"]

MAKEFILE = """\
# {job} starter, exported from the ray-train-templates monorepo.
# LOOPBACK_ONLY=1 runs Ray inside a loopback-only network namespace (ci/loopback.sh).
SHELL := /bin/bash
.DEFAULT_GOAL := help
PROFILE ?= smoke
ARGS ?=
PY := .venv/bin/python
NET := $(if $(filter 1,$(LOOPBACK_ONLY)),ci/loopback.sh,)

.PHONY: help setup run-local submit clean

help: ## Show the targets
\t@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{{printf "  %-10s %s\\n", $$1, $$2}}'

setup: .venv/.installed ## Create .venv with the pinned stack

.venv/.installed: pyproject.toml constraints.txt ci/setup.sh
\tci/setup.sh
\t@touch $@

run-local: setup ## Run on a local Ray cluster: make run-local [PROFILE=full] [ARGS="k=v ..."]
\t$(NET) $(PY) jobs/{job}/main.py --profile $(PROFILE) $(ARGS)

submit: setup ## Run on Anyscale (needs ANYSCALE_CLI_TOKEN or `anyscale login`)
\t.venv/bin/anyscale job submit -f jobs/{job}/job.yaml $(if $(filter 1,$(WAIT)),--wait,)

clean: ## Remove runs and caches
\trm -rf runs .pytest_cache .ruff_cache
"""

README = """\
# {job} starter

A standalone copy of the `{job}` job from the ray-train-templates monorepo: the job itself
([jobs/{job}/README.md](jobs/{job}/README.md)) and the part of the shared library it uses
(`shared/`: {modules}).

```bash
make run-local                    # smoke profile: tiny model, generated data, local Ray cluster
make run-local PROFILE=full       # the full profile (GPUs, data from the hub)
make submit                       # on Anyscale: anyscale job submit -f jobs/{job}/job.yaml
```

Change the model, data and strategy in `jobs/{job}/main.py` first; settings are `key=value`
(`python jobs/{job}/main.py --help`). The pins in `pyproject.toml`, `constraints.txt` and
`jobs/{job}/Containerfile` are the exact version set the monorepo tests.
"""


def shared_imports(path: Path) -> set[str]:
    """``shared.*`` modules a file imports anywhere (also inside functions)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules |= {a.name for a in node.names if a.name.split(".")[0] == "shared"}
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").split(".")[0] == "shared"
        ):
            modules.add(node.module)
            # `from shared.parallel import fsdp` names a module, not an attribute
            modules |= {f"{node.module}.{a.name}" for a in node.names}
    return modules


def module_file(module: str) -> Path | None:
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def needed_shared_files(job: str) -> list[Path]:
    """The transitive closure of the job's ``shared`` imports, plus package ``__init__``s."""
    todo, seen = [REPO / "jobs" / job / "main.py"], set()
    while todo:
        for module in shared_imports(todo.pop()):
            path = module_file(module)
            if path is not None and path not in seen:
                seen.add(path)
                todo.append(path)
    for path in list(seen):  # every package on the way needs its __init__.py
        for parent in path.relative_to(REPO).parents:
            init = REPO / parent / "__init__.py"
            if parent != Path(".") and init.exists():
                seen.add(init)
    return sorted(seen)


def pyproject(job: str) -> str:
    """The monorepo's pyproject with the project renamed: same pins, same tool settings."""
    text = (REPO / "pyproject.toml").read_text()
    name = tomllib.loads(text)["project"]["name"]
    return text.replace(f'name = "{name}"', f'name = "{job.replace("_", "-")}-starter"', 1)


def export(job: str, dest: Path) -> list[Path]:
    if job not in job_names():
        raise JobSpecError(f"unknown job '{job}'; valid jobs: {' '.join(job_names())}.")
    if dest.exists() and any(dest.iterdir()):
        raise JobSpecError(f"{dest} exists and is not empty; choose a new DEST.")
    files = [p for p in (REPO / "jobs" / job).iterdir() if p.is_file()]
    files += needed_shared_files(job) + [REPO / name for name in COPIED]
    for source in files:
        target = dest / source.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    modules = sorted(
        p.relative_to(REPO / "shared").as_posix()
        for p in files
        if p.is_relative_to(REPO / "shared") and p.name != "__init__.py"
    )
    (dest / "pyproject.toml").write_text(pyproject(job))
    (dest / "Makefile").write_text(MAKEFILE.format(job=job))
    (dest / "README.md").write_text(README.format(job=job, modules=", ".join(modules)))
    return sorted(p for p in dest.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Export one job as a standalone project.")
    parser.add_argument("--job", required=True)
    parser.add_argument("--dest", required=True, type=Path)
    args = parser.parse_args(argv)
    try:
        written = export(args.job, args.dest.resolve())
    except JobSpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {len(written)} files to {args.dest}; next: cd {args.dest} && make run-local")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
