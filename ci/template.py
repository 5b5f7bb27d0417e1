"""Export one job as a standalone starter project.

    make template JOB=fsdp DEST=../my-fsdp-job

The export keeps the monorepo's layout, so job.yaml's paths (``containerfile``, ``entrypoint``)
work unchanged from ``DEST``:

    DEST/jobs/<job>/      main.py, Containerfile (copied); job.yaml, README.md (rewritten)
    DEST/shared/          only the modules the job imports, directly or indirectly
    DEST/ci/              setup.sh and loopback.sh (what the Makefile calls)
    DEST/pyproject.toml   the same exact pins, the starter's name and description, no test
                          paths; DEST/constraints.txt as in the monorepo
    DEST/Makefile         setup, run-local, submit, clean
    DEST/README.md        what it is and the first commands

What the copy says is rewritten for where it now lives: ``make`` commands take no ``JOB=``,
and a command, link or path the copy does not have (``make run-cluster``, ``tests/...``,
``compute_configs/...``, ``../ddp/README.md``) is dropped from command blocks and job.yaml's
comments, or named as the monorepo's in prose. ``dangling_references`` finds any that remain
(tests/unit/test_template.py runs it on every job's export).
"""

from __future__ import annotations

import argparse
import ast
import re
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

# A venv with only the anyscale CLI: nothing else is built while the token is in the environment.
build/anyscale-cli/.installed: constraints.txt
\tpython3 -m venv build/anyscale-cli
\tbuild/anyscale-cli/bin/python -m pip install --quiet -c constraints.txt \\
\t  $$(grep -E '^anyscale==' constraints.txt)
\t@touch $@

submit: build/anyscale-cli/.installed ## On Anyscale (ANYSCALE_CLI_TOKEN or `anyscale login`)
\tbuild/anyscale-cli/bin/anyscale job submit -f jobs/{job}/job.yaml \\
\t  $(if $(filter 1,$(WAIT)),--wait,)

clean: ## Remove runs and caches
\trm -rf runs .pytest_cache .ruff_cache
"""

JOB_YAML_HEADER = """\
# The {job} job on Anyscale. Submit from this project's root (paths below are relative to
# where the command runs):
#   anyscale job submit -f jobs/{job}/job.yaml [--wait]      (or: make submit [WAIT=1])
# compute_config is inline, because a path here would be looked up as a registered name.
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
`jobs/{job}/Containerfile` are the exact version set the monorepo tests. Where the job's README
mentions "the monorepo's" tests or targets (local multi-node runs, KubeRay), they live in
ray-train-templates, not in this copy.

Ray reports anonymous usage statistics from the clusters it starts; `export
RAY_USAGE_STATS_ENABLED=0` before `make run-local` turns that off.
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
    """The monorepo's pyproject renamed and described as the starter: same pins, same lint
    settings, no pytest section (its ``testpaths`` names the monorepo's tests, not copied)."""
    text = (REPO / "pyproject.toml").read_text()
    project = tomllib.loads(text)["project"]
    text = text.replace(f'name = "{project["name"]}"', f'name = "{job.replace("_", "-")}-starter"')
    text = text.replace(
        f'description = "{project["description"]}"',
        f'description = "The {job} training job on Ray Train, exported from ray-train-templates"',
    )
    return re.sub(r"\n\[tool\.pytest\.ini_options\]\n(?:.+\n)*?(?=\n\[|\Z)", "", text)


# ------------------------------------------------------------------------------------------
# what the copy's docs and job.yaml mention

MAKE_COMMAND = re.compile(r"\bmake ([a-z][a-z-]*)")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
BACKTICKED_PATH = re.compile(r"`([A-Za-z0-9_.][\w.\-]*/[\w.\-/]*)`")
# Unquoted paths into the project's layout: `compute_configs/4xT4.yaml`, ../ddp/README.md.
LAYOUT_DIRS = "jobs|shared|ci|tests|compute_configs|images|docs|benchmarks|\\.github"
BARE_PATH = re.compile(rf"(?<![\w/.`-])((?:\.\./)+[\w.\-/]*\w|(?:{LAYOUT_DIRS})/[\w.\-/]*\w)")
# Directories a run creates (runs/<job>/...), not files that ship.
GENERATED = ("runs/", "build/", ".venv/")


def make_targets(root: Path) -> set[str]:
    makefile = root / "Makefile"
    text = makefile.read_text() if makefile.exists() else ""
    return set(re.findall(r"^([a-z][a-z-]*):", text, flags=re.M))


def _path_exists(root: Path, doc: Path, path: str) -> bool:
    if "://" in path or path.startswith(GENERATED) or any(c in path for c in "<>*$"):
        return True
    root = root.resolve()
    for candidate in ((root / path).resolve(), (doc.parent / path).resolve()):
        if candidate.is_relative_to(root) and candidate.exists():
            return True  # inside the copy: a sibling folder of the copy does not count
    return False


def dangling_in_text(root: Path, doc: Path, text: str) -> list[str]:
    """Make targets, links and paths ``text`` (a part of ``doc``) names that ``root`` lacks."""
    missing = [f"make {t}" for t in MAKE_COMMAND.findall(text) if t not in make_targets(root)]
    for link in LINK.findall(text):
        if not _path_exists(root, doc, link):
            missing.append(link)
    for path in BACKTICKED_PATH.findall(text) + BARE_PATH.findall(text):
        if not _path_exists(root, doc, path):
            missing.append(path)
    return list(dict.fromkeys(missing))  # a link is also a bare path: name it once


