"""Run configuration: one flat dataclass per job, two profiles, `key=value` overrides.

Every knob a user can type on the command line is a field of a dataclass. A job picks its
dataclass (``TrainConfig`` or a subclass with extra fields), a ``smoke`` and a ``full``
profile (dicts of field values), and calls :func:`parse_args`. Everything is parsed and
validated *before* Ray starts, and every problem is reported as one sentence.

Flat rather than nested on purpose: ``num_workers=4 lr=3e-4`` is what people type, and one
flat namespace makes a clash between two knobs impossible to miss.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
import time
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from shared.runtime import elastic

PROFILES = ("smoke", "full")
# Ray placement-group strategies for the worker bundles (STRICT_* fail instead of degrading).
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class ConfigError(ValueError):
    """A bad setting. Its message is one sentence meant for the user."""


def setting(default: Any, help: str, **kwargs: Any) -> Any:
    """A user-facing dataclass field: a default and the one-line help `--help` prints."""
    return field(default=default, metadata={"help": help}, **kwargs)


@dataclass
class BaseConfig:
    """Settings every job has: where the run lives and how many workers it gets."""

    run_name: str = setting("", "Run name under storage_path/<job>; reusing a name resumes it.")
    storage_path: str = setting("runs", "Root for runs: <storage_path>/<job>/<run_name>/.")
    seed: int = setting(0, "Seed for model init, data order and dropout.")
    ray_address: str = setting(
        "", "Ray cluster to join ('auto' or host:port); empty = RAY_ADDRESS or a new local one."
    )
    num_workers: int = setting(2, "Training workers (one process per device).")
    use_gpu: bool = setting(False, "One GPU per worker; CPU + gloo otherwise.")
    cpus_per_worker: float = setting(1.0, "CPUs reserved per worker (fractional is fine).")
    placement_strategy: str = setting(
        "PACK", "How Ray places the workers: PACK (fewest nodes) or SPREAD (one per node first)."
    )
    worker_resources: str = setting(
        "", 'Extra Ray resources per worker as JSON, e.g. {"trainer": 1} (only such nodes).'
    )
    max_failures: int = setting(0, "Worker-group restarts Ray Train may do before giving up.")
    keep_checkpoints: int = setting(2, "Checkpoints kept in storage; 0 = all.")
    collective_timeout_s: float = setting(
        1800.0, "A collective (all-reduce, barrier ...) waiting longer fails the run, not hangs."
    )
    preemption_grace_s: float = setting(
        30.0, "After a SIGTERM: seconds to reach a step boundary and checkpoint, then exit."
    )

    # set by the launcher, not by users
    job: str = field(default="", metadata={"internal": True})
    profile: str = field(default="smoke", metadata={"internal": True})
    driver_start_time: float = field(default=0.0, metadata={"internal": True})
    # Start-up marks the driver records for SUMMARY's startup_s (shared/observability/startup.py).
    startup_marks: dict = field(default_factory=dict, metadata={"internal": True})

    def worker_resources_dict(self) -> dict[str, float]:
        try:
            resources = json.loads(self.worker_resources) if self.worker_resources else {}
        except ValueError:
            resources = None
        if not isinstance(resources, dict) or not all(
            isinstance(v, (int, float)) and v > 0 for v in resources.values()
        ):
            raise ConfigError(
                "worker_resources must be a JSON object of positive amounts, like "
                f'{{"trainer": 1}} (got {self.worker_resources!r}).'
            )
        return resources

    @property
    def job_storage(self) -> str:
        """Ray Train's storage_path: one folder per job, one run folder per run name inside."""
        return os.path.join(self.storage_path, self.job)

    @property
    def run_dir(self) -> str:
        """`<storage_path>/<job>/<run_name>`: checkpoints, metrics and summary.json."""
        return os.path.join(self.storage_path, self.job, self.run_name)

    def validate(self) -> None:
        """Raise ConfigError with one sentence for the first problem found."""
        _at_least(self, "num_workers", 1)
        _at_least(self, "max_failures", 0)
        _at_least(self, "keep_checkpoints", 0)
        if self.cpus_per_worker <= 0:
            raise ConfigError(f"cpus_per_worker must be > 0 (got {self.cpus_per_worker}).")
        if self.preemption_grace_s <= 0:
            raise ConfigError(f"preemption_grace_s must be > 0 (got {self.preemption_grace_s:g}).")
        if self.collective_timeout_s < 1:
            raise ConfigError(
                f"collective_timeout_s must be >= 1 (got {self.collective_timeout_s:g})."
            )
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ConfigError(
                f"placement_strategy must be one of {', '.join(PLACEMENT_STRATEGIES)} "
                f"(got '{self.placement_strategy}')."
            )
        self.worker_resources_dict()
        if "/" in self.run_name or self.run_name in (".", ".."):
            raise ConfigError(f"run_name must be a plain name, not a path (got '{self.run_name}').")


