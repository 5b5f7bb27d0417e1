"""2D parallelism: tensor parallel inside a node, FSDP across nodes, on one (dp, tp) mesh.

Tensor parallelism splits every layer's matrices across the ``tp`` ranks of a TP group, so
each rank computes a slice of every layer and the group talks in **every layer** (hence TP
stays inside a node, on NVLink). Data parallelism (FSDP over the ``dp`` axis) replicates the
TP-sharded model across TP groups, which only talk once per step per layer (all-gather /
reduce-scatter), so it can cross nodes.

The plan, as in torchtitan (activations: S = sequence-sharded, R = replicated, V = vocab-sharded):

    tok_embeddings  RowwiseParallel       ids R      -> hidden S   (reduce-scatter)
    *_norm, norm    SequenceParallel      hidden S   -> hidden S   (local: norm is per token)
    attention/ffn   PrepareModuleInput    hidden S   -> hidden R   (all-gather)
    wq wk wv, w1 w3 ColwiseParallel       hidden R   -> heads/ffn sharded (no comm)
    wo, w2          RowwiseParallel       sharded    -> hidden S   (reduce-scatter)
    output          ColwiseParallel       hidden S   -> logits V   (all-gather in, no comm out)
    loss            loss_parallel         logits V   -> scalar     (cross-entropy over V shards)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from shared.observability.profiling import BACKWARD, FORWARD, HOST_TO_DEVICE, trace_range
from shared.parallel.fsdp import FSDPStrategy


def device_mesh_2d(device: torch.device, dp: int, tp: int) -> DeviceMesh:
    """Row-major (dp, tp) mesh: ranks tp*i .. tp*i + tp-1 form TP group i. Ray Train numbers
    the workers of a node consecutively, so with tp workers per node a TP group is one node."""
    return init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))


ROOT_PLAN = {
    "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    # Logits stay sharded over the vocabulary (a DTensor) for loss_parallel.
    "output": ColwiseParallel(
        input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
    ),
}

BLOCK_PLAN = {
    "attention_norm": SequenceParallel(),
    "attention": PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    ),
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    "ffn_norm": SequenceParallel(),
    "feed_forward": PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
    ),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard the Llama's matrices over the TP mesh with the plans above (sequence parallel
    norms, vocab-parallel output)."""
    parallelize_module(model, tp_mesh, ROOT_PLAN)
    for block in model.layers:
        parallelize_module(block, tp_mesh, BLOCK_PLAN)
    return model


class TP2DStrategy(FSDPStrategy):
    """FSDP2 over dp on top of TP; the loss is computed vocab-parallel.

    Gradient clipping, DCP checkpoints and memory accounting are FSDP's: every parameter is a
    DTensor on the 2-D mesh (FSDP's Shard(0) on dp x the TP placement on tp)."""

    name = "tp x fsdp"

    def forward_backward(self, input_ids: torch.Tensor, sync: bool) -> torch.Tensor:
        from shared.models.llama import next_token_targets

        with self.gradient_sync(sync), loss_parallel():
            # loss_parallel computes cross-entropy on vocab-sharded logits without gathering
            # them; its backward must run inside the same context.
            with trace_range(FORWARD):
                logits = self.model(input_ids)
                loss = torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), next_token_targets(input_ids).flatten()
                )
            with trace_range(BACKWARD):
                (loss / self.cfg.grad_accum).backward()
        loss = loss.detach()
        return loss.full_tensor() if isinstance(loss, DTensor) else loss


def gather_tp_batches(
    batches: Iterable[torch.Tensor], tp_mesh: DeviceMesh
) -> Iterator[torch.Tensor]:
    """Give every rank of a TP group the same micro-batch, without wasting data.

    Ray Train shards the dataset by *world* rank, but the ranks of one TP group must compute
    on identical inputs. Each rank reads ``micro_batch_size / tp`` sequences of its own
    shard; an all-gather inside the TP group concatenates them, so the group trains on all of
    them together and different TP groups (dp ranks) see disjoint data. Ray's equal split
    gives every rank the same number of batches, so the collectives stay in step.
    """
    group = tp_mesh.get_group()
    for local in batches:
        with trace_range(HOST_TO_DEVICE):  # NCCL gathers device tensors: copy before, not after
            local = local.to(tp_mesh.device_type, non_blocking=True)
        parts = [torch.empty_like(local) for _ in range(tp_mesh.size())]
        dist.all_gather(parts, local.contiguous(), group=group)
        yield torch.cat(parts)


class TPGroupSession:
    """A Session whose batches are shared within each TP group (see gather_tp_batches)."""

    def __init__(self, session, tp_mesh: DeviceMesh):
        self._session = session
        self._tp_mesh = tp_mesh

    def __getattr__(self, name):
        return getattr(self._session, name)

    def epoch_batches(
        self, epoch: int, start_sample: int, end_sample: int | None = None
    ) -> Iterator[torch.Tensor]:
        batches = self._session.epoch_batches(epoch, start_sample, end_sample)
        return gather_tp_batches(batches, self._tp_mesh)


def placement(mesh: DeviceMesh, node_id: str) -> list[dict]:
    """Every rank's node and (dp, tp) coordinates; raises if a TP group spans nodes."""
    rank = dist.get_rank()
    mine = {
        "rank": rank,
        "node": node_id,
        "dp": mesh["dp"].get_local_rank(),
        "tp": mesh["tp"].get_local_rank(),
    }
    table: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(table, mine)
    for dp in {row["dp"] for row in table}:
        nodes = {row["node"] for row in table if row["dp"] == dp}
        if len(nodes) > 1:
            raise RuntimeError(
                f"TP group dp={dp} spans nodes {sorted(nodes)}: TP talks in every layer, so give "
                "each node a multiple of tp workers (GPUs per node divisible by tp)."
            )
    return table
