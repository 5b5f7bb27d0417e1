"""The job a dry run plays and the GPUs it would run on: the job's config class and profiles,
and the GPU workers of its job.yaml (or of a ``compute_configs/`` file)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import yaml

from shared.config import ConfigError
from shared.planner.specs import GPT2_VOCAB

REPO = Path(__file__).resolve().parents[3]

# Which config class each job parses, and the planner row its strategy is.
JOBS = {
    "ddp": ("TrainConfig", "ddp"),
    "fault_tolerance": ("FaultToleranceConfig", "ddp"),
    "fsdp": ("FSDPConfig", "fsdp2"),
    "zero": ("ZeroConfig", "zero"),
    "tp2d": ("TP2DConfig", "tp_fsdp"),
}
# Instance types of the compute configs -> (the planner's GPU preset, GPUs per node).
INSTANCES = {
    "g4dn.xlarge": ("t4", 1), "g4dn.12xlarge": ("t4", 4), "g4dn.metal": ("t4", 8),
    "g6.xlarge": ("l4", 1), "g6.12xlarge": ("l4", 4), "g6.48xlarge": ("l4", 8),
    "g5.xlarge": ("a10g", 1), "g5.12xlarge": ("a10g", 4), "g5.48xlarge": ("a10g", 8),
    "p4d.24xlarge": ("a100-40g", 8), "p4de.24xlarge": ("a100-80g", 8),
    "p5.48xlarge": ("h100", 8), "p5e.48xlarge": ("h200", 8),
}  # fmt: skip


@dataclasses.dataclass
class ComputeConfig:
    gpu: str  # a key of GPUS
    gpus_per_node: int
    nodes: int
    source: str  # the file it comes from

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def hosts_tp(self, tp: int) -> bool:
        """A TP group talks in every layer: it must sit inside one node."""
        return self.gpus_per_node >= tp and self.gpus_per_node % tp == 0


def load_job(job: str):
    """The job's main module (its PROFILES) and its config class."""
    if job not in JOBS:
        trains = ", ".join(JOBS)
        raise ConfigError(f"job '{job}' cannot be dry-run (it trains no model); jobs: {trains}.")
    path = REPO / "jobs" / job / "main.py"
    spec = importlib.util.spec_from_file_location(f"dryrun_{job}_main", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, getattr(module, JOBS[job][0])


def _gpu_workers(spec: dict, source: str) -> ComputeConfig:
    workers = [w for w in spec.get("worker_nodes", []) if w["instance_type"] in INSTANCES]
    if not workers:
        raise ConfigError(f"{source} has no GPU worker node the dry run knows.")
    worker = workers[0]
    gpu, per_node = INSTANCES[worker["instance_type"]]
    return ComputeConfig(gpu, per_node, int(worker.get("max_nodes", 1)), source)


def compute_config(job: str) -> ComputeConfig:
    """The GPU workers of the job.yaml's inline compute config."""
    spec = yaml.safe_load((REPO / "jobs" / job / "job.yaml").read_text())
    return _gpu_workers(spec["compute_config"], f"jobs/{job}/job.yaml")


def named_compute_config(name: str) -> ComputeConfig:
    """The GPU workers of ``compute_configs/<name>.yaml``."""
    path = REPO / "compute_configs" / f"{name.removesuffix('.yaml')}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in path.parent.glob("*.yaml")))
        raise ConfigError(f"no compute config '{name}' in compute_configs/ (there are: {known}).")
    return _gpu_workers(yaml.safe_load(path.read_text()), f"compute_configs/{path.name}")


def gpu_compute_configs() -> list[ComputeConfig]:
    """The compute configs in compute_configs/ with GPU workers, by file name."""
    found = []
    for path in sorted((REPO / "compute_configs").glob("*.yaml")):
        spec = yaml.safe_load(path.read_text())
        if any(w["instance_type"] in INSTANCES for w in spec.get("worker_nodes", [])):
            found.append(_gpu_workers(spec, f"compute_configs/{path.name}"))
    return found


def choose_compute(job: str, tp: int, requested: str | None) -> tuple[ComputeConfig, str]:
    """(the compute config to dry-run on, a note when it is not the job.yaml's). A TP size the
    job's nodes cannot hold in one node (tp=8 on 4-GPU nodes) moves to the project's compute
    config whose node can: the job.yaml could not run that layout at all."""
    if requested:
        compute = named_compute_config(requested)
        if not compute.hosts_tp(tp):
            raise ConfigError(f"tp={tp} needs a TP group inside one node; {compute.source} has "
                              f"{compute.gpus_per_node} GPUs per node.")  # fmt: skip
        return compute, ""
    compute = compute_config(job)
    if compute.hosts_tp(tp):
        return compute, ""
    hosts = [c for c in gpu_compute_configs() if c.hosts_tp(tp)]
    if not hosts:
        raise ConfigError(f"tp={tp} needs a TP group inside one node, and no compute config in "
                          "compute_configs/ has that many GPUs per node.")  # fmt: skip
    hosts.sort(key=lambda c: c.gpus_per_node)  # the smallest node that holds the group
    note = (f"note: {compute.source}'s nodes have {compute.gpus_per_node} GPUs, too few for a "
            f"TP group of {tp}; dry-running on {hosts[0].source}'s node instead (COMPUTE= picks "
            "another).")  # fmt: skip
    return hosts[0], note


def vocab_size(cfg) -> int:
    """The GPT-2 tokenizer's 50257 for the full profiles; the smoke runs train a 512-token one."""
    return GPT2_VOCAB if cfg.tokenizer else 512