def dangling_references(root: Path) -> list[str]:
    """``file: reference`` for every make target, relative link or path that the docs
    (``*.md``) and job.yaml files under ``root`` mention and ``root`` does not have."""
    problems = []
    docs = [p for p in root.rglob("*.md") if ".venv" not in p.parts]
    for doc in sorted(docs + list(root.glob("jobs/*/job.yaml"))):
        text = doc.read_text()
        if doc.name == "job.yaml":
            import yaml

            raw = yaml.safe_load(text)
            entry = raw["entrypoint"].split()
            named = [raw.get("containerfile"), raw.get("working_dir"), entry[1]]
            named += list(raw.get("py_modules") or []) + [raw.get("requirements")]
            problems += [f"{doc.relative_to(root)}: {p}" for p in named
                         if p and not (root / p).exists()]  # fmt: skip
            text = "\n".join(line for line in text.splitlines() if line.lstrip().startswith("#"))
        problems += [f"{doc.relative_to(root)}: {m}" for m in dangling_in_text(root, doc, text)]
    return problems


# ------------------------------------------------------------------------------------------
# rewriting the copied docs for the standalone context


def _rewrite_prose(line: str, root: Path, doc: Path, targets: set[str]) -> str:
    """A prose line: links to what the copy lacks become plain text, missing paths and make
    targets are named as the monorepo's."""

    def link(match: re.Match) -> str:
        return match[0] if _path_exists(root, doc, match[2]) else match[1]

    def path(match: re.Match) -> str:
        if _path_exists(root, doc, match[1]):
            return match[0]
        return f"the monorepo's `{match[1].rstrip('/').rsplit('/', 1)[-1]}`"

    def target(match: re.Match) -> str:
        name = match[1] or match[2]
        return match[0] if name in targets else f"the monorepo's `{name}` target"

    line = re.sub(r"\[([^\]]+)\]\(([^)\s#]+)(?:#[^)]*)?\)", link, line)
    line = BACKTICKED_PATH.sub(path, line)
    line = BARE_PATH.sub(path, line)
    # `make X ...` in backticks as one unit, or a bare make X
    return re.sub(r"`make ([a-z][a-z-]*)[^`]*`|\bmake ([a-z][a-z-]*)", target, line)


def standalone_text(text: str, job: str, root: Path, doc: Path) -> str:
    """``text`` (a README or job.yaml of ``job``) rewritten for the copy under ``root``:
    ``JOB=<job>`` dropped from make commands; lines of command blocks, and whole comment blocks
    of a YAML file, that name what the copy lacks dropped; prose pointing at the monorepo."""
    targets = make_targets(root)
    yaml_file = doc.suffix == ".yaml"
    text = re.sub(rf"(\bmake [a-z][a-z-]*) JOB={re.escape(job)}\b", r"\1", text)
    out, in_code, comments = [], False, []

    def flush_comments() -> None:
        if not dangling_in_text(root, doc, "\n".join(comments)):
            out.extend(comments)  # else: the block is about what the copy does not have
        comments.clear()

    for line in text.splitlines():
        stripped = line.lstrip()
        if yaml_file and stripped.startswith("#"):
            comments.append(line)
            continue
        flush_comments()
        if stripped.startswith("```"):
            in_code = not in_code
            out.append(line)
        elif in_code or yaml_file:
            if not dangling_in_text(root, doc, line):
                out.append(line)
        else:
            out.append(_rewrite_prose(line, root, doc, targets))
    flush_comments()
    return "\n".join(out) + "\n"


def standalone_job_yaml(job: str, root: Path) -> str:
    """The job's job.yaml without the monorepo's comments and excludes of folders the copy does
    not have; a header says how to submit it from the copy."""
    import yaml

    doc = root / "jobs" / job / "job.yaml"
    source = (REPO / "jobs" / job / "job.yaml").read_text()
    lines = source.splitlines()
    while lines and lines[0].startswith("#"):
        lines.pop(0)  # the monorepo's header; replaced below
    kept, in_excludes = [], False
    for line in lines:
        if re.match(r"^\w", line):
            in_excludes = line.startswith("excludes:")
        item = re.match(r"^\s+- (\S+)$", line) if in_excludes else None
        if item and _monorepo_only_exclude(item[1].strip('"'), root):
            continue
        kept.append(line)
    text = JOB_YAML_HEADER.format(job=job) + standalone_text("\n".join(kept), job, root, doc)
    # Only comments and excludes changed: the job Anyscale runs is the same.
    rewritten, original = yaml.safe_load(text), yaml.safe_load(source)
    if {**rewritten, "excludes": None} != {**original, "excludes": None}:
        raise RuntimeError(f"rewriting jobs/{job}/job.yaml changed more than its comments")
    return text


def _monorepo_only_exclude(pattern: str, root: Path) -> bool:
    """An exclude naming a monorepo folder the copy lacks (tests, docs, compute_configs ...);
    patterns and what any project has (.git, .venv, runs, build) stay."""
    if "*" in pattern or pattern in {".git", ".venv", "runs", "build"}:
        return False
    return not (root / pattern).exists()


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
    # Now that the copy's files exist, say only what is true there.
    job_dir = dest / "jobs" / job
    (job_dir / "job.yaml").write_text(standalone_job_yaml(job, dest))
    readme = job_dir / "README.md"
    readme.write_text(standalone_text(readme.read_text(), job, dest, readme))
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
