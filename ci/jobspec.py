"""A job's deployment spec, read from its job.yaml: the one source of truth for every way a job
runs on a cluster.

Anyscale reads ``jobs/<job>/job.yaml`` itself (``anyscale job submit -f``, from the repo root).
The local multi-node run (ci/run_cluster.py), the KubeRay RayJob (ci/kuberay.py) and the
starter export (ci/template.py) derive everything from the same file - entrypoint, env vars,
working_dir and its excludes, retries, timeout - and take the worker count and per-worker
resources from the job's own resolved settings (``main.py --print-config``), so nothing is
written down twice.
"""

from __future__ import annotations

import csv
import functools
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
# job.yaml tag naming the compute_configs/<name>.yaml its inline compute_config mirrors.
COMPUTE_CONFIG_TAG = "compute-config"

# The sizes of the instance types the compute configs use (AWS specs): one row per type.
INSTANCE_TYPES_FILE = REPO / "compute_configs" / "instance_types.csv"
# Per node, beside the training workers: Ray Data's read/tokenise tasks need at least a CPU, or
# the pipeline waits forever for one (STACK-FACTS: "Ray Data deadlock").
CPUS_LEFT_FOR_DATA = 1


@dataclass(frozen=True)
class InstanceType:
    name: str
    vcpus: int
    gpus: int
    gpu_model: str | None
    gpu_memory_gib: int  # per GPU
    ram_gib: int


def instance_types() -> dict[str, InstanceType]:
    with INSTANCE_TYPES_FILE.open(newline="") as f:
        rows = list(csv.DictReader(f))
    return {
        row["instance_type"]: InstanceType(
            row["instance_type"], int(row["vcpus"]), int(row["gpus"]), row["gpu_model"] or None,
            int(row["gpu_memory_gib"]), int(row["ram_gib"]),
        )
        for row in rows
    }  # fmt: skip


class JobSpecError(ValueError):
    """A job.yaml that cannot be used; the message is one sentence."""


def job_names() -> list[str]:
    return sorted(p.parent.name for p in (REPO / "jobs").glob("*/main.py"))


@dataclass(frozen=True)
class JobSpec:
    job: str
    path: Path
    config: object  # anyscale.job.models.JobConfig
    raw: dict  # the YAML as written, before the SDK fills in defaults

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.config.entrypoint)

    @property
    def script(self) -> str:
        return self.argv[1]

    @property
    def profile(self) -> str:
        argv = self.argv
        return argv[argv.index("--profile") + 1] if "--profile" in argv else "smoke"

    @property
    def compute_config_name(self) -> str | None:
        return (self.config.tags or {}).get(COMPUTE_CONFIG_TAG)

    def entrypoint(self, profile: str | None = None, overrides: list[str] = ()) -> list[str]:
        """The job.yaml entrypoint with another profile and extra ``key=value`` settings;
        an override replaces job.yaml's setting of the same key."""
        replaced = {o.partition("=")[0] for o in overrides}
        argv = [a for a in self.argv if a.partition("=")[0] not in replaced or "=" not in a]
        if profile is not None:
            if "--profile" in argv:
                argv[argv.index("--profile") + 1] = profile
            else:
                argv[2:2] = ["--profile", profile]
        return [*argv, *overrides]

    def runtime_env(self, working_dir: str = ".") -> dict:
        """What the Ray Jobs API gets on every path: the code, its excludes, the env vars."""
        return {
            "working_dir": working_dir,
            "excludes": list(self.config.excludes or []),
            "env_vars": dict(self.config.env_vars or {}),
        }

    def settings(self, profile: str | None = None, overrides: list[str] = ()) -> dict:
        """The job's resolved settings for this entrypoint, as its own parser sees them."""
        argv = self.entrypoint(profile, overrides)
        # This checkout's `shared` first, not whichever one the venv's editable install names.
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        returncode, stdout, stderr = _print_config(tuple(argv[1:]), path)
        if returncode != 0:
            last_line = (stderr.strip().splitlines() or [f"exit {returncode}"])[-1]
            raise JobSpecError(
                f"{self.path.relative_to(REPO)}: the entrypoint's settings do not parse: "
                f"{last_line}"
            )
        return json.loads(stdout.strip().splitlines()[-1])


