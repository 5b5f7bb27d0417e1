"""Offline validation of everything Anyscale reads: job.yaml, compute configs, workspace.yaml,
Containerfiles - through the anyscale SDK's own models, plus the checks the SDK leaves to the
server (paths relative to the repo root, one image source, compute configs that fit)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml
from anyscale.compute_config.models import ComputeConfig, compute_config_type_from_yaml
from anyscale.job.models import JobConfig
from anyscale.workspace.models import WorkspaceConfig
from conftest import REPO

from ci import images, jobspec
from unit.test_pins import pyproject_pins

JOBS = jobspec.job_names()
CATALOGUE = {p.stem: p for p in (REPO / "compute_configs").glob("*.yaml")}
REQUIRED_EXCLUDES = {".git", ".venv", "runs", "tests"}


def test_every_job_folder_is_complete():
    assert set(JOBS) == {"ddp", "env_check", "fault_tolerance", "fsdp", "tp2d", "zero"}
    for job in JOBS:
        for name in ("main.py", "job.yaml", "Containerfile", "README.md"):
            assert (REPO / "jobs" / job / name).is_file(), f"jobs/{job}/{name}"


# ------------------------------------------------------------------------------------------
# job.yaml


@pytest.fixture(scope="module", params=JOBS)
def spec(request):
    return jobspec.load(request.param)


@pytest.fixture(scope="module")
def full_settings(spec):
    """The job's resolved full-profile settings (one `main.py --print-config` per job)."""
    return spec.settings()


def test_job_yaml_is_a_valid_anyscale_job_config(spec):
    assert isinstance(spec.config, JobConfig)
    assert spec.config.name == spec.job.replace("_", "-")
    # The SDK accepts both and lets the server pick; one image source is the only sane input.
    assert spec.config.containerfile and not spec.config.image_uri


def test_job_yaml_paths_resolve_from_the_repo_root(spec):
    cfg = spec.config
    assert cfg.containerfile == f"jobs/{spec.job}/Containerfile"
    assert (REPO / cfg.containerfile).is_file()
    assert cfg.working_dir == "." and (REPO / cfg.working_dir).is_dir()
    for path in [*(cfg.py_modules or []), *([cfg.requirements] if cfg.requirements else [])]:
        assert (REPO / path).exists(), path
    assert set(cfg.excludes) >= REQUIRED_EXCLUDES
    # The shipped code must still contain the job and the library.
    assert not {"jobs", "shared"} & set(cfg.excludes)


def test_job_yaml_sets_retries_timeout_and_string_env_vars_deliberately(spec):
    assert "max_retries" in spec.raw and "timeout_s" in spec.raw  # not the SDK's silent default
    assert 0 <= spec.config.max_retries <= 3
    assert 600 <= spec.config.timeout_s <= 24 * 3600
    assert all(isinstance(v, str) for v in spec.raw["env_vars"].values())
    assert spec.config.env_vars["RAY_TRAIN_V2_ENABLED"] == "1"


def test_job_yaml_runs_the_full_profile_of_its_own_job(spec, full_settings):
    argv = shlex.split(spec.config.entrypoint)
    assert argv[:2] == ["python", f"jobs/{spec.job}/main.py"]
    assert spec.profile == "full"
    # The job's own parser accepted every setting.
    assert full_settings["job"] == spec.job and full_settings["profile"] == "full"


def test_inline_compute_config_mirrors_its_catalogue_entry(spec):
    assert isinstance(spec.raw["compute_config"], dict), "a file path would be taken as a name"
    name = spec.compute_config_name
    assert name in CATALOGUE, f"tag {jobspec.COMPUTE_CONFIG_TAG}={name} names no catalogue file"
    assert spec.config.compute_config == compute_config_type_from_yaml(str(CATALOGUE[name]))


def worker_groups(compute_config) -> list[tuple[str, int]]:
    return [(g.instance_type, g.max_nodes) for g in compute_config.worker_nodes]


def test_full_profile_fits_the_compute_config(spec, full_settings):
    groups = worker_groups(spec.config.compute_config)
    assert jobspec.fit_problems(full_settings, groups) == []
    if full_settings["use_gpu"]:  # and the numbers behind it, from the instance-type table
        node = jobspec.instance_type(groups[0][0])
        assert full_settings["num_workers"] <= node.gpus * groups[0][1]
        assert full_settings["cpus_per_worker"] * node.gpus < node.vcpus
        assert node.gpus % full_settings.get("tp", 1) == 0


