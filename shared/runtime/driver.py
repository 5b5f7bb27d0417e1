"""The driver side of a Ray Train job: Ray's configs, the run contract, and the run itself.

Run contract (every job): the driver ends by printing one line ``SUMMARY {json}`` and writing
the same JSON to ``<storage_path>/<job>/<run_name>/summary.json``; it exits 0 only if the run
succeeded. The worker side is shared/runtime/worker.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from shared import storage
from shared.checkpoint import init_from, resume
from shared.config import ConfigError, first_line, user_fields
from shared.config.run_settings import check_resume
from shared.observability import startup
from shared.observability.metrics import DIVERGENCE_FILE, diverged_sentence, strict_json
from shared.observability.stack import DRIVER, register_process
from shared.runtime import preemption
from shared.runtime.cluster import (
    ClusterInfo,
    check_local_resources,
    ray_cluster,
    train_worker_nodes,
)
from shared.runtime.lease import run_lease

SUMMARY_KEYS = (
    "job", "profile", "status", "world_size", "steps", "initial_loss", "final_loss",
    "tokens_per_s", "time_to_first_step_s", "wall_s", "checkpoint", "resumed_from_step",
)  # fmt: skip
# Copied into SUMMARY when the workers reported them (docs/observability.md defines each).
OPTIONAL_SUMMARY_KEYS = (
    "steps_this_run", "attempt_initial_loss", "mfu", "step_time_median_s", "data_wait_total_s",
    "data_wait_fraction", "first_batch_wait_s", "dtype", "model_state_bytes_per_rank",
    "peak_rss", "cuda_peak_allocated", "samples_per_epoch", "diverged_at_step", "divergence",
    "last_good_checkpoint_step", "preempted_at_step", "eval_loss", "eval_ppl", "first_eval_loss",
    "data_read_amplification", "data_rows_read", "data_rows_trained", "startup_s",
)  # fmt: skip


def scaling_config(cfg):
    from ray.train import ScalingConfig

    elastic = getattr(cfg, "min_workers", 0)
    resize = {"elastic_resize_monitor_interval_s": cfg.elastic_resize_interval_s} if elastic else {}
    return ScalingConfig(
        # (min, max): Ray Train V2 starts with as many as fit and may restart with fewer.
        num_workers=(elastic, cfg.num_workers) if elastic else cfg.num_workers,
        use_gpu=cfg.use_gpu,
        resources_per_worker={"CPU": cfg.cpus_per_worker, **cfg.worker_resources_dict()},
        placement_strategy=cfg.placement_strategy,
        **resize,
    )


def torch_config(cfg):
    """The process group Ray Train creates: a collective that waits longer than
    ``collective_timeout_s`` raises (and fails the run) instead of hanging forever."""
    # ... and whose workers checkpoint and stop on SIGTERM (shared/runtime/preemption.py).
    config_class = preemption.torch_config_class()
    return config_class(timeout_s=int(cfg.collective_timeout_s),
                        preemption_grace_s=cfg.preemption_grace_s)  # fmt: skip


def run_config(cfg):
    """Same name + storage path = same run: rerunning the command resumes it."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig

    return RunConfig(
        name=cfg.run_name,
        storage_path=cfg.job_storage,
        failure_config=FailureConfig(max_failures=cfg.max_failures),
        checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints or None),
    )


def _is_training_failure(err: BaseException) -> bool:
    """Ray Train's own verdict that the workers failed (after any allowed restarts)."""
    from ray.train import TrainingFailedError

    return isinstance(err, TrainingFailedError)


class TrainingGaveUp(RuntimeError):
    """The run failed more often than FailureConfig(max_failures) allows."""

    def __init__(self, max_failures: int, cause: BaseException):
        super().__init__(
            f"training failed and Ray Train gave up after max_failures={max_failures} "
            f"restart(s): {type(cause).__name__}: {first_line(cause)}"
        )


@dataclass
class JobRun:
    """Filled in by the job inside ``with job_run(cfg) as run:``."""

    cfg: Any
    cluster: ClusterInfo | None = None
    result: Any = None  # ray.train.Result
    extra: dict = field(default_factory=dict)  # job-specific summary keys
    # Called when the summary is written, also after a failure: more job-specific keys.
    summary_hook: Callable[[], dict] | None = None


class TrainingDiverged(RuntimeError):
    """A non-finite loss, gradient norm or weight stopped the run (shared/loop.py)."""

    def __init__(self, record: dict):
        self.record = record
        super().__init__(diverged_sentence(record["diverged_at_step"], record["divergence"]))