@functools.lru_cache(maxsize=256)
def _print_config(argv: tuple[str, ...], python_path: str) -> tuple[int, str, str]:
    """``main.py ... --print-config`` once per entrypoint in a process: each start imports
    torch and Ray (~5 s), and rendering asks for the same settings many times."""
    proc = subprocess.run([sys.executable, *argv, "--print-config"], cwd=REPO,
                          capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": python_path})  # fmt: skip
    return proc.returncode, proc.stdout, proc.stderr


def load(job: str) -> JobSpec:
    from anyscale.job.models import JobConfig

    if job not in job_names():
        raise JobSpecError(f"unknown job '{job}'; valid jobs: {' '.join(job_names())}.")
    path = REPO / "jobs" / job / "job.yaml"
    if not path.exists():
        raise JobSpecError(f"{path.relative_to(REPO)} is missing.")
    return JobSpec(job, path, JobConfig.from_yaml(str(path)), yaml.safe_load(path.read_text()))


def instance_type(name: str) -> InstanceType:
    types = instance_types()
    if name not in types:
        raise JobSpecError(
            f"unknown instance type '{name}'; add its vCPUs, GPUs, GPU memory and RAM to "
            f"{INSTANCE_TYPES_FILE.relative_to(REPO)}."
        )
    return types[name]


def node_capacity(name: str) -> tuple[int, int, str | None]:
    """(vCPUs, GPUs, GPU model) of an instance type."""
    node = instance_type(name)
    return node.vcpus, node.gpus, node.gpu_model


def fit_problems(settings: dict, worker_groups: list[tuple[str, int]]) -> list[str]:
    """Why a job's resolved settings do not fit a compute config's worker nodes, one sentence
    each (empty when they fit). ``worker_groups``: (instance type, max nodes) per group.

    GPU jobs: one worker per GPU, so a node holds as many workers as it has GPUs; each needs
    ``cpus_per_worker`` of the node's vCPUs, with one left for Ray Data; a TP group talks in
    every layer, so it must sit inside one node (tp divides the GPUs of a node). CPU jobs: all
    workers' CPUs plus one for Ray Data within the worker nodes' vCPUs.
    """
    problems = []
    workers, cpus, tp = settings["num_workers"], settings["cpus_per_worker"], settings.get("tp", 1)
    nodes = [(instance_type(name), count) for name, count in worker_groups]
    if settings["use_gpu"]:
        gpu_nodes = [(node, count) for node, count in nodes if node.gpus]
        total_gpus = sum(node.gpus * count for node, count in gpu_nodes)
        if workers > total_gpus:
            problems.append(f"num_workers={workers} needs {workers} GPUs; the compute config "
                            f"has {total_gpus}.")  # fmt: skip
        for node, _ in gpu_nodes:
            on_node = min(workers, node.gpus)
            need = on_node * cpus + CPUS_LEFT_FOR_DATA
            if need > node.vcpus:
                problems.append(
                    f"{on_node} workers x cpus_per_worker={cpus:g} + {CPUS_LEFT_FOR_DATA} CPU "
                    f"for Ray Data = {need:g} vCPUs do not fit a {node.name} ({node.vcpus} vCPUs)."
                )
            if node.gpus % tp:
                problems.append(
                    f"tp={tp} does not divide a {node.name}'s {node.gpus} GPUs, so a TP group "
                    "would span two nodes."
                )
    else:
        total = sum(node.vcpus * count for node, count in nodes)
        need = workers * cpus + CPUS_LEFT_FOR_DATA
        if need > total:
            problems.append(f"{workers} workers x cpus_per_worker={cpus:g} + "
                            f"{CPUS_LEFT_FOR_DATA} CPU for Ray Data = {need:g} vCPUs do not fit "
                            f"the worker nodes' {total} vCPUs.")  # fmt: skip
    return problems
