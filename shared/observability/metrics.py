"""Throughput, MFU, memory, and the progress line.

MFU = achieved model FLOP/s / (peak FLOP/s per device x devices), with model FLOPs per token
from :func:`shared.models.flops_per_token` (6N + attention) - the PaLM definition, which
ignores recomputation, so it does not reward activation checkpointing.
"""

from __future__ import annotations

import json
import math
import resource
import statistics
import time
from collections.abc import Iterable

import torch

from shared import storage
from shared.observability import startup
from shared.storage import AppendLog

# Dense bf16/fp16 tensor-core peaks from the vendors' datasheets (no sparsity), TFLOP/s.
GPU_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
    "T4": 65.0,
    "V100": 125.0,
}
# A CPU has no meaningful datasheet peak for this; 1 TFLOP/s is a round nominal figure for a
# few AVX2/AVX-512 cores, so CPU MFU is only comparable with itself. Override with peak_tflops=.
CPU_NOMINAL_TFLOPS = 1.0


def device_peak_tflops(device: torch.device, override: float = 0.0) -> tuple[float, str]:
    """(peak TFLOP/s, where the number came from) for one device."""
    if override > 0:
        return override, "peak_tflops setting"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in GPU_PEAK_TFLOPS.items():
            if key in name:
                return tflops, f"datasheet bf16 dense peak of {key}"
        return 100.0, f"unknown GPU '{name}', assumed 100"
    return CPU_NOMINAL_TFLOPS, "nominal CPU figure"


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held locally: a DTensor counts only its local shard."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def peak_memory_bytes(device: torch.device) -> dict[str, int]:
    """Peak resident memory of this process (CPU) and the CUDA allocator's peak (GPU)."""
    peaks = {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    if device.type == "cuda":
        peaks["cuda_peak_allocated"] = torch.cuda.max_memory_allocated(device)
    return peaks


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def finite_or_null(value, path: str = "", flagged: list[str] | None = None):
    """``value`` with every non-finite float (NaN, inf) replaced by None, and the dotted
    paths of what was replaced appended to ``flagged``: JSON has no NaN, and a reader must
    be able to tell "diverged" from "not measured"."""
    if isinstance(value, float) and not math.isfinite(value):
        if flagged is not None:
            flagged.append(path)
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v, f"{path}.{k}" if path else str(k), flagged)
                for k, v in value.items()}  # fmt: skip
    if isinstance(value, list | tuple):
        return [finite_or_null(v, f"{path}[{i}]", flagged) for i, v in enumerate(value)]
    return value


# Written by rank 0 when a run stops on a non-finite loss, gradient norm or weights; the driver
# reads it for SUMMARY (Ray Train keeps only metrics reported with a checkpoint, and a
# diverged step has none).
DIVERGENCE_FILE = "divergence.json"


def diverged_sentence(step: int, divergence: str) -> str:
    """What a diverged run says once when it stops (the driver's error line; rank 0's line
    without Ray), before naming the last good checkpoint."""
    return f"training diverged at step {step} ({divergence}); this step was not saved"


def strict_json(record: dict, **dump_kwargs) -> str:
    """JSON that every parser accepts: non-finite numbers become null and are listed under
    ``nonfinite``."""
    flagged: list[str] = []
    clean = finite_or_null(record, flagged=flagged)
    if flagged:
        clean["nonfinite"] = flagged
    return json.dumps(clean, allow_nan=False, default=str, **dump_kwargs)