def divergence_of_this_run(cfg) -> dict | None:
    """The record rank 0 wrote when this driver's run diverged (an older run's is ignored)."""
    path = storage.join(cfg.run_dir, DIVERGENCE_FILE)
    if not storage.exists(path):
        return None
    record = json.loads(storage.read_text(path))
    return record if record.get("driver_start_time") == cfg.driver_start_time else None


def summarize(run: JobRun, wall_s: float, error: BaseException | None) -> dict:
    cfg = run.cfg
    metrics = (run.result.metrics if run.result is not None else None) or {}
    if isinstance(error, TrainingDiverged):
        metrics = error.record
    ckpt = run.result.checkpoint if run.result is not None else None
    summary = {
        "job": cfg.job,
        "profile": cfg.profile,
        "status": "diverged"
        if isinstance(error, TrainingDiverged)
        else "failed"
        if error
        else "preempted"
        if metrics.get("preempted_at_step")
        else "succeeded",  # fmt: skip
        "world_size": metrics.get("world_size", cfg.num_workers),
        "steps": metrics.get("diverged_at_step", metrics.get("checkpoint_step")),
        "initial_loss": metrics.get("initial_loss"),
        "final_loss": metrics.get("final_loss"),
        "tokens_per_s": metrics.get("tokens_per_s"),
        "time_to_first_step_s": metrics.get("time_to_first_step_s"),
        "wall_s": round(wall_s, 2),
        "checkpoint": checkpoint_uri(cfg.run_dir, ckpt.path) if ckpt is not None else None,
        "resumed_from_step": metrics.get("resumed_from_step"),
        "run_dir": cfg.run_dir,
    }
    for key in OPTIONAL_SUMMARY_KEYS:
        if key in metrics:
            summary[key] = metrics[key]
    summary |= run.extra
    if run.summary_hook is not None:
        summary |= run.summary_hook()
    if error and summary["checkpoint"] is None:
        summary["checkpoint"] = latest_complete_checkpoint(cfg.run_dir)
    if error:
        summary["error"] = f"{type(error).__name__}: {error}".splitlines()[0][:500]
    return summary


def train_on_text(
    cfg, train_loop_per_worker, dataset_config=None, run: JobRun | None = None
) -> None:
    """The driver of every text-training job: data source -> packed dataset (tokenised once,
    cached on storage) -> ``TorchTrainer(...).fit()`` on ``num_workers`` workers -> SUMMARY.

    Each worker reads its slice of every global batch from the packed dataset through Ray Data
    (RaySession); ``train_loop_config["packed"]`` tells it where the dataset is."""
    from ray.train.torch import TorchTrainer

    from shared.data import (
        check_enough_samples,
        check_packed,
        check_text_dataset,
        find_packed,
        packed_dataset,
        resolve_text_source,
        tokenizer_spec,
    )

    sources = []

    def resolve_and_check_data() -> None:
        source = resolve_text_source(cfg)  # smoke: writes the corpus + tokenizer once
        check_text_dataset(source)  # format, schema, text column, rows: before any cluster
        _, packed = find_packed(source, cfg)
        if packed is not None:  # cached: its size and files are known before any cluster
            check_packed(packed)
            check_enough_samples(packed, cfg.global_batch_size)
        sources.append(source)

    def check_init_from() -> None:  # what it points to, and that the weights fit the model
        init_from.check(cfg, **tokenizer_spec(sources[0].tokenizer))

    with job_run(cfg, run, preflight=[resolve_and_check_data, check_init_from]) as run:
        source = sources[0]
        packed = packed_dataset(source, cfg, log=lambda line: print(line, flush=True))
        check_enough_samples(packed, cfg.global_batch_size)  # before the worker group
        startup.mark(cfg, "data_ready")
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"cfg": cfg, "packed": packed, **tokenizer_spec(source.tokenizer)},
            scaling_config=scaling_config(cfg),
            run_config=run_config(cfg),
            torch_config=torch_config(cfg),
            **({"dataset_config": dataset_config} if dataset_config is not None else {}),
        )
        startup.mark(cfg, "fit_start")
        run.result = trainer.fit()
        run.extra["worker_nodes"] = train_worker_nodes()
        if getattr(cfg, "export_at_end", False):
            run.extra["export"] = export_after_run(cfg, run)


