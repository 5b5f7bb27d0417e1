"""DeepSpeed ZeRO: partition optimizer states (stage 1), + gradients (2), + parameters (3).

Communication: stage 1 and 2 replace DDP's all-reduce with a reduce-scatter of gradients (each
rank updates only its partition) followed by an all-gather of the updated parameters; stage 3
also all-gathers each layer's parameters before its forward and backward, like FSDP.
Offload moves the optimizer partition (and, stage 3, the parameters) to CPU memory; the step
then runs on the CPU.

Config-driven, as DeepSpeed intends: :func:`deepspeed_config` turns the run config into the
DeepSpeed dict, and ``deepspeed.initialize`` builds the engine inside the process group that
Ray Train (or torchrun) already created.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings

import torch
from torch import nn

from shared import optim
from shared.observability.metrics import tensor_bytes
from shared.observability.profiling import (
    BACKWARD,
    FORWARD,
    GRADIENT_SYNC,
    OPTIMIZER_STEP,
    in_range,
    trace_range,
)
from shared.parallel.base import Strategy

ENGINE_TAG = "engine"  # DeepSpeed's sub-directory inside our checkpoint directory


def deepspeed_config(cfg, dtype: torch.dtype, on_gpu: bool) -> dict:
    """The DeepSpeed config for a run. Every value that DeepSpeed would otherwise default is
    explicit (gradient_clipping defaults to 1.0 in 0.19, for instance)."""
    zero: dict = {"stage": cfg.zero_stage}
    if cfg.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if cfg.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        # fp16 only where the device supports it (resolve_dtype); loss_scale 0 = dynamic.
        "fp16": {"enabled": dtype == torch.float16, "loss_scale": 0},
        # We pass torch's AdamW: the same optimizer as the other strategies (identical
        # numerics), and no 6-minute fused_adam / cpu_adam compile on first use.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # the shared loop prints progress
        "wall_clock_breakdown": False,
    }


def _quiet_deprecated_collectives() -> None:
    """DeepSpeed 0.19 calls torch.distributed's renamed collectives and torch warns on every
    call; the rename is DeepSpeed's to make, the warnings bury the progress lines."""
    warnings.filterwarnings(
        "ignore",
        message=r".*is deprecated\. Please use `torch\.distributed\.",
        category=FutureWarning,
    )


