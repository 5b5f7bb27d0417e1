"""The settings every job shares: ``BaseConfig`` (where a run lives, how many workers) and
``TrainConfig`` (model, data, optimisation, checkpoints). Fields are declared with
:func:`setting` so ``--help`` can print each one's help line."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

PROFILES = ("smoke", "full")
# Ray placement-group strategies for the worker bundles (STRICT_* fail instead of degrading).
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class ConfigError(ValueError):
    """A bad setting. Its message is one sentence meant for the user."""


def first_line(err: BaseException) -> str:
    """An exception in a few words for a one-sentence message: its first line, or its type."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


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
        at_least(self, "num_workers", 1)
        at_least(self, "max_failures", 0)
        at_least(self, "keep_checkpoints", 0)
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
    model: str = setting(
        "gpt2-tiny", "Model preset: gpt2-* (shared/models/gpt2.py); tp2d: llama-* (llama.py)."
    )
    pretrained: str = setting("", "Hub name or path to load weights from; empty = random init.")
    init_from: str = setting(
        "",
        "ddp/fsdp/zero: start a new run from another run, checkpoint or HF export "
        "(shared/checkpoint/init_from.py).",
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
        from shared.models.gpt2 import PRESETS  # local import: models pulls in torch

        return PRESETS

    @property
    def last_step(self) -> int:
        """The step this launch ends at: stop_at_step if set, else max_steps."""
        return self.stop_at_step or self.max_steps

    def validate(self) -> None:
        super().validate()
        for name in ("micro_batch_size", "grad_accum", "max_steps", "checkpoint_every"):
            at_least(self, name, 1)
        for name in ("log_every", "smoke_rows", "eval_batches", "pack_chunk_rows"):
            at_least(self, name, 1)
        for name in ("warmup_steps", "max_samples", "stop_at_step", "eval_every"):
            at_least(self, name, 0)
        at_least(self, "seq_len", 2)
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


def at_least(cfg: Any, name: str, minimum: int) -> None:
    value = getattr(cfg, name)
    if value < minimum:
        raise ConfigError(f"{name} must be >= {minimum} (got {value}).")
