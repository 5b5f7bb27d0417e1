"""Memory math: the elements one rank holds per layout, and each strategy's bytes per GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from shared.config import ConfigError
from shared.planner.activations import activation_bytes
from shared.planner.hardware import PRECISIONS, Precision
from shared.planner.specs import ModelSpec, Tensor

ADAM_STEP_BYTES = 4  # torch.optim.AdamW's per-tensor `step` is a float32 scalar tensor
DS_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: flat groups pad to 2 * N elements
DS_SUB_GROUP_SIZE = 10**9  # ZeRO-3 zero_optimization.sub_group_size default (elements)
DS_REDUCE_BUCKET = 5 * 10**8  # ZeRO-1/2 zero_optimization.reduce_bucket_size default
DS_MASTER_BYTES = 4  # DeepSpeed keeps an fp32 master partition whatever the training dtype


def tp_shape(t: Tensor, tp: int) -> tuple[int, ...]:
    """The shape of TP rank 0's piece (torch.chunk: rank 0 gets the largest)."""
    if tp == 1 or t.tp_dim is None:
        return t.shape
    shape = list(t.shape)
    shape[t.tp_dim] = math.ceil(shape[t.tp_dim] / tp)
    return tuple(shape)


def fsdp_numel(shape: tuple[int, ...], n: int) -> int:
    """FSDP2: dim 0 chunked over n ranks, every shard padded to the largest chunk."""
    return math.ceil(shape[0] / n) * math.prod(shape[1:])


def local_numel(model: ModelSpec, tp: int = 1, fsdp: int = 1, blocks: bool | None = None) -> int:
    """Elements rank 0 holds after TP (``tp``) and then FSDP over ``fsdp`` ranks; ``blocks``
    restricts to block (True) or non-block (False) tensors."""
    return sum(
        fsdp_numel(tp_shape(t, tp), fsdp)
        for t in model.tensors
        if blocks is None or t.in_block == blocks
    )


def optimizer_groups(model: ModelSpec) -> list[list[Tensor]]:
    """``shared.optim.param_groups``: weight decay on matrices, none on biases and norms."""
    groups = [[t for t in model.tensors if len(t.shape) >= 2],
              [t for t in model.tensors if len(t.shape) < 2]]  # fmt: skip
    return [g for g in groups if g]


