"""One config class per job that needs knobs beyond ``TrainConfig``."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config.base import ConfigError, TrainConfig, at_least, setting
from shared.runtime import elastic


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
        at_least(self, "blocks_per_group", 1)
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
        from shared.models.llama import LLAMA_PRESETS

        return LLAMA_PRESETS

    def validate(self) -> None:
        super().validate()
        at_least(self, "dp", 1)
        at_least(self, "tp", 1)
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
            at_least(self, name, 0)
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