@dataclass
class TrainConfig(BaseConfig):
    """Settings shared by every training job. Jobs subclass it to add their own knobs."""

    # --- model ---------------------------------------------------------------------------
    model: str = setting("gpt2-tiny", "Model preset (see shared/models.py).")
    pretrained: str = setting("", "Hub name or path to load weights from; empty = random init.")
    init_from: str = setting(
        "",
        "ddp/fsdp/zero: start a new run from another run, checkpoint or HF export "
        "(shared/init_from.py).",
    )
    # The checkpoint (or export) init_from resolved to on the driver: workers load exactly it.
    init_checkpoint: str = field(default="", metadata={"internal": True})

    # --- data ----------------------------------------------------------------------------
    dataset: str = setting("", "Parquet file/dir (local, s3://, hf://); empty = generated.")
    text_column: str = setting("text", "Column holding the raw text.")
    tokenizer: str = setting("", "Hub name or local dir of a tokenizer; empty = trained locally.")
    seq_len: int = setting(64, "Tokens per training sequence (packed, no padding).")
    micro_batch_size: int = setting(8, "Sequences per worker per forward/backward.")
    grad_accum: int = setting(1, "Micro-batches accumulated per optimizer step.")
    max_samples: int = setting(0, "Use only the first N rows of the dataset; 0 = all.")
    smoke_rows: int = setting(2000, "Rows of generated text when no dataset is given.")
    pack_chunk_rows: int = setting(
        32, "Packed sequences per cached chunk file: the shuffle window and read granularity."
    )
    log_samples: bool = setting(False, "Record every consumed sample id (for verification).")

    # --- optimisation --------------------------------------------------------------------
    max_steps: int = setting(30, "Optimizer steps to train for (spans epochs as needed).")
    stop_at_step: int = setting(
        0, "Stop (with a checkpoint) after this step, keeping the max_steps schedule; 0 = off."
    )
    lr: float = setting(3e-3, "Peak learning rate (AdamW).")
    min_lr_ratio: float = setting(0.1, "Cosine decays to lr * min_lr_ratio.")
    warmup_steps: int = setting(3, "Linear warm-up steps before the cosine decay.")
    weight_decay: float = setting(0.1, "AdamW weight decay (not applied to biases and norms).")
    grad_clip: float = setting(1.0, "Clip the global gradient norm to this; 0 = off.")
    dtype: str = setting("auto", "Compute dtype: auto (bf16 on GPUs that have it) | fp32 | bf16.")

    # --- checkpointing and logging -------------------------------------------------------
    checkpoint_every: int = setting(10, "Save a checkpoint every N steps (and at the end).")
    eval_every: int = setting(
        10, "Held-out loss/perplexity every N steps and at the end (shared/evaluation.py); 0 = off."
    )
    eval_batches: int = setting(4, "Validation micro-batches per data-parallel rank per eval.")
    eval_dataset: str = setting(
        "", "Validation parquet (never trained on); empty = held-out generated rows."
    )
    export_at_end: bool = setting(
        False, "After the run, export the last checkpoint to <run_dir>/export/step_<N> (HF format)."
    )
    log_every: int = setting(5, "Print a progress line every N steps.")
    peak_tflops: float = setting(
        0.0, "Per-device peak TFLOP/s for MFU; 0 = look the device up (observability/metrics.py)."
    )
    tensorboard: bool = setting(True, "Write TensorBoard events to <run_dir>/tensorboard/.")
    profile_steps: str = setting(
        "", "Torch-profile steps a-b (e.g. 3-5) on every rank into <run_dir>/profile/; empty = off."
    )
    verbose: bool = setting(
        False, "Print Ray Data's full statistics (always in <run_dir>/data_stats.txt)."
    )

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step across all workers."""
        return self.micro_batch_size * self.grad_accum * self.num_workers

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len

    # fp16 needs loss scaling, which only the DeepSpeed engine does here (ZeroConfig adds it).
    dtypes = ("auto", "fp32", "bf16")

    def model_presets(self) -> dict:
        from shared.models import PRESETS  # local import: models pulls in torch

        return PRESETS

    @property
    def last_step(self) -> int:
        """The step this launch ends at: stop_at_step if set, else max_steps."""
        return self.stop_at_step or self.max_steps

    def validate(self) -> None:
        super().validate()
        for name in ("micro_batch_size", "grad_accum", "max_steps", "checkpoint_every"):
            _at_least(self, name, 1)
        for name in ("log_every", "smoke_rows", "eval_batches", "pack_chunk_rows"):
            _at_least(self, name, 1)
        for name in ("warmup_steps", "max_samples", "stop_at_step", "eval_every"):
            _at_least(self, name, 0)
        _at_least(self, "seq_len", 2)
        if self.lr <= 0:
            raise ConfigError(f"lr must be > 0 (got {self.lr}).")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio must be between 0 and 1 (got {self.min_lr_ratio}).")
        if self.grad_clip < 0:
            raise ConfigError(f"grad_clip must be >= 0 (got {self.grad_clip}).")
        if self.warmup_steps >= self.max_steps:
            raise ConfigError(
                f"warmup_steps ({self.warmup_steps}) must be smaller than "
                f"max_steps ({self.max_steps})."
            )
        if self.stop_at_step >= self.max_steps:
            raise ConfigError(
                f"stop_at_step ({self.stop_at_step}) must be smaller than "
                f"max_steps ({self.max_steps}); 0 turns it off."
            )
        self._validate_profile_steps()
        if self.dtype not in self.dtypes:
            raise ConfigError(
                f"dtype must be one of {', '.join(self.dtypes)} (got '{self.dtype}')."
            )
        presets = self.model_presets()
        if self.model not in presets:
            raise ConfigError(
                f"unknown model '{self.model}'; valid presets: {', '.join(sorted(presets))}."
            )
        if self.dataset and "://" not in self.dataset and not os.path.exists(self.dataset):
            raise ConfigError(f"dataset path '{self.dataset}' does not exist.")
        if (self.tokenizer and os.sep in self.tokenizer and "://" not in self.tokenizer
                and not os.path.isdir(self.tokenizer)):  # fmt: skip
            raise ConfigError(f"tokenizer directory '{self.tokenizer}' does not exist.")

    def _validate_profile_steps(self) -> None:
        from shared.observability.profiling import (
            parse_profile_steps,  # local import: profiling pulls torch
        )

        try:
            steps = parse_profile_steps(self.profile_steps)
        except ValueError:
            steps = (0, 0)
        if steps is not None and not 1 <= steps[0] <= steps[1] <= self.max_steps:
            raise ConfigError(
                f"profile_steps must be a step range a-b with 1 <= a <= b <= max_steps "
                f"({self.max_steps}), e.g. 3-5 (got '{self.profile_steps}')."
            )


@dataclass
class FSDPConfig(TrainConfig):
    """FSDP2 knobs (jobs/fsdp, and the dp axis of jobs/tp2d)."""

    reshard_after_forward: bool = setting(
        True,
        "Free gathered params after forward (re-gather for backward): less memory, more comms.",
    )
    cpu_offload: bool = setting(False, "Keep sharded params/grads/optimizer on CPU; step there.")
    activation_checkpointing: bool = setting(False, "Recompute block activations in backward.")
    blocks_per_group: int = setting(1, "Transformer blocks per fully_shard unit.")
    reduce_dtype: str = setting("fp32", "Gradient reduce-scatter dtype: fp32 | bf16.")

    def validate(self) -> None:
        super().validate()
        _at_least(self, "blocks_per_group", 1)
        if self.reduce_dtype not in ("fp32", "bf16"):
            raise ConfigError(f"reduce_dtype must be fp32 or bf16 (got '{self.reduce_dtype}').")


@dataclass
class ZeroConfig(TrainConfig):
    """DeepSpeed ZeRO knobs (jobs/zero)."""

    zero_stage: int = setting(3, "0 = DDP-like, 1 = shard optimizer, 2 = + grads, 3 = + params.")
    dtypes = ("auto", "fp32", "bf16", "fp16")  # DeepSpeed does fp16 loss scaling
    offload_optimizer: bool = setting(False, "Optimizer partition (and its step) on CPU memory.")
    offload_params: bool = setting(False, "Stage 3 only: parameter partitions on CPU memory.")

    def validate(self) -> None:
        super().validate()
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"zero_stage must be 0, 1, 2 or 3 (got {self.zero_stage}).")
        if self.offload_params and self.zero_stage != 3:
            raise ConfigError(
                f"offload_params needs zero_stage=3 (got zero_stage={self.zero_stage})."
            )
        if self.offload_optimizer and self.zero_stage == 0:
            raise ConfigError("offload_optimizer needs zero_stage 1, 2 or 3 (got 0).")


@dataclass
class TP2DConfig(FSDPConfig):
    """Tensor parallel x data parallel knobs (jobs/tp2d). num_workers must equal dp x tp."""

    dp: int = setting(2, "Data-parallel size: TP groups, sharded with FSDP (may span nodes).")
    tp: int = setting(2, "Tensor-parallel size: ranks per TP group (keep within one node).")

    @property
    def global_batch_size(self) -> int:
        """A TP group trains on one micro-batch together, so only dp multiplies the batch."""
        return self.micro_batch_size * self.grad_accum * self.dp

    def model_presets(self) -> dict:
        from shared.llama import LLAMA_PRESETS

        return LLAMA_PRESETS

    def validate(self) -> None:
        super().validate()
        _at_least(self, "dp", 1)
        _at_least(self, "tp", 1)
        if self.num_workers != self.dp * self.tp:
            raise ConfigError(
                f"num_workers ({self.num_workers}) must equal dp x tp = {self.dp} x {self.tp} "
                f"= {self.dp * self.tp}."
            )
        p = self.model_presets()[self.model]
        for what, size in (("attention heads", p.n_heads), ("KV heads", p.n_kv_heads),
                           ("hidden size", p.dim), ("FFN size", p.ffn_dim)):  # fmt: skip
            if size % self.tp:
                raise ConfigError(
                    f"tp ({self.tp}) must divide the {what} of {self.model} ({size})."
                )
        for name in ("micro_batch_size", "seq_len"):  # split across the TP group's ranks
            if getattr(self, name) % self.tp:
                raise ConfigError(
                    f"tp ({self.tp}) must divide {name} ({getattr(self, name)}): each TP rank "
                    "reads 1/tp of the micro-batch and sequence parallelism splits the sequence."
                )


@dataclass
class FaultToleranceConfig(TrainConfig):
    """Failure injection, elasticity and exact resume knobs (jobs/fault_tolerance)."""

    fail_at_step: int = setting(0, "Kill a worker right after this step's update; 0 = never.")
    fail_rank: int = setting(1, "Which rank fails.")
    fail_mode: str = setting("exit", "exit (os._exit) | sigkill | raise (Python exception).")
    fail_during_checkpoint: bool = setting(
        False, "Fail halfway through writing the checkpoint of fail_at_step instead."
    )
    fail_times: int = setting(1, "How many attempts fail (one-shot markers in the run dir).")
    min_workers: int = setting(0, "Elastic: run with min_workers..num_workers; 0 = fixed size.")
    elastic_resize_interval_s: float = setting(
        60.0, "Elastic: how often Ray Train checks whether the worker group can grow again."
    )
    keep_global_batch: bool = setting(
        True, "On a world-size change keep the global batch (adjust grad_accum), else per-worker."
    )
    sleep_per_step: float = setting(0.0, "Seconds to sleep per step (to watch or interrupt a run).")
    strategy: str = setting(
        "ddp", "ddp (rank 0 writes model.pt) or fsdp (every rank writes its DCP shards)."
    )

    def validate(self) -> None:
        super().validate()
        for name in ("fail_at_step", "fail_rank", "fail_times", "min_workers"):
            _at_least(self, name, 0)
        if self.fail_mode not in ("exit", "sigkill", "raise"):
            raise ConfigError(f"fail_mode must be exit, sigkill or raise (got '{self.fail_mode}').")
        if self.fail_at_step and self.fail_rank >= self.num_workers:
            raise ConfigError(
                f"fail_rank ({self.fail_rank}) must be below num_workers ({self.num_workers})."
            )
        if self.fail_at_step > self.max_steps:
            raise ConfigError(
                f"fail_at_step ({self.fail_at_step}) is after max_steps ({self.max_steps})."
            )
        if self.fail_during_checkpoint and self.fail_at_step % self.checkpoint_every:
            raise ConfigError(
                f"fail_during_checkpoint needs fail_at_step ({self.fail_at_step}) to be a "
                f"checkpoint step (a multiple of checkpoint_every={self.checkpoint_every})."
            )
        if self.min_workers > self.num_workers:
            raise ConfigError(
                f"min_workers ({self.min_workers}) must not exceed "
                f"num_workers ({self.num_workers})."
            )
        if self.sleep_per_step < 0:
            raise ConfigError(f"sleep_per_step must be >= 0 (got {self.sleep_per_step}).")
        if self.strategy not in ("ddp", "fsdp"):
            raise ConfigError(f"strategy must be ddp or fsdp (got '{self.strategy}').")
        if self.min_workers and self.keep_global_batch:
            problem = elastic.refusal(self.global_batch_size, self.min_workers, self.num_workers,
                                      self.micro_batch_size)  # fmt: skip
            if problem:
                raise ConfigError(problem)


def _at_least(cfg: Any, name: str, minimum: int) -> None:
    value = getattr(cfg, name)
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum} (got {value}).")


# ------------------------------------------------------------------------------------------
# key=value parsing


def user_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _parse_value(name: str, text: str, annotation: Any) -> Any:
    if annotation is bool:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name} must be true or false (got '{text}').")
    if annotation in (int, float):
        try:
            return annotation(text)
        except ValueError:
            noun = "an integer" if annotation is int else "a number"
            raise ConfigError(f"{name} must be {noun} (got '{text}').") from None
    if annotation is str:
        return text
    if isinstance(annotation, types.UnionType):  # e.g. `int | None`
        if text.lower() in ("none", "null", ""):
            return None
        (inner,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _parse_value(name, text, inner)
    raise TypeError(f"unsupported config type {annotation!r} for {name}")


def apply_overrides(cfg: BaseConfig, overrides: dict[str, str]) -> BaseConfig:
    """Return a copy of ``cfg`` with string overrides parsed to each field's type."""
    fields = user_fields(type(cfg))
    hints = typing.get_type_hints(type(cfg))
    values = {}
    for name, text in overrides.items():
        if name not in fields:
            raise ConfigError(
                f"unknown setting '{name}'; valid settings: {', '.join(sorted(fields))}."
            )
        values[name] = _parse_value(name, text, hints[name])
    return dataclasses.replace(cfg, **values)