def ds_flat_partitions(model: ModelSpec, n: int) -> list[int]:
    """ZeRO-1/2: per param group, the flat group padded to a multiple of 2n, split n ways."""
    partitions = []
    for group in optimizer_groups(model):
        total = sum(t.numel for t in group)
        alignment = DS_ALIGNMENT * n
        partitions.append(math.ceil(total / alignment) * alignment // n)
    return partitions


def ds_param_partitions(model: ModelSpec, n: int) -> list[int]:
    """ZeRO-3: each parameter partitioned to ceil(numel / n); each param group is cut into
    sub-groups of about ``sub_group_size`` elements, each with its own Adam state."""
    sub_groups = []
    for group in optimizer_groups(model):
        size = 0
        for i, t in enumerate(group):
            size += math.ceil(t.numel / n)
            if size >= DS_SUB_GROUP_SIZE or i == len(group) - 1:
                sub_groups.append(size)
                size = 0
    return sub_groups


def step_counter_bytes(model: ModelSpec, tensors: int) -> int:
    return 0 if model.counts_only else ADAM_STEP_BYTES * tensors


# ------------------------------------------------------------------------------------------
# strategies


@dataclass
class Settings:
    gpus: int = 8
    gpus_per_node: int = 8
    gpu_mem: int = 80 * 1024**3
    headroom: int = 8 * 1024**3
    micro_batch: int = 8
    seq_len: int = 1024
    precision: Precision = PRECISIONS["bf16"]
    recompute: str = "none"
    tp: int = 1
    attention: str = "sdpa"  # sdpa (fused kernels: no score matrix) | eager (stores it)
    link: str = "nvlink"  # intra-node GPU link: nvlink | pcie

    @property
    def budget(self) -> int:
        return self.gpu_mem - self.headroom


@dataclass
class Estimate:
    """One strategy on the given GPUs: bytes one GPU (rank 0) holds."""

    key: str
    name: str
    layout: str
    # Model states in the keys shared/parallel measures (model_state_bytes_per_rank).
    state: dict[str, int] = field(default_factory=dict)
    offloaded: tuple[str, ...] = ()  # state keys kept in CPU memory instead of on the GPU
    activations: int = 0
    buffers: int = 0
    applicable: bool = True
    note: str = ""
    micro_batch: int = 0  # the settings this row was computed at
    recompute: str = ""

    def on_gpu(self, key: str) -> int:
        return 0 if key in self.offloaded else self.state.get(key, 0)

    @property
    def columns(self) -> dict[str, int]:
        """The table's columns; optimizer includes the fp32 master copy (the ZeRO paper's K)."""
        cols = {
            "params": self.on_gpu("params"),
            "grads": self.on_gpu("grads"),
            "optimizer": self.on_gpu("optimizer") + self.on_gpu("master_params"),
            "activations": self.activations,
            "buffers": self.buffers,
        }
        cols["total"] = sum(cols.values())
        return cols

    @property
    def cpu_bytes(self) -> int:
        return sum(self.state.get(k, 0) for k in self.offloaded)

    def fits(self, budget: int) -> bool | None:
        return self.columns["total"] <= budget if self.applicable else None


def torch_adam_state(model, settings, tp: int = 1, fsdp: int = 1) -> dict[str, int]:
    """DDP / FSDP2 / TP with torch AdamW: params, grads and moments on the same layout."""
    prec = settings.precision
    numel = local_numel(model, tp, fsdp)
    state = {
        "params": numel * prec.param,
        "grads": numel * prec.grad,
        "optimizer": numel * prec.adam + step_counter_bytes(model, len(model.tensors)),
    }
    if prec.master:
        state["master_params"] = numel * prec.master
    return state


def deepspeed_state(model, settings, stage: int) -> dict[str, int]:
    """What ZeroStrategy.model_state_bytes() measures, per stage."""
    prec, n = settings.precision, settings.gpus
    full = model.n_params
    parts = ds_param_partitions(model, n) if stage == 3 else ds_flat_partitions(model, n)
    part = sum(parts)
    return {
        "params": (part if stage == 3 else full) * prec.param,
        # ZeRO-1 holds the full gradients until the step; ZeRO-2/3 reduce into a partition.
        "grads": (full if stage == 1 else part) * prec.grad,
        "optimizer": part * prec.adam + step_counter_bytes(model, len(parts)),
        "master_params": part * DS_MASTER_BYTES,
    }


def zero_paper_bytes_per_gpu(psi: float, n_d: int, stage: int, k: int = 12) -> float:
    """Model-state bytes per GPU in the ZeRO paper's own arithmetic (Rajbhandari et al. 2020,
    figure 1 and table 1): 2 + 2 + K bytes per parameter, with stage 1 dividing the K bytes of
    optimizer state by N_d, stage 2 also the 2 bytes of gradients, stage 3 everything."""
    if stage == 0:
        return (2 + 2 + k) * psi
    if stage == 1:
        return 2 * psi + 2 * psi + k * psi / n_d
    if stage == 2:
        return 2 * psi + (2 + k) * psi / n_d
    return (2 + 2 + k) * psi / n_d


STRATEGY_KEYS = ("ddp", "zero1", "zero2", "fsdp2", "zero3", "zero3_offload", "tp", "tp_sp",
                 "tp_fsdp")  # fmt: skip


def model_state_per_rank(model: ModelSpec, strategy: str, gpus: int, precision: str = "fp32",
                         tp: int = 1) -> dict[str, int]:  # fmt: skip
    """The planner's prediction of a run's ``model_state_bytes_per_rank`` (what
    ``Strategy.model_state_bytes()`` measures), e.g. for the tests and ``make bench``."""
    settings = Settings(gpus=gpus, gpus_per_node=gpus, precision=PRECISIONS[precision], tp=tp)
    rows = {r.key: r for r in estimate_all(model, settings)}
    if strategy not in rows:
        raise ConfigError(f"unknown strategy '{strategy}'; valid: {', '.join(STRATEGY_KEYS)}.")
    return rows[strategy].state


def gathered_block_bytes(model, settings, shards: int, tp: int = 1) -> int:
    """FSDP2 / ZeRO-3 working set: two blocks' unsharded params (the one computing and the one
    prefetched), one block's unsharded grads before the reduce-scatter, and the root module's
    params, kept gathered for the whole step. Nothing to gather on a single shard."""
    if shards == 1 or not model.layers:
        return 0
    prec = settings.precision
    block = local_numel(model, tp, blocks=True) / model.layers
    root = local_numel(model, tp, blocks=False)
    return int((2 * block + root) * prec.param + block * prec.grad)


def estimate_all(model: ModelSpec, settings: Settings) -> list[Estimate]:
    n, t, prec = settings.gpus, settings.tp, settings.precision
    s, b, rc = settings.seq_len, settings.micro_batch, settings.recompute
    dense_acts = int(activation_bytes(model, s, b, prec, rc, attention=settings.attention))
    ddp_state = torch_adam_state(model, settings)
    ddp_buckets = ddp_state["grads"] if n > 1 else 0
    # ZeRO-1/2: the reduce bucket, and the fp32 copy of this rank's gradient partition that
    # the step makes (stage_1_and_2.py flattens the averaged gradients into the master dtype).
    zero_buffers = (
        min(DS_REDUCE_BUCKET, model.n_params) * prec.grad
        + sum(ds_flat_partitions(model, n)) * DS_MASTER_BYTES
    )
    rows = [
        Estimate("ddp", "DDP", f"dp={n}", ddp_state, activations=dense_acts, buffers=ddp_buckets),
        Estimate("zero1", "ZeRO-1", f"dp={n}", deepspeed_state(model, settings, 1),
                 activations=dense_acts, buffers=zero_buffers),
        Estimate("zero2", "ZeRO-2", f"dp={n}", deepspeed_state(model, settings, 2),
                 activations=dense_acts, buffers=zero_buffers),
        Estimate("fsdp2", "FSDP2", f"dp={n}", torch_adam_state(model, settings, fsdp=n),
                 activations=dense_acts, buffers=gathered_block_bytes(model, settings, n)),
        Estimate("zero3", "ZeRO-3", f"dp={n}", deepspeed_state(model, settings, 3),
                 activations=dense_acts, buffers=gathered_block_bytes(model, settings, n)),
        # offload_optimizer + offload_params: partitions, their grads and the step on the CPU.
        Estimate("zero3_offload", "ZeRO-3 + CPU offload", f"dp={n}, states in CPU RAM",
                 deepspeed_state(model, settings, 3),
                 offloaded=("params", "grads", "optimizer", "master_params"),
                 activations=dense_acts, buffers=gathered_block_bytes(model, settings, n)),
    ]  # fmt: skip
    rows += tensor_parallel_estimates(model, settings)
    if t == 1:
        for row in rows[-3:]:
            row.applicable = False
            row.note = tp_unavailable_reason(model, settings)
    for row in rows:
        row.micro_batch, row.recompute = b, rc
    return rows


def tensor_parallel_estimates(model: ModelSpec, settings: Settings) -> list[Estimate]:
    """TP and TP+SP replicate the TP-sharded model over dp = gpus / tp groups (DDP between
    them); TP x DP shards it again with FSDP over dp, as jobs/tp2d does."""
    n, t, prec = settings.gpus, max(settings.tp, 1), settings.precision
    dp = n // t
    s, b, rc = settings.seq_len, settings.micro_batch, settings.recompute
    tp_state = torch_adam_state(model, settings, tp=t)
    buckets = tp_state["grads"] if dp > 1 else 0
    layout = f"tp={t} x dp={dp}"
    return [
        Estimate("tp", "TP", layout, tp_state, buffers=buckets,
                 activations=int(activation_bytes(model, s, b, prec, rc, t=t,
                                                  attention=settings.attention))),
        Estimate("tp_sp", "TP + SP", layout, dict(tp_state), buffers=buckets,
                 activations=int(activation_bytes(model, s, b, prec, rc, t=t, sp=True,
                                              attention=settings.attention))),
        Estimate("tp_fsdp", "TP x DP (FSDP on dp)", layout,
                 torch_adam_state(model, settings, tp=t, fsdp=dp),
                 buffers=gathered_block_bytes(model, settings, dp, tp=t),
                 activations=int(activation_bytes(model, s, b, prec, rc, t=t, sp=True,
                                              attention=settings.attention))),
    ]  # fmt: skip


def tp_candidates(model: ModelSpec, gpus: int, gpus_per_node: int) -> list[int]:
    """TP sizes that split heads, KV heads and GPUs evenly and stay inside one node."""
    return [
        t
        for t in range(2, min(gpus, gpus_per_node) + 1)
        if model.heads % t == 0 and model.kv_heads % t == 0 and gpus % t == 0
    ]


def tp_unavailable_reason(model: ModelSpec, settings: Settings) -> str:
    if settings.gpus == 1:
        return "TP needs at least 2 GPUs."
    if tp_candidates(model, settings.gpus, settings.gpus_per_node):
        return "--tp 1 asks for no tensor parallelism."
    return (
        f"no tp in 2..{min(settings.gpus, settings.gpus_per_node)} divides the "
        f"{model.heads} heads, {model.kv_heads} KV heads and {settings.gpus} GPUs."
    )