def _skip_shm_comm_build() -> None:
    """On CPU DeepSpeed compiles a shared-memory collective extension (~3 min with g++) at
    initialize; gloo is what Ray Train set up, so use it as is."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class ZeroStrategy(Strategy):
    """The DeepSpeed engine does accumulation, clipping, the step and the LR schedule."""

    def __init__(self, model: nn.Module, cfg, device: torch.device, dtype: torch.dtype):
        # DeepSpeed picks its accelerator at import; say which instead of letting it probe
        # (and warn) on a CPU-only host.
        os.environ.setdefault("DS_ACCELERATOR", device.type)
        import deepspeed

        _quiet_deprecated_collectives()
        if device.type == "cpu":
            _skip_shm_comm_build()
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self.name = f"zero-{cfg.zero_stage}" + (
            "+offload" if cfg.offload_optimizer or cfg.offload_params else ""
        )
        self.ds_config = deepspeed_config(cfg, dtype, device.type == "cuda")
        self.model, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            optimizer=optim.build_adamw(model, cfg.lr, cfg.weight_decay),
            lr_scheduler=functools.partial(optim.warmup_cosine, cfg=cfg),
            config=self.ds_config,
            dist_init_required=False,
        )
        self.measured_state_bytes = None
        self._peak_grad_bytes = 0
        # The engine reduces gradients in allreduce_gradients() at the end of each backward
        # (stage 1: at the accumulation boundary; stages 2/3: what their backward hooks have
        # not reduced yet). Wrapping the instance's method marks it in traces.
        self.model.allreduce_gradients = in_range(GRADIENT_SYNC, self.model.allreduce_gradients)

    def loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The engine holds the parameters in the configured dtype; no autocast needed.
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def forward_backward(self, input_ids: torch.Tensor, sync: bool) -> torch.Tensor:
        # DeepSpeed counts micro-batches itself: backward scales by 1/grad_accum and step()
        # only updates at the accumulation boundary, which matches the loop's `sync`.
        with trace_range(FORWARD):
            loss = self.loss(input_ids)
        with trace_range(BACKWARD):
            self.model.backward(loss)
        if self.measured_state_bytes is None:  # gradients exist only between backward and step
            self._peak_grad_bytes = max(self._peak_grad_bytes, _held_grad_bytes(self))
        # The engine's step: at the accumulation boundary clip + update (+ ZeRO's all-gather of
        # the updated partitions); otherwise only counts the micro-batch.
        with trace_range(OPTIMIZER_STEP):
            self.model.step()
        return loss.detach()

    def optimizer_step(self) -> float:
        if self.measured_state_bytes is None:  # Adam moments exist from the first step on
            self.measured_state_bytes = {**self.model_state_bytes(), "grads": self._peak_grad_bytes}
        norm = self.model.get_global_grad_norm()
        return float(norm) if norm is not None else None  # stage 0 does not compute it

    def save(self, directory: str, rank: int) -> None:
        # Collective: every rank writes its own partitions (and rank 0 the module states).
        self.model.save_checkpoint(directory, tag=ENGINE_TAG)

    def load(self, directory: str) -> None:
        """Every rank loads its partitions. A checkpoint written by another number of ranks
        goes through DeepSpeed's universal format first (one file per parameter, repartitioned
        on load): the resume contract lets a ZeRO run change its world size, like fsdp."""
        written_by = saved_world_size(os.path.join(directory, ENGINE_TAG))
        if written_by in (0, self.model.dp_world_size):  # 0: stage 0 keeps no partitions
            self._load(directory, ENGINE_TAG)
            return
        started = time.perf_counter()
        with universal_checkpoint(os.path.join(directory, ENGINE_TAG)) as (parent, tag):
            self._load_universal(parent, tag)
        if self.model.global_rank == 0:
            print(f"ZeRO checkpoint of world size {written_by} loaded at world size "
                  f"{self.model.dp_world_size} through DeepSpeed's universal format "
                  f"({time.perf_counter() - started:.1f} s)", flush=True)  # fmt: skip

    def _load(self, directory: str, tag: str) -> None:
        path, _ = self.model.load_checkpoint(
            directory, tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        if path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint '{tag}' in {directory}")

    def _load_universal(self, directory: str, tag: str) -> None:
        # DeepSpeed reads `checkpoint.load_universal` from its config only while loading, so
        # it is switched on for this load instead of for the whole run.
        optimizer = self.model.optimizer.optimizer  # the torch AdamW inside ZeRO's wrapper
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        self.model._config.load_universal_checkpoint = True
        try:
            self._load(directory, tag)
        finally:
            self.model._config.load_universal_checkpoint = False
        # Two defects of DeepSpeed 0.19.8's universal load, each of which changes the next
        # update (tests/dist/test_zero_universal.py): every param group gets the first group's
        # hyperparameters (our no-decay group would decay), and every group's state gets the
        # same `step` tensor, which AdamW then increments once per group per step.
        for group, before in zip(optimizer.param_groups, groups, strict=True):
            group.update({k: v for k, v in before.items() if k != "lr"})  # lr: the schedule's
        for state in optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    def model_state_bytes(self) -> dict[str, int]:
        """What this rank holds, read from DeepSpeed's own buffers.

        params: the working copy (stage 3: only the local partition, ``ds_tensor``).
        grads: the most gradient bytes held during the first accumulation window (stage 1
            accumulates full gradients and keeps only its partition after reducing; stage 2
            reduces into a partition as the backward runs; stage 3 into a flat partition).
        optimizer: Adam moments + step counters (partitioned from stage 1 on).
        master_params: the fp32 master partition DeepSpeed keeps for its optimizer. The ZeRO
            paper counts it as optimizer state (K = 12 bytes/param with Adam in mixed
            precision); DeepSpeed keeps it even in fp32 training, where it duplicates the
            working copy's partition, so it is reported on its own.
        """
        stage3 = self.cfg.zero_stage == 3
        zero_opt = self.optimizer
        inner = getattr(zero_opt, "optimizer", zero_opt)
        optimizer_tensors = [
            v for s in inner.state.values() for v in s.values() if torch.is_tensor(v)
        ]
        masters = getattr(
            zero_opt,
            "fp32_partitioned_groups_flat" if stage3 else "single_partition_of_fp32_groups",
            [],
        )
        return {
            "params": tensor_bytes(
                p.ds_tensor if stage3 else p for p in self.model.module.parameters()
            ),
            "grads": _held_grad_bytes(self),
            "optimizer": tensor_bytes(optimizer_tensors),
            "master_params": tensor_bytes(masters),
        }


def saved_world_size(engine_dir: str) -> int:
    """Ranks that wrote a DeepSpeed checkpoint: one optimizer partition file each (stages
    1-3; stage 0 writes none and loads on any number of ranks)."""
    return len(glob.glob(os.path.join(engine_dir, "*zero_pp_rank_*_optim_states.pt")))


@contextlib.contextmanager
def universal_checkpoint(engine_dir: str):
    """(directory, tag) of ``engine_dir`` converted to DeepSpeed's universal format, in a
    temporary directory of this rank's (removed afterwards).

    Each rank converts for itself, as each rank downloads the checkpoint for itself: no
    shared disk is assumed. A resize is rare and the conversion costs about what the
    download does; for a large model convert once with the same command and start from it.
    """
    parent = tempfile.mkdtemp(prefix="zero-universal-")
    tag = "universal"
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal",
           "--input_folder", engine_dir, "--output_folder", os.path.join(parent, tag),
           "--num_extract_workers", "1", "--num_merge_workers", "1",
           "--inject_missing_state"]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"DeepSpeed could not convert {engine_dir} to its universal "
                               f"format:\n{(done.stderr or done.stdout)[-3000:]}")  # fmt: skip
        yield parent, tag
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def _held_grad_bytes(strategy: ZeroStrategy) -> int:
    zero_opt = strategy.optimizer
    held = tensor_bytes(p.grad for p in strategy.model.module.parameters() if p.grad is not None)
    if strategy.cfg.zero_stage == 3:
        return held + tensor_bytes([zero_opt.grad_partitions_flat_buffer])
    if strategy.cfg.zero_stage in (1, 2):
        averaged = zero_opt.averaged_gradients
        partitions = sum(tensor_bytes(v) for v in averaged.values() if v)
        in_partition = getattr(zero_opt, "grads_in_partition", None)
        # With contiguous gradients the averaged partitions are views of grads_in_partition.
        partitions = max(
            partitions, tensor_bytes([in_partition]) if torch.is_tensor(in_partition) else 0
        )
        held += partitions
    return held