def split_overrides(args: list[str]) -> dict[str, str]:
    overrides = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"expected key=value, got '{arg}'.")
        overrides[key.strip()] = value.strip()
    return overrides


def build_config(
    cls: type, profiles: dict[str, dict[str, Any]], profile: str, overrides: dict[str, str]
) -> Any:
    """Defaults <- profile <- command-line overrides, then validation."""
    if profile not in profiles:
        raise ConfigError(f"unknown profile '{profile}'; valid profiles: {', '.join(profiles)}.")
    cfg = cls(**profiles[profile])
    cfg = apply_overrides(cfg, overrides)
    cfg.profile = profile
    cfg.validate()
    if not cfg.run_name:
        cfg.run_name = default_run_name(profile)
    if "://" not in cfg.storage_path:  # workers run in another cwd: hand them absolute paths
        cfg.storage_path = os.path.abspath(cfg.storage_path)
    else:  # "$BUCKET_URI/runs" with a URI ending in "/" must not create an empty path segment
        scheme, rest = cfg.storage_path.split("://", 1)
        rest = re.sub("/{2,}", "/", rest)  # file:///mnt keeps its one leading "/"
        cfg.storage_path = f"{scheme}://{rest.rstrip('/') or '/'}"
    return cfg


def default_run_name(profile: str) -> str:
    """A fresh run each time, unless this is a retry of the same Anyscale job: its id is the
    same for every attempt, so a retried job resumes from its own checkpoints."""
    job_id = os.environ.get("ANYSCALE_PRODJOB_ID")
    return f"{profile}-{job_id}" if job_id else f"{profile}-{time.strftime('%Y%m%d-%H%M%S')}"