def export_after_run(cfg, run: JobRun) -> str | None:
    """``export_at_end``: the Hugging Face export of a run that finished (shared/export).
    An export that fails leaves the trained run successful: a warning, and ``export: null``."""
    from shared.export import export_at_end

    metrics = (run.result.metrics if run.result is not None else None) or {}
    if run.result is None or run.result.error or metrics.get("preempted_at_step"):
        return None
    try:
        dest = export_at_end(cfg)
    except Exception as err:  # noqa: BLE001 - the checkpoint is still there to export by hand
        print(f"warning: no export: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        return None
    print(f"exported to Hugging Face format: {dest}", flush=True)
    return dest


def checkpoint_uri(run_dir: str, path: str) -> str:
    """Ray's checkpoint path is inside its filesystem ("bucket/key"): give it the run
    directory's scheme back (s3://bucket/key) so users can open it."""
    if storage.is_remote(run_dir) and "://" not in path:
        return f"{run_dir.split('://', 1)[0]}://{path.lstrip('/')}"
    return path


def latest_complete_checkpoint(run_dir: str) -> str | None:
    """The checkpoint a rerun resumes from: registered and its manifests verify."""
    return resume.last_good_checkpoint(run_dir)


def start_block(cfg) -> str:
    """Printed under the dashboard line: which run, where its files go, every setting."""
    settings = " ".join(f"{name}={getattr(cfg, name)}" for name in user_fields(type(cfg)))
    wrapped = textwrap.fill(settings, width=100, initial_indent="  settings: ",
                            subsequent_indent="    ", break_long_words=False,
                            break_on_hyphens=False)  # fmt: skip
    return (
        f"run {cfg.job}/{cfg.run_name} (profile {cfg.profile}): {cfg.run_dir}\n"
        f"  watch: progress below | make tensorboard | make stack JOB={cfg.job} (if it hangs)\n"
        f"{wrapped}"
    )


@contextlib.contextmanager
def job_run(cfg, run: JobRun | None = None, preflight=()) -> Iterator[JobRun]:
    """Check settings, connect to Ray, run the body, always end with the SUMMARY line.

    Before any cluster starts: local resources, the ``preflight`` checks (e.g. the dataset)
    and the resume contract (shared/config/run_settings.py). Exit status: 0 on success, 2 for a bad
    setting or unreachable storage, 1 for a failed or diverged run, 143 for a preempted one.
    """
    run = run or JobRun(cfg)
    try:
        check_local_resources(cfg)
        for check in preflight:
            check()
        changes = check_resume(cfg)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except OSError as err:  # storage_path or the dataset unreachable: no bucket, no credentials
        print(f"error: storage unreachable before the run started ({first_line(err)}).",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2) from None
    if changes:
        print(f"resuming {cfg.job}/{cfg.run_name} with changed settings: {', '.join(changes)}",
              flush=True)  # fmt: skip
    error: BaseException | None = None
    lease = run_lease(cfg)  # before any cluster: a second driver for this run exits here (2)
    try:
        # The token is a secret for this node's cluster: never on object storage.
        token_file = os.path.join(storage.node_local_dir(cfg.run_dir), "ray-auth-token")
        with ray_cluster(cfg, token_file=token_file) as info:
            startup.mark(cfg, "cluster_ready")
            run.cluster = info
            register_process(cfg.run_dir, DRIVER)  # for `make stack`
            preemption.start_stop_flag(cfg)  # a SIGTERM to the driver stops the workers cleanly
            print(start_block(cfg), flush=True)
            yield run
        if run.result is not None and run.result.error is not None:
            raise run.result.error
        diverged = divergence_of_this_run(cfg)
        if diverged is not None:
            raise TrainingDiverged(diverged)
    except (TrainingDiverged, ConfigError) as err:
        error = err  # one line below says it all
    except Exception as err:  # noqa: BLE001 - the run contract reports every failure
        error = err
        if _is_training_failure(err) and not isinstance(err, TrainingGaveUp):
            error = TrainingGaveUp(cfg.max_failures, err)  # the workers' tracebacks: Ray logs
        else:
            traceback.print_exc()
    summary = summarize(run, time.time() - cfg.driver_start_time, error)
    storage.write_text(storage.join(cfg.run_dir, "summary.json"), strict_json(summary, indent=2))
    lease.release()
    if error:
        if isinstance(error, TrainingDiverged):  # the one line naming the step, and what is safe
            hint = f"; last good checkpoint: {summary['checkpoint'] or 'none'}"
        elif summary["checkpoint"]:
            hint = f"; last complete checkpoint: {summary['checkpoint']}"
        else:
            hint = ""
        print(f"error: {summary['error']}{hint}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    print(f"SUMMARY {strict_json(summary)}", flush=True)  # the last line, also after an error
    if error:
        raise SystemExit(2 if isinstance(error, ConfigError) else 1)
    if summary["status"] == "preempted":
        raise SystemExit(preemption.EXIT_PREEMPTED)