class StepMetrics:
    """Per-step numbers on every rank; the history, metrics.jsonl and the progress line on
    rank 0. The definitions are in docs/observability.md ("What the numbers mean"); the
    progress line and SUMMARY use the same ones (:meth:`steady`)."""

    def __init__(
        self, cfg, flops_per_token: float, peak_tflops: float, world_size: int, path: str | None
    ):
        self.cfg = cfg
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_tflops * 1e12 * world_size
        self.world_size = world_size
        self.path = path  # metrics.jsonl (rank 0 only; local or object storage), or None
        self.log = AppendLog(path) if path else None
        self.history: list[dict] = []
        self.first_step_end: float | None = None
        self.startup_marks: dict[str, float | None] = {}  # set by the loop (see startup.py)

    def record(self, *, step: int, epoch: int, loss: float, lr: float, grad_norm: float | None,
               step_time: float, data_wait: float, **extra) -> dict:  # fmt: skip
        now = time.time()
        if self.first_step_end is None:
            self.first_step_end = now
        tokens_per_s = self.cfg.tokens_per_step / step_time if step_time > 0 else 0.0
        row = {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "step_time_s": step_time,
            "data_wait_s": data_wait,
            # This step's share of time spent waiting for input (per step, unlike SUMMARY's).
            "data_wait_fraction": data_wait / step_time if step_time > 0 else 0.0,
            "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * self.flops_per_token / self.peak_flops,
            **extra,  # eval_loss / eval_ppl on evaluation steps (shared/evaluation.py)
        }
        self.history.append(row)
        if self.log is not None:
            self.log.append(strict_json(row) + "\n")
        return row

    def flush(self) -> None:
        if self.log is not None:
            self.log.flush()

    def steady(self) -> dict:
        """Throughput, MFU and data wait over this attempt's steps after its first one (the
        first step waits for the pipeline to start: reported as ``first_batch_wait_s``)."""
        steady = self.history[1:] or self.history
        total_time = sum(r["step_time_s"] for r in steady)
        tokens_per_s = self.cfg.tokens_per_step * len(steady) / total_time if total_time else 0.0
        return {
            "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * self.flops_per_token / self.peak_flops,
            "data_wait_fraction": sum(r["data_wait_s"] for r in steady) / total_time
            if total_time
            else 0.0,
            "first_batch_wait_s": self.history[0]["data_wait_s"] if self.history else 0.0,
        }

    def progress_line(self, row: dict) -> str:
        steps_left = self.cfg.max_steps - row["step"]
        recent = [r["step_time_s"] for r in self.history[-20:]]
        eta = steps_left * statistics.median(recent)
        steady = self.steady()
        return (
            f"step {row['step']:>{len(str(self.cfg.max_steps))}}/{self.cfg.max_steps} | "
            f"epoch {row['epoch']} | loss {row['loss']:.4f} | lr {row['lr']:.2e} | "
            f"{steady['tokens_per_s']:,.0f} tok/s | mfu {100 * steady['mfu']:.2f}% | "
            f"data wait {100 * steady['data_wait_fraction']:.0f}% | eta {format_duration(eta)}"
            + (
                f" | eval loss {row['eval_loss']:.4f} ppl {row['eval_ppl']:.2f}"
                if "eval_loss" in row
                else ""
            )  # fmt: skip
        )

    def summary(self) -> dict:
        """Run-level numbers of this attempt (same definitions as the progress line)."""
        if not self.history:
            return {"steps_this_run": 0}
        steady = self.history[1:] or self.history
        return {
            "attempt_initial_loss": self.history[0]["loss"],
            "final_loss": self.history[-1]["loss"],
            **self.steady(),
            "step_time_median_s": statistics.median(r["step_time_s"] for r in steady),
            "data_wait_total_s": sum(r["data_wait_s"] for r in self.history),
            "time_to_first_step_s": self.first_step_end - self.cfg.driver_start_time,
            "startup_s": startup.breakdown(
                {**self.startup_marks, "first_step": self.first_step_end}
            ),
            "steps_this_run": len(self.history),
            **self.eval_summary(),
        }

    def eval_summary(self) -> dict:
        """The last evaluation's loss and perplexity, and this attempt's first eval loss."""
        evals = [r for r in self.history if "eval_loss" in r]
        if not evals:
            return {}
        return {"eval_loss": evals[-1]["eval_loss"], "eval_ppl": evals[-1]["eval_ppl"],
                "first_eval_loss": evals[0]["eval_loss"]}  # fmt: skip


def rank0_metrics_path(run_dir: str, rank: int) -> str | None:
    """metrics.jsonl in the run directory (local, NFS or object storage), for rank 0."""
    return storage.join(run_dir, "metrics.jsonl") if rank == 0 else None


def read_metrics(path: str) -> list[dict]:
    """metrics.jsonl rows in step order, one per step: a step that was trained again after a
    restart from an older checkpoint keeps its latest row."""
    by_step: dict[int, dict] = {}
    for line in storage.read_text(path).splitlines():
        if line.strip():
            row = json.loads(line)
            by_step[row["step"]] = row
    return [by_step[step] for step in sorted(by_step)]