def describe(cls: type, profile: dict[str, Any] | None = None) -> str:
    """One line per setting with its value in ``profile`` (else the default) and its help."""
    profile = profile or {}
    lines = []
    for name, f in user_fields(cls).items():
        value = profile.get(name, f.default)
        lines.append(f"  {name}={value!r:<14} {f.metadata.get('help', '')}")
    return "\n".join(lines)


def parse_args(
    job: str,
    cls: type,
    profiles: dict[str, dict[str, Any]],
    argv: list[str] | None = None,
    description: str = "",
) -> Any:
    """Parse ``[--profile P] key=value ...``; on bad input print one line and exit 2."""
    # --help lists the values of the profile it runs with (--profile full --help: full's).
    chosen, _ = _profile_parser(add_help=False).parse_known_args(argv)
    profile = chosen.profile if chosen.profile in profiles else "smoke"
    parser = argparse.ArgumentParser(
        prog=f"jobs/{job}/main.py",
        description=description,
        epilog=f"settings (key=value), with the {profile} profile's values:\n"
        + describe(cls, profiles.get(profile)),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[_profile_parser(add_help=False)],
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved settings as JSON and exit (deployment tooling reads this)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    try:
        cfg = build_config(cls, profiles, args.profile, split_overrides(args.overrides))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    cfg.job = job
    cfg.driver_start_time = time.time()
    if args.print_config:
        print(json.dumps({"job": job, "profile": cfg.profile, **resolved_settings(cfg)}))
        raise SystemExit(0)
    return cfg


def _profile_parser(add_help: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=add_help)
    parser.add_argument("--profile", default="smoke", help="smoke (default) or full")
    return parser


def resolved_settings(cfg: BaseConfig) -> dict[str, Any]:
    """Every user-facing setting's value after profile and overrides."""
    return {name: getattr(cfg, name) for name in user_fields(type(cfg))}
