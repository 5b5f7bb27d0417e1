"""The CI and telemetry settings a user cannot see fail until they cost something: where the
Anyscale token is visible, what the GitHub jobs run, what they upload, and that nothing the
tests or CI start reports Ray usage statistics."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import yaml
from conftest import REPO

from ci import anyscale_cli, jobspec
from ci.test_shards import shards

WORKFLOWS = REPO / ".github" / "workflows"


def workflow(name: str) -> dict:
    return yaml.safe_load((WORKFLOWS / name).read_text())


def steps_using_token(flow: dict) -> list[str]:
    """Where ANYSCALE_CLI_TOKEN is in the environment: workflow, job or step level."""
    places = ["workflow"] if "ANYSCALE_CLI_TOKEN" in flow.get("env", {}) else []
    for job_name, job in flow["jobs"].items():
        if "secrets.ANYSCALE_CLI_TOKEN" in yaml.safe_dump(job.get("env", {})):
            places.append(job_name)
        for step in job["steps"]:
            if "secrets.ANYSCALE_CLI_TOKEN" in yaml.safe_dump(step):
                places.append(f"{job_name}: {step.get('name') or step.get('run') or step['uses']}")
    return places


def test_the_anyscale_token_is_only_in_the_submit_step():
    flow = workflow("anyscale.yml")
    assert steps_using_token(flow) == ["submit: Submit"]
    (submit,) = [s for s in flow["jobs"]["submit"]["steps"] if s.get("name") == "Submit"]
    assert "make submit" in submit["run"]
    # The step before it installs the small CLI venv; no step builds the training venv.
    runs = " ".join(s.get("run", "") for s in flow["jobs"]["submit"]["steps"])
    assert "make anyscale-cli" in runs and "make setup" not in runs
    # and the old layout, token on the whole job, is what the check catches
    broken = {**flow, "jobs": {"submit": {**flow["jobs"]["submit"],
              "env": {"ANYSCALE_CLI_TOKEN": "${{ secrets.ANYSCALE_CLI_TOKEN }}"}}}}  # fmt: skip
    assert steps_using_token(broken) == ["submit", "submit: Submit"]


def test_make_submit_uses_a_venv_with_only_the_anyscale_cli():
    makefile = (REPO / "Makefile").read_text()
    (recipe,) = re.findall(r"^submit: (.*)\n\t(.*)", makefile, flags=re.M)
    assert recipe[0].split("##")[0].split() == ["anyscale-cli"]  # not `setup`
    assert recipe[1].startswith("$(SUBMIT_VENV)/bin/python -m ci.anyscale_cli submit")
    install = re.search(r"^\$\(SUBMIT_VENV\)/\.installed: .*\n((?:\t.*\n)+)", makefile, re.M)[1]
    assert "$(ANYSCALE_PIN)" in install and "-e" not in install.split()
    pin = re.search(r"^anyscale==\S+$", (REPO / "constraints.txt").read_text(), re.M)[0]
    assert pin == "anyscale==0.26.112"
    # What the submit path imports needs neither torch nor Ray (the CLI venv has neither).
    code = (
        "import sys, ci.anyscale_cli; "
        "assert not {'torch', 'ray', 'deepspeed'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_waiting_longer_than_the_workflow_may_run_is_refused(tmp_path):
    flow = workflow("anyscale.yml")
    job = flow["jobs"]["submit"]
    (submit,) = [s for s in job["steps"] if s.get("name") == "Submit"]
    max_wait_s = int(submit["env"]["MAX_WAIT_S"])
    assert max_wait_s < job["timeout-minutes"] * 60 <= 6 * 3600  # hosted runners stop at 6 h
    triggers = flow.get("on") or flow[True]  # YAML 1.1 reads a bare `on` key as true
    choices = triggers["workflow_dispatch"]["inputs"]["job"]["options"]
    assert sorted(choices) == jobspec.job_names()
    refused = {
        name
        for name in choices
        if anyscale_cli.wait_problem(name, jobspec.load(name).config.timeout_s, max_wait_s)
    }
    assert refused == {"tp2d"}  # 8 h; the others finish inside the workflow
    # Refused before anything is sent (a token is present, the check comes first).
    env = {**os.environ, "ANYSCALE_CLI_TOKEN": "not-a-real-token", "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "ci.anyscale_cli", "submit", "--job", "tp2d", "--wait",
         "--max-wait-s", str(max_wait_s)],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "timeout_s=28800 is longer than the 20700 s" in line and "without --wait" in line


def test_github_ci_runs_make_test_in_shards_that_cover_every_test_file():
    flow = workflow("ci.yml")
    test = flow["jobs"]["test"]
    count = len(test["strategy"]["matrix"]["shard"])
    (run,) = [s["run"] for s in test["steps"] if "run" in s]
    assert run.startswith("make test ") and f"ci/test_shards.py {count} " in run
    split = shards(count)
    files = [f for shard in split for f in shard]
    assert sorted(files) == sorted(
        p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py")
    )
    assert len(files) == len(set(files)) and all(split)
    assert {f.split("/")[1] for f in files} == {"unit", "dist", "e2e"}  # every tier on GitHub


@pytest.mark.parametrize("job_name", ["test", "smoke"])
def test_the_venv_is_cached_by_the_files_that_decide_it(job_name):
    steps = workflow("ci.yml")["jobs"][job_name]["steps"]
    (cache,) = [s for s in steps if s.get("uses", "").startswith("actions/cache@")]
    assert cache["with"]["path"] == ".venv"
    key = cache["with"]["key"]
    assert "hashFiles('constraints.txt', 'pyproject.toml', 'ci/setup.sh')" in key
    assert "steps.python.outputs.python-version" in key  # the venv links to that interpreter


def test_smoke_artifacts_leave_the_auth_token_out():
    steps = workflow("ci.yml")["jobs"]["smoke"]["steps"]
    (upload,) = [s for s in steps if s.get("uses", "").startswith("actions/upload-artifact@")]
    paths = upload["with"]["path"].splitlines()
    assert paths[0] == "runs/${{ matrix.job }}" and "!runs/**/ray-auth-token" in paths
    # the file it excludes is the one a local run writes
    assert '"ray-auth-token"' in (REPO / "shared" / "runtime" / "driver.py").read_text()


def test_nothing_ci_or_the_tests_start_reports_usage_statistics():
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "0"  # conftest, for every test process
    assert workflow("ci.yml")["env"]["RAY_USAGE_STATS_ENABLED"] == "0"
    assert workflow("kuberay.yml")["env"]["RAY_USAGE_STATS_ENABLED"] == "0"
    assert "export RAY_USAGE_STATS_ENABLED=0" in (REPO / ".ci" / "run").read_text()
    makefile = (REPO / "Makefile").read_text()
    assert "NO_USAGE_STATS := RAY_USAGE_STATS_ENABLED=0" in makefile
    assert re.search(r"^PYTEST := \$\(NO_USAGE_STATS\) ", makefile, flags=re.M)
    for target in ("test", "test-unit", "test-dist", "test-e2e", "validate"):
        recipe = re.search(rf"^{target}: .*\n\t(.*)", makefile, flags=re.M)[1]
        assert recipe.startswith(("$(NO_USAGE_STATS) ", "$(PYTEST) ")), target
    assert "RAY_USAGE_STATS_ENABLED=0" in (REPO / "README.md").read_text()  # how users opt out


def test_make_validate_runs_the_new_checks():
    makefile = (REPO / "Makefile").read_text()
    tests = re.search(r"^VALIDATE_TESTS := ((?:.*\\\n)*.*)$", makefile, flags=re.M)[1]
    for name in ("test_deploy", "test_kuberay", "test_pins", "test_ci_config", "test_template"):
        assert f"tests/unit/{name}.py" in tests
        assert (REPO / "tests" / "unit" / f"{name}.py").is_file()


def test_the_kind_workflow_outlasts_the_smoke_rayjobs_deadline():
    from ci import kuberay

    job = workflow("kuberay.yml")["jobs"]["kind-e2e"]
    run_kuberay_wait_s = kuberay.SMOKE_DEADLINE_S + kuberay.RUN_GRACE_S  # make run-kuberay
    # kind + the operator come up first (~5 min); the RayJob's own deadline ends it before.
    assert run_kuberay_wait_s + 10 * 60 <= job["timeout-minutes"] * 60
