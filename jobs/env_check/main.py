"""Check a cluster before training on it: topology, software, precision, bandwidth, FLOP/s.

    make run-local JOB=env_check                  # 2 CPU workers on a local cluster
    make run-local JOB=env_check PROFILE=full     # every GPU of a cluster (num_workers=8 ...)

Prints a readable report and writes the same numbers to ``env_check.json`` in the run dir:
  * nodes: head/worker, CPUs, GPUs, accelerator type, memory (from Ray);
  * per worker: host, torch / CUDA / NCCL versions, bf16 and fp16 support;
  * all-reduce bandwidth across all workers for several message sizes (gloo on CPU, NCCL on
    GPU), as algorithm and bus bandwidth (bus = algo x 2(n-1)/n, comparable across n);
  * matmul throughput per worker, the ceiling any training step on that device can reach.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import tempfile
import time
from dataclasses import dataclass

import ray
import ray.train
import ray.train.torch
import torch
import torch.distributed as dist
from ray.train.torch import TorchTrainer

from shared import storage
from shared.config import BaseConfig, ConfigError, parse_args, setting
from shared.observability.stack import register_process
from shared.precision import (
    choose_dtype,
    device_caps,
    precision_support,
    supports_bf16,
    supports_fp16,
)
from shared.runtime.cluster import topology
from shared.runtime.driver import job_run, run_config, scaling_config, torch_config
from shared.runtime.worker import quiet_train_worker_logs
from shared.storage import write_json_atomic


@dataclass
class EnvCheckConfig(BaseConfig):
    allreduce_sizes_mb: str = setting(
        "0.01,0.1,1,8", "All-reduce message sizes in MB (comma list)."
    )
    allreduce_iters: int = setting(5, "Timed all-reduce repetitions per size (after 2 warm-ups).")
    matmul_size: int = setting(1024, "n for the n x n x n matmul benchmark.")
    matmul_iters: int = setting(5, "Timed matmul repetitions (after 1 warm-up).")

    def sizes_bytes(self) -> list[int]:
        return [int(float(mb) * 2**20) for mb in self.allreduce_sizes_mb.split(",")]

    def validate(self) -> None:
        super().validate()
        try:
            sizes = self.sizes_bytes()
        except ValueError:
            raise ConfigError(
                "allreduce_sizes_mb must be a comma list of numbers "
                f"(got '{self.allreduce_sizes_mb}')."
            ) from None
        if not sizes or min(sizes) < 4:
            raise ConfigError("allreduce_sizes_mb entries must each be at least 4 bytes.")
        for name in ("allreduce_iters", "matmul_size", "matmul_iters"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1 (got {getattr(self, name)}).")


REPORT_FILE = "env_check.json"

PROFILES = {
    "smoke": dict(num_workers=2, cpus_per_worker=0.5, matmul_size=512),
    "full": dict(num_workers=8, use_gpu=True, cpus_per_worker=4, matmul_size=8192,
                 allreduce_sizes_mb="1,16,128,1024", allreduce_iters=20, matmul_iters=20),
}  # fmt: skip


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def software_and_precision(device: torch.device) -> dict:
    caps = device_caps(device)
    info = {
        "host": socket.gethostname(),
        "node_id": ray.get_runtime_context().get_node_id()[:12],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "-",
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-",
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        # bf16/fp16: native (hardware units) vs emulated (runs, slowly: bf16 on a T4, on CPU)
        **precision_support(device),
        "capability": ".".join(map(str, caps.capability)) if caps.capability else "-",
        # what dtype=auto trains in here: without and with loss scaling (ZeRO)
        "auto_dtype": choose_dtype("auto", caps),
        "auto_dtype_zero": choose_dtype("auto", caps, fp16_loss_scaling=True),
        "backend": dist.get_backend(),
    }
    return info


def allreduce_bandwidth(device: torch.device, sizes: list[int], iters: int) -> list[dict]:
    """Median-free by design: the mean over ``iters`` after warm-ups, per message size."""
    world = dist.get_world_size()
    rows = []
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        for _ in range(2):
            dist.all_reduce(tensor)
        _sync(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        _sync(device)
        seconds = (time.perf_counter() - start) / iters
        algbw = tensor.numel() * 4 / seconds / 1e9
        rows.append({
            "bytes": tensor.numel() * 4,
            "time_ms": seconds * 1e3,
            "algbw_GBps": algbw,
            "busbw_GBps": algbw * 2 * (world - 1) / world,
        })  # fmt: skip
    return rows


def matmul_tflops(device: torch.device, n: int, iters: int) -> dict:
    results = {}
    dtypes = {"fp32": torch.float32}
    if supports_bf16(device):  # native only: emulated bf16 is no ceiling worth measuring
        dtypes["bf16"] = torch.bfloat16
    if supports_fp16(device):
        dtypes["fp16"] = torch.float16
    for name, dtype in dtypes.items():
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        a @ b
        _sync(device)
        start = time.perf_counter()
        for _ in range(iters):
            a @ b
        _sync(device)
        results[name] = 2 * n**3 * iters / (time.perf_counter() - start) / 1e12
    return results


def train_loop_per_worker(config: dict) -> None:
    cfg: EnvCheckConfig = config["cfg"]
    quiet_train_worker_logs()
    register_process(cfg.run_dir, f"rank{ray.train.get_context().get_world_rank()}")
    device = ray.train.torch.get_device()
    report = {
        **software_and_precision(device),
        "matmul_tflops": matmul_tflops(device, cfg.matmul_size, cfg.matmul_iters),
    }
    allreduce = allreduce_bandwidth(device, cfg.sizes_bytes(), cfg.allreduce_iters)
    per_worker = [None] * dist.get_world_size()
    dist.all_gather_object(per_worker, report)
    results = {"workers": per_worker, "allreduce": allreduce}
    # Ray keeps rank 0's metrics of the last report that carried a checkpoint, so rank 0
    # reports the whole result as a one-file checkpoint (it also lands in the run's storage).
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if ray.train.get_context().get_world_rank() == 0:
            write_json_atomic(os.path.join(tmp, REPORT_FILE), json.dumps(results, indent=2))
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(results, checkpoint=checkpoint, checkpoint_dir_name="env_check")


def print_report(nodes: list[dict], workers: list[dict], allreduce: list[dict], world: int) -> None:
    def table(rows: list[dict], columns: list[str]) -> None:
        cells = [[str(r.get(c, "")) for c in columns] for r in rows]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
        print("  " + "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
        for row in cells:
            print("  " + "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))

    print("\n== nodes")
    table(nodes, ["node_id", "role", "address", "cpus", "gpus", "accelerator", "memory_gib"])
    print("\n== workers")
    rows = [
        {
            "rank": rank,
            **w,
            **{f"matmul_{k}_tflops": f"{v:.3f}" for k, v in w["matmul_tflops"].items()},
        }
        for rank, w in enumerate(workers)
    ]
    cols = ["rank", "host", "device", "capability", "torch", "cuda", "nccl", "backend", "bf16",
            "fp16", "auto_dtype", "auto_dtype_zero"]  # fmt: skip
    cols += sorted(k for k in rows[0] if k.startswith("matmul_") and k != "matmul_tflops")
    table(rows, cols)
    print(f"\n== all-reduce across {world} workers")
    table(
        [
            {
                "size": f"{r['bytes'] / 2**20:.2f} MiB",
                "time_ms": f"{r['time_ms']:.3f}",
                "algbw_GB/s": f"{r['algbw_GBps']:.3f}",
                "busbw_GB/s": f"{r['busbw_GBps']:.3f}",
            }
            for r in allreduce
        ],
        ["size", "time_ms", "algbw_GB/s", "busbw_GB/s"],
    )
    print()


def main() -> None:
    cfg = parse_args("env_check", EnvCheckConfig, PROFILES, description=__doc__)
    with job_run(cfg) as run:
        nodes = topology()
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"cfg": cfg},
            scaling_config=scaling_config(cfg),
            run_config=run_config(cfg),
            # A hung all-reduce (a dead peer, a blocked network) fails instead of waiting.
            torch_config=torch_config(cfg),
        )
        run.result = trainer.fit()
        if run.result.error:
            raise run.result.error
        workers, allreduce = run.result.metrics["workers"], run.result.metrics["allreduce"]
        print_report(nodes, workers, allreduce, cfg.num_workers)
        path = storage.join(cfg.run_dir, REPORT_FILE)  # the full report, with the node table
        write_json_atomic(path, json.dumps({"nodes": nodes, **run.result.metrics}, indent=2))
        run.extra = {
            "report": path,
            "nodes": len(nodes),
            "max_busbw_GBps": max(r["busbw_GBps"] for r in allreduce),
            "matmul_fp32_tflops": min(w["matmul_tflops"]["fp32"] for w in workers),
        }


if __name__ == "__main__":
    main()