def test_a_job_that_does_not_fit_its_node_is_caught():
    """The deliberately broken copies: each check fails on its own defect."""
    ddp = jobspec.load("ddp").settings()  # 4 GPUs, cpus_per_worker=8
    one_t4 = worker_groups(compute_config_type_from_yaml(str(CATALOGUE["1xT4"])))
    (problem,) = jobspec.fit_problems({**ddp, "num_workers": 1}, one_t4)
    assert problem.startswith("1 workers x cpus_per_worker=8 + 1 CPU for Ray Data = 9 vCPUs")
    assert "g4dn.xlarge (4 vCPUs)" in problem
    assert "needs 4 GPUs; the compute config has 1" in jobspec.fit_problems(ddp, one_t4)[0]
    tp2d = jobspec.load("tp2d").settings()  # tp=4 on 2 x g6.12xlarge
    two_l4_nodes = worker_groups(compute_config_type_from_yaml(str(CATALOGUE["2x4xL4"])))
    assert jobspec.fit_problems(tp2d, two_l4_nodes) == []
    (problem,) = jobspec.fit_problems({**tp2d, "tp": 8, "dp": 1}, two_l4_nodes)
    assert (
        problem
        == "tp=8 does not divide a g6.12xlarge's 4 GPUs, so a TP group would span two nodes."
    )
    (problem,) = jobspec.fit_problems({**tp2d, "tp": 3}, two_l4_nodes)
    assert "tp=3 does not divide" in problem
    smoke = {"num_workers": 4, "cpus_per_worker": 2, "use_gpu": False}
    assert (
        "9 vCPUs do not fit the worker nodes' 8 vCPUs"
        in jobspec.fit_problems(smoke, [("m5.2xlarge", 1)])[0]
    )


def test_the_1xt4_recipe_in_the_catalogue_readme_fits():
    """compute_configs/README.md says which settings a full profile needs on 1xT4."""
    readme = (REPO / "compute_configs" / "README.md").read_text()
    (row,) = [line for line in readme.splitlines() if line.startswith("| `1xT4`")]
    overrides = re.findall(r"`(\w+=[^`]+)`", row)
    assert {o.split("=")[0] for o in overrides} >= {"num_workers", "cpus_per_worker"}
    one_t4 = worker_groups(compute_config_type_from_yaml(str(CATALOGUE["1xT4"])))
    for job in ("ddp", "fsdp", "zero", "fault_tolerance"):
        settings = jobspec.load(job).settings(overrides=overrides)
        assert jobspec.fit_problems(settings, one_t4) == [], job


def test_instance_type_table_is_complete_and_in_the_readme():
    types = jobspec.instance_types()
    used = set()
    for path in CATALOGUE.values():
        config = compute_config_type_from_yaml(str(path))
        used |= {config.head_node.instance_type, *(g.instance_type for g in config.worker_nodes)}
    assert used <= set(types)
    readme = (REPO / "compute_configs" / "README.md").read_text()
    for node in types.values():
        row = (f"| `{node.name}` | {node.vcpus} | {node.gpus} | {node.gpu_model or '-'} | "
               f"{node.gpu_memory_gib or '-'} | {node.ram_gib} |")  # fmt: skip
        assert row in readme, row
    with pytest.raises(jobspec.JobSpecError, match="instance_types.csv"):
        jobspec.instance_type("g5.48xlarge")


def test_an_entrypoint_with_a_bad_setting_is_refused_with_the_jobs_own_message(spec):
    broken = jobspec.JobSpec(spec.job, spec.path, spec.config, spec.raw)
    with pytest.raises(jobspec.JobSpecError, match="num_workers must be >= 1"):
        broken.settings(overrides=["num_workers=0"])


def test_entrypoint_overrides_replace_job_yaml_settings(spec):
    argv = spec.entrypoint("smoke", ["storage_path=/x", "run_name=r"])
    assert argv[argv.index("--profile") + 1] == "smoke"
    assert [a for a in argv if a.startswith("storage_path=")] == ["storage_path=/x"]
    assert argv[-1] == "run_name=r"


# ------------------------------------------------------------------------------------------
# compute configs and workspace


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_compute_config_is_valid_and_its_head_runs_no_training(name):
    config = compute_config_type_from_yaml(str(CATALOGUE[name]))
    assert isinstance(config, ComputeConfig)
    assert config.head_node.resources == {"CPU": 0}
    jobspec.node_capacity(config.head_node.instance_type)
    for group in config.worker_nodes:
        assert group.max_nodes >= group.min_nodes >= 0
        jobspec.node_capacity(group.instance_type)  # a type whose size the checks know


