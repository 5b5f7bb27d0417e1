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

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
# job.yaml tag naming the compute_configs/<name>.yaml its inline compute_config mirrors.
COMPUTE_CONFIG_TAG = "compute-config"

# The instance types the compute-config catalogue uses: vCPUs, GPUs, GPU model (AWS specs).
INSTANCE_TYPES = {
    "m5.xlarge": (4, 0, None),
    "m5.2xlarge": (8, 0, None),
    "g4dn.xlarge": (4, 1, "T4"),
    "g4dn.12xlarge": (48, 4, "T4"),
    "g6.12xlarge": (48, 4, "L4"),
    "p5.48xlarge": (192, 8, "H100"),
}


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
        proc = subprocess.run(
            [sys.executable, *argv[1:], "--print-config"],
            cwd=REPO,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            last_line = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
            raise JobSpecError(
                f"{self.path.relative_to(REPO)}: the entrypoint's settings do not parse: "
                f"{last_line}"
            )
        return json.loads(proc.stdout.strip().splitlines()[-1])


def load(job: str) -> JobSpec:
    from anyscale.job.models import JobConfig

    if job not in job_names():
        raise JobSpecError(f"unknown job '{job}'; valid jobs: {' '.join(job_names())}.")
    path = REPO / "jobs" / job / "job.yaml"
    if not path.exists():
        raise JobSpecError(f"{path.relative_to(REPO)} is missing.")
    return JobSpec(job, path, JobConfig.from_yaml(str(path)), yaml.safe_load(path.read_text()))


def node_capacity(instance_type: str) -> tuple[int, int, str | None]:
    if instance_type not in INSTANCE_TYPES:
        raise JobSpecError(
            f"unknown instance type '{instance_type}'; add its vCPUs and GPUs to "
            "ci/jobspec.py INSTANCE_TYPES."
        )
    return INSTANCE_TYPES[instance_type]
