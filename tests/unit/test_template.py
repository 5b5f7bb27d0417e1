"""`make template` copies: what the copy's docs and job.yaml say is true in the copy - every
make target, link and path they mention exists there - and its pyproject describes the copy."""

from __future__ import annotations

import shutil
import tomllib

import pytest
from anyscale.job.models import JobConfig
from conftest import REPO

from ci import jobspec, template

JOBS = jobspec.job_names()


@pytest.fixture(scope="module", params=JOBS)
def export(request, tmp_path_factory):
    job = request.param
    dest = tmp_path_factory.mktemp("starters") / f"my-{job}"
    template.export(job, dest)
    return job, dest


def test_every_target_link_and_path_the_copy_mentions_exists_in_it(export):
    job, dest = export
    assert template.dangling_references(dest) == []
    readme = (dest / "jobs" / job / "README.md").read_text()
    assert f"JOB={job}" not in readme  # the copy's Makefile has no JOB
    assert "make run-local" in readme  # the commands that do work are kept


def test_the_monorepos_docs_copied_as_they_are_would_be_caught(export):
    """The old export: README and job.yaml copied unchanged."""
    job, dest = export
    broken = dest.parent / f"broken-{job}"
    shutil.copytree(dest, broken)
    for name in ("README.md", "job.yaml"):
        shutil.copy(REPO / "jobs" / job / name, broken / "jobs" / job / name)
    found = template.dangling_references(broken)
    assert f"jobs/{job}/README.md: make run-cluster" in found
    assert f"jobs/{job}/README.md: make template" in found
    assert any(f.startswith(f"jobs/{job}/job.yaml: compute_configs/") for f in found)
    if job == "fsdp":
        assert "jobs/fsdp/README.md: ../ddp/README.md" in found
    if job == "tp2d":
        assert "jobs/tp2d/README.md: tests/dist/test_tp.py" in found


def test_the_copys_job_yaml_runs_the_same_job(export):
    job, dest = export
    copy = JobConfig.from_yaml(str(dest / "jobs" / job / "job.yaml"))
    original = jobspec.load(job).config
    assert copy.entrypoint == original.entrypoint and copy.compute_config == original.compute_config
    assert copy.timeout_s == original.timeout_s and copy.env_vars == original.env_vars
    assert (dest / copy.containerfile).is_file()
    assert set(copy.excludes) < set(original.excludes)
    assert {"tests", "docs", "compute_configs", "images"}.isdisjoint(copy.excludes)


def test_the_copys_pyproject_describes_the_copy(export):
    job, dest = export
    copy = tomllib.loads((dest / "pyproject.toml").read_text())
    monorepo = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert copy["project"]["name"] == f"{job.replace('_', '-')}-starter"
    assert copy["project"]["description"] != monorepo["project"]["description"]
    assert job in copy["project"]["description"]
    assert "pytest" not in copy.get("tool", {})  # no testpaths naming tests it does not have
    assert copy["project"]["dependencies"] == monorepo["project"]["dependencies"]
    assert not (dest / "tests").exists()


def test_a_path_outside_the_copy_does_not_count(tmp_path):
    (tmp_path / "ddp").mkdir()
    (tmp_path / "ddp" / "README.md").write_text("x")
    copy = tmp_path / "copy"
    (copy / "jobs" / "fsdp").mkdir(parents=True)
    (copy / "Makefile").write_text("run-local: ## run\n")
    doc = copy / "jobs" / "fsdp" / "README.md"
    doc.write_text("See [ddp](../../../ddp/README.md); `make run-local`, `make bench`.\n")
    assert template.dangling_references(copy) == [
        "jobs/fsdp/README.md: make bench",
        "jobs/fsdp/README.md: ../../../ddp/README.md",
    ]


def test_the_copys_submit_builds_only_the_anyscale_cli(export):
    """As in the monorepo: no training package is built while the token is in the environment."""
    import re

    _, dest = export
    makefile = (dest / "Makefile").read_text()
    prerequisites = re.search(r"^submit: ([^#\n]*)", makefile, flags=re.M)[1].split()
    assert prerequisites == ["build/anyscale-cli/.installed"]
    install = re.search(r"^build/anyscale-cli/\.installed: .*\n((?:\t.*\n)+)", makefile, re.M)[1]
    assert "grep -E '^anyscale==' constraints.txt" in install and "-e" not in install.split()