def test_the_catalogue_covers_smoke_to_8xh100():
    assert {"cpu-smoke", "1xT4", "4xT4", "2x4xL4", "8xH100"} <= set(CATALOGUE)
    for name, path in CATALOGUE.items():
        match = re.fullmatch(r"(?:(\d+)x)?(\d+)x(T4|L4|H100)", name)
        if match:  # the name says how many GPUs; the instance types must agree
            nodes, per_node, model = int(match[1] or 1), int(match[2]), match[3]
            (group,) = compute_config_type_from_yaml(str(path)).worker_nodes
            assert group.max_nodes == nodes
            assert jobspec.node_capacity(group.instance_type)[1:] == (per_node, model)


def test_workspace_yaml_is_valid_and_mirrors_its_compute_config():
    raw = yaml.safe_load((REPO / "workspace.yaml").read_text())
    config = WorkspaceConfig.from_yaml(str(REPO / "workspace.yaml"))
    assert (REPO / config.containerfile).is_file() and not config.image_uri
    name = raw["tags"][jobspec.COMPUTE_CONFIG_TAG]
    assert config.compute_config == compute_config_type_from_yaml(str(CATALOGUE[name]))


def test_submit_without_credentials_says_how_to_log_in(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ANYSCALE_CLI_TOKEN"}
    env["HOME"] = str(tmp_path)  # no ~/.anyscale/credentials.json
    proc = subprocess.run(
        [sys.executable, "-m", "ci.anyscale_cli", "submit", "--job", "zero"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert "anyscale login" in line and "ANYSCALE_CLI_TOKEN" in line


# ------------------------------------------------------------------------------------------
# images


def test_containerfiles_are_up_to_date_with_images():
    for path, text in images.expected_files().items():
        assert path.read_text() == text, f"{path.relative_to(REPO)}: run `make containerfiles`"


@pytest.mark.parametrize("job", JOBS)
def test_containerfile_uses_the_pinned_ray_image_and_exact_pins(job):
    text = (REPO / "jobs" / job / "Containerfile").read_text()
    pins = pyproject_pins()
    (base,) = re.findall(r"^FROM (\S+)$", text, flags=re.M)
    assert re.fullmatch(rf"anyscale/ray:{re.escape(pins['ray'])}-py311-cu1\d\d", base)
    installed = dict(re.findall(r"^\s+([A-Za-z0-9_.\-]+)==(\S+?)(?: \\)?$", text, flags=re.M))
    runtime = {n: v for n, v in pins.items() if n != "ray" and n in installed}
    assert installed == runtime and "torch" in installed and "deepspeed" in installed
    assert set(installed) == {p.split("==")[0] for p in images.pinned_requirements()}
    # Anyscale builds without a build context.
    assert not re.search(r"^\s*(COPY|ADD)\b", text, flags=re.M | re.I)


@pytest.mark.parametrize("job", JOBS)
def test_torch_is_built_for_the_base_images_cuda_major(job):
    text = (REPO / "jobs" / job / "Containerfile").read_text()
    # PyPI's torch 2.13.0 is a CUDA 13 build: the base image must be a CUDA 13 one.
    assert images.torch_cuda_major(text) == images.base_cuda_major(text) == 13
    assert images.cuda_mismatch(text) is None


def test_a_cuda_12_base_with_pypis_cuda_13_torch_is_caught():
    text = (REPO / "images" / "Containerfile").read_text()
    broken = text.replace("-py311-cu130", "-py311-cu128")  # the image as it was
    assert images.base_cuda_major(broken) == 12 and images.torch_cuda_major(broken) == 13
    assert "CUDA 12 but torch is installed as a CUDA 13 build" in images.cuda_mismatch(broken)
    # The other coherent fix: torch from PyTorch's cu128 wheel index on the cu128 base.
    fixed = broken.replace("pip install --no-cache-dir", "pip install --no-cache-dir "
                           "--index-url https://download.pytorch.org/whl/cu128")  # fmt: skip
    assert images.torch_cuda_major(fixed) == 12 and images.cuda_mismatch(fixed) is None
    assert images.torch_cuda_major(text.replace("torch==2.13.0", "torch==2.13.0+cu126")) == 12
    cpu_base = text.replace("-py311-cu130", "-py311")
    assert "CUDA none (CPU)" in images.cuda_mismatch(cpu_base)
