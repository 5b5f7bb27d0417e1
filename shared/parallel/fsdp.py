"""FSDP2: shard parameters, gradients and optimizer states across the data-parallel ranks.

Each rank keeps 1/N of every sharded tensor. Before a block's forward (and again before its
backward) its parameters are **all-gathered**; after the backward its gradients are
**reduce-scattered**, so each rank ends with the gradient shard its optimizer shard needs.
Same math as DDP's all-reduce (all-reduce = reduce-scatter + all-gather), a third more
traffic when parameters are re-gathered for the backward, and model state per rank / N.
"""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
from torch.distributed.tensor import DTensor

from shared.models.structure import transformer_blocks
from shared.observability.profiling import GRADIENT_SYNC, trace_range
from shared.parallel.base import Strategy

DCP_DIR = "dcp"  # sharded model + optimizer; every rank writes its own files
SCHEDULER_FILE = "scheduler.pt"


def data_parallel_mesh(device: torch.device) -> DeviceMesh:
    """A 1-D mesh over every rank of the default process group (the one Ray Train made)."""
    world = torch.distributed.get_world_size()
    return init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: torch.dtype = torch.float32,
    reduce_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    blocks_per_group: int = 1,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """``fully_shard`` groups of ``blocks_per_group`` transformer blocks, then the root.

    Each ``fully_shard`` call is one all-gather/reduce-scatter unit: smaller units mean less
    memory for gathered parameters at once and more, smaller collectives. The root call takes
    what is left (embeddings, final norm, the tied LM head).
    """
    if activation_checkpointing:
        # Recompute each block's activations in the backward instead of storing them.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    options = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        # pin_memory needs an accelerator; on CPU hosts the offloaded copy stays pageable.
        "offload_policy": CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        if cpu_offload
        else OffloadPolicy(),
    }
    blocks = list(transformer_blocks(model))
    for start in range(0, len(blocks), blocks_per_group):
        group = blocks[start : start + blocks_per_group]
        fully_shard(
            group if len(group) > 1 else group[0],
            reshard_after_forward=reshard_after_forward,
            **options,
        )
    # The root's parameters are needed again right at the start of the backward (LM head), so
    # keeping them gathered after the forward saves one all-gather.
    fully_shard(model, reshard_after_forward=False, **options)
    return model


class ReduceScatterInNamedRange(DefaultReduceScatter):
    """FSDP2's default gradient reduce-scatter, marked ``gradient_sync`` in traces.

    FSDP2 reduce-scatters each unit's gradients from its post-backward hook, so these ranges
    sit inside ``backward``, one per FSDP unit (FSDP's own ``FSDP::post_backward_reduce``
    ranges are around them). Subclassing the default keeps FSDP's checks and its buffers."""

    def __call__(self, *args, **kwargs):
        with trace_range(GRADIENT_SYNC):
            return super().__call__(*args, **kwargs)


def name_gradient_sync(model: nn.Module) -> None:
    """Use :class:`ReduceScatterInNamedRange` in every ``fully_shard`` unit of ``model``."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_reduce_scatter(ReduceScatterInNamedRange())


class FSDPStrategy(Strategy):
    """Sharded model/optimizer; checkpoints are DCP shards written by every rank."""

    name = "fsdp2"

    def __init__(self, model: nn.Module, cfg, device: torch.device, dtype: torch.dtype):
        super().__init__(model, cfg, device, dtype)
        name_gradient_sync(model)

    def loss(self, input_ids: torch.Tensor) -> torch.Tensor:
        # No autocast: the MixedPrecisionPolicy already casts the gathered parameters.
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def gradient_sync(self, sync: bool):
        # Within an accumulation window skip the reduce-scatter until the last micro-batch
        # (gradients accumulate unsharded meanwhile: more memory, less communication).
        self.model.set_requires_gradient_sync(sync)
        return super().gradient_sync(sync)

    def clip_grad_norm(self) -> float:
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)

    def save(self, directory: str, rank: int) -> None:
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save(
            {"model": model_state, "optimizer": optim_state},
            checkpoint_id=os.path.join(directory, DCP_DIR),
        )
        if rank == 0:
            torch.save(self.scheduler.state_dict(), os.path.join(directory, SCHEDULER_FILE))

    def load(self, directory: str) -> None:
        """DCP reshards on load: a checkpoint written by N ranks loads into M."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=os.path.join(directory, DCP_DIR))
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optimizer"],
        )
        self.scheduler.load_state_dict(
            torch.load(os.path.join(directory, SCHEDULER_FILE), weights_only=True)
        )
