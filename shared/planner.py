"""Memory planner and decision framework: which parallelism strategy fits, and why.

    python -m shared.planner --preset gpt2-xl --gpus 8 --gpu-mem 16GiB
    python -m shared.planner --config path/to/config.json --gpus 16 --gpus-per-node 8 --tp 8
    python -m shared.planner --params 7e9 --layers 32 --hidden 4096 --heads 32 --vocab 32000 --json

For every strategy the templates implement (DDP, ZeRO-1/2/3, ZeRO-3 + CPU offload, FSDP2, TP,
TP + sequence parallel, TP x FSDP) it estimates the bytes one GPU holds, split into parameters,
gradients, optimizer states, activations and framework buffers, says whether that fits the GPU
memory minus headroom, and recommends a strategy with the reason.

Sources of the formulas
-----------------------
Model states - Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models" (arXiv:1910.02054), section 3.1 and 5: mixed-precision Adam keeps 2 bytes of
fp16/bf16 parameters, 2 bytes of gradients and K = 12 bytes of optimizer state (fp32 master
weights, momentum, variance) per parameter, 16 bytes in all. With N_d data-parallel ranks:

    baseline (DDP)        (2 + 2 + K) * Psi
    P_os   (ZeRO-1)       2 * Psi + 2 * Psi + K * Psi / N_d
    P_os+g (ZeRO-2)       2 * Psi + (2 + K) * Psi / N_d
    P_os+g+p (ZeRO-3)     (2 + 2 + K) * Psi / N_d

The planner applies these per tensor, the way the frameworks lay the tensors out, so that its
numbers equal what the strategies in ``shared/parallel`` measure (``model_state_bytes()``):

* FSDP2 shards every parameter on dim 0 and pads the shards to equal size: a rank holds
  ``ceil(d0 / N) * (other dims)`` elements of each tensor (torch.chunk; rank 0 has the largest).
* DeepSpeed ZeRO-1/2 flattens each optimizer param group and pads it to a multiple of
  ``2 * N`` elements (``nccl_start_alignment_factor = 2`` in ``stage_1_and_2.py``); every rank
  owns ``padded / N``. ZeRO-3 partitions each parameter to ``ceil(numel / N)``
  (``partition_parameters._aligned_size``).
* DeepSpeed keeps an fp32 master copy of its partition *even in fp32 training*
  (``single_partition_of_fp32_groups`` / ``fp32_partitioned_groups_flat``): reported as
  ``master_params`` and counted with the optimizer states, as the ZeRO paper's K does.
* torch's AdamW keeps a 4-byte ``step`` tensor per parameter tensor; DeepSpeed one per flat
  (sub-)group. Parameters are counted as stored: a tied embedding once, position embeddings in
  (``shared.models.count_params`` leaves them out because it counts FLOPs, not bytes).
* Tensor parallelism splits the matrices (Megatron / torchtitan plans, see
  ``shared/parallel/tp.py``) and replicates norms and row-parallel biases on every TP rank.

Activations - Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models" (arXiv:2205.05198), section 4, bytes per transformer layer with 16-bit activations,
sequence s, micro-batch b, hidden h, heads a, tensor-parallel size t:

    no parallelism             s*b*h * (34 + 5*a*s/h)
    tensor parallel            s*b*h * (10 + 24/t + 5*a*s/(h*t))
    tensor + sequence parallel s*b*h/t * (34 + 5*a*s/h)
    selective recomputation    drops the 5*a*s/h term (attention scores, softmax, dropout)
    full recomputation         keeps only the layer input, 2*s*b*h (2*s*b*h/t with SP)

plus the output layer and loss, 4*s*b*h*(1 + v/h) (/t with SP; the paper's section 4 on the
output layer, as in ``megatron/training/theoretical_memory_usage.py``). The 34 is 18 + 4*f/h
with f = 4h the MLP width (24 = 8 + 4*f/h under TP); the planner keeps that general form and
counts a gated (SwiGLU) MLP's inner activations twice (it stores the w1 and w3 outputs, the
SiLU and the product, where GELU stores two). The formulas include dropout masks and a full
K (GQA stores less): upper bounds for Llama-style models. Flash attention (PyTorch SDPA on
GPU) does not store the a*s*s scores either: model it with ``--recompute selective``. fp32
activations double everything but the logits, which the loss keeps in fp32 anyway.

Buffers - what the frameworks hold besides the model states, stated where it matters:
torch DDP keeps its all-reduce buckets as a second copy of the gradients
(``gradient_as_bucket_view=False`` is the default); DeepSpeed ZeRO-1/2 casts each rank's
gradient partition to fp32 for the step and reduces through a bucket of
``reduce_bucket_size`` (5e8) elements; FSDP2 and ZeRO-3 gather the unsharded parameters of the
block being computed and of the one prefetched, plus that block's unsharded gradients before
the reduce-scatter, and the root module's (embeddings) for the whole step (``apply_fsdp`` does
not reshard the root after forward).

The total is a conservative sum: activations are freed during the backward while gradients
fill in, so a real peak is somewhat lower.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from shared.config import ConfigError

# ------------------------------------------------------------------------------------------
# sizes

UNITS = {
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_size(text: str, what: str) -> int:
    """Bytes from '16GiB', '80GB', '80 GB', '17179869184' or '1.6e10'."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else ""
    if not match or unit not in UNITS and unit:
        raise ConfigError(
            f"cannot parse {what} '{text}': give bytes or a size such as 16GiB or 80GB."
        )
    return int(float(match.group(1)) * UNITS[unit or "b"])


def format_size(n: float) -> str:
    """Binary units, three significant digits: what nvidia-smi and torch.cuda report."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------------------------------
# the model: every parameter tensor, with how TP splits it


@dataclass(frozen=True)
class Tensor:
    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  # the dim tensor parallelism splits; None = replicated on TP ranks
    in_block: bool  # part of a repeated transformer block (one FSDP / ZeRO-3 gather unit)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    default_seq_len: int
    tensors: tuple[Tensor, ...]
    gated_mlp: bool = False  # SwiGLU (Llama) vs GELU (GPT-2)
    experts: int = 1  # MoE experts per layer (1 = dense)
    experts_per_token: int = 1
    # --params: only the count is known, so there are no per-tensor step counters or padding.
    counts_only: bool = False

    @property
    def n_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    def describe(self) -> str:
        moe = f", {self.experts} experts (top-{self.experts_per_token})" if self.experts > 1 else ""
        count = self.n_params
        size = f"{count / 1e9:.3g}B" if count >= 1e9 else f"{count / 1e6:.3g}M"
        return (
            f"{self.name} ({size} params: {self.layers} layers, hidden "
            f"{self.hidden}, {self.heads} heads, vocab {self.vocab}{moe})"
        )


def gpt2_tensors(layers: int, hidden: int, vocab: int, positions: int, ffn: int = 0):
    """``GPT2LMHeadModel``'s parameters in ``named_parameters()`` order. Conv1D weights are
    [in, out]: column-parallel splits dim 1, row-parallel dim 0 (Megatron's GPT-2 plan). The LM
    head is tied to ``wte`` and so is not a parameter of its own."""
    ffn = ffn or 4 * hidden
    out = [Tensor("transformer.wte.weight", (vocab, hidden), 0, False),
           Tensor("transformer.wpe.weight", (positions, hidden), None, False)]  # fmt: skip
    for i in range(layers):
        p = f"transformer.h.{i}."
        out += [
            Tensor(p + "ln_1.weight", (hidden,), None, True),
            Tensor(p + "ln_1.bias", (hidden,), None, True),
            Tensor(p + "attn.c_attn.weight", (hidden, 3 * hidden), 1, True),
            Tensor(p + "attn.c_attn.bias", (3 * hidden,), 0, True),
            Tensor(p + "attn.c_proj.weight", (hidden, hidden), 0, True),
            Tensor(p + "attn.c_proj.bias", (hidden,), None, True),
            Tensor(p + "ln_2.weight", (hidden,), None, True),
            Tensor(p + "ln_2.bias", (hidden,), None, True),
            Tensor(p + "mlp.c_fc.weight", (hidden, ffn), 1, True),
            Tensor(p + "mlp.c_fc.bias", (ffn,), 0, True),
            Tensor(p + "mlp.c_proj.weight", (ffn, hidden), 0, True),
            Tensor(p + "mlp.c_proj.bias", (hidden,), None, True),
        ]
    out += [Tensor("transformer.ln_f.weight", (hidden,), None, False),
            Tensor("transformer.ln_f.bias", (hidden,), None, False)]  # fmt: skip
    return tuple(out)


def llama_tensors(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    tied: bool = False,
    experts: int = 1,
):
    """``shared.llama.Llama``'s parameters in order, TP dims as in ``shared/parallel/tp.py``:
    wq/wk/wv/w1/w3 and the output colwise (dim 0 of [out, in]), wo/w2 rowwise (dim 1), the
    token embedding rowwise (dim 0, vocab rows), norms replicated. An MoE layer has ``experts``
    copies of the MLP and a router (Mixtral's layout)."""
    head_dim = hidden // heads
    out = [Tensor("tok_embeddings.weight", (vocab, hidden), 0, False)]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            Tensor(p + "attention_norm.weight", (hidden,), None, True),
            Tensor(p + "attention.wq.weight", (heads * head_dim, hidden), 0, True),
            Tensor(p + "attention.wk.weight", (kv_heads * head_dim, hidden), 0, True),
            Tensor(p + "attention.wv.weight", (kv_heads * head_dim, hidden), 0, True),
            Tensor(p + "attention.wo.weight", (hidden, heads * head_dim), 1, True),
            Tensor(p + "ffn_norm.weight", (hidden,), None, True),
        ]
        if experts > 1:
            out.append(Tensor(p + "feed_forward.router.weight", (experts, hidden), None, True))
        for e in range(experts):
            q = p + (f"feed_forward.experts.{e}." if experts > 1 else "feed_forward.")
            out += [
                Tensor(q + "w1.weight", (ffn, hidden), 0, True),
                Tensor(q + "w2.weight", (hidden, ffn), 1, True),
                Tensor(q + "w3.weight", (ffn, hidden), 0, True),
            ]
    out.append(Tensor("norm.weight", (hidden,), None, False))
    if not tied:
        out.append(Tensor("output.weight", (vocab, hidden), 0, False))
    return tuple(out)


# Llama 2 shapes (Touvron et al. 2023, table 1 and the released configs): the planner's
# "7B/13B/70B" presets. They are not training presets of jobs/tp2d.
LLAMA2_SHAPES = {
    "llama-7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008),
    "llama-13b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824),
    "llama-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
}
LLAMA2_VOCAB, LLAMA2_CONTEXT = 32000, 4096
GPT2_VOCAB = 50257  # the GPT-2 tokenizer; the tp2d full profile uses it for llama-500m too


def preset_names() -> list[str]:
    from shared.llama import LLAMA_PRESETS
    from shared.models import PRESETS

    return sorted([*PRESETS, *LLAMA_PRESETS, *LLAMA2_SHAPES])


def from_preset(name: str, vocab: int = 0, seq_len: int = 0) -> ModelSpec:
    """A preset of ``shared.models`` / ``shared.llama`` (the same numbers the jobs train) or a
    Llama 2 shape. ``vocab`` defaults to the real tokenizer's (the smoke runs train a 512-token
    one: pass ``vocab=512`` to compare with them)."""
    from shared.llama import LLAMA_PRESETS
    from shared.models import PRESETS

    if name in PRESETS:
        p = PRESETS[name]
        vocab = vocab or GPT2_VOCAB
        # build_gpt2 widens the position table to the sequence length when that is longer.
        positions = max(p.n_positions, seq_len)
        return ModelSpec(
            name,
            p.n_layer,
            p.n_embd,
            p.n_head,
            p.n_head,
            4 * p.n_embd,
            vocab,
            p.n_positions,
            gpt2_tensors(p.n_layer, p.n_embd, vocab, positions),
        )
    if name in LLAMA_PRESETS or name in LLAMA2_SHAPES:
        if name in LLAMA_PRESETS:
            p = LLAMA_PRESETS[name]
            dims = dict(dim=p.dim, n_layers=p.n_layers, n_heads=p.n_heads,
                        n_kv_heads=p.n_kv_heads, ffn_dim=p.ffn_dim)  # fmt: skip
            vocab, context = vocab or GPT2_VOCAB, p.max_seq_len
        else:
            dims, vocab, context = LLAMA2_SHAPES[name], vocab or LLAMA2_VOCAB, LLAMA2_CONTEXT
        return _llama_spec(name, **dims, vocab=vocab, context=context)
    raise ConfigError(f"unknown preset '{name}'; valid presets: {', '.join(preset_names())}.")


def _llama_spec(name, dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab, context,
                tied=False, experts=1, experts_per_token=1) -> ModelSpec:  # fmt: skip
    tensors = llama_tensors(n_layers, dim, n_heads, n_kv_heads, ffn_dim, vocab, tied, experts)
    return ModelSpec(
        name,
        n_layers,
        dim,
        n_heads,
        n_kv_heads,
        ffn_dim,
        vocab,
        context,
        tensors,
        gated_mlp=True,
        experts=experts,
        experts_per_token=experts_per_token,
    )


def from_hf_config(path: str, vocab: int = 0, seq_len: int = 0) -> ModelSpec:
    """A transformers ``config.json``: GPT-2 (``n_embd`` ...) or Llama-style (``hidden_size``
    ...: llama, mistral, mixtral, qwen2 and kin), MoE from ``num_local_experts``."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist.")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read '{path}' as JSON: {err}.") from None
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path

    def need(*keys: str) -> int:
        for key in keys:
            if cfg.get(key) is not None:
                return int(cfg[key])
        raise ConfigError(f"{path} has no '{keys[0]}': cannot size the model.")

    vocab = vocab or need("vocab_size")
    if cfg.get("model_type") == "gpt2" or "n_embd" in cfg:
        layers, hidden, heads = need("n_layer"), need("n_embd"), need("n_head")
        ffn = int(cfg.get("n_inner") or 4 * hidden)
        positions = max(int(cfg.get("n_positions", 1024)), seq_len)
        tensors = gpt2_tensors(layers, hidden, vocab, positions, ffn)
        return ModelSpec(name, layers, hidden, heads, heads, ffn, vocab,
                         int(cfg.get("n_positions", 1024)), tensors)  # fmt: skip
    heads = need("num_attention_heads")
    return _llama_spec(
        name,
        dim=need("hidden_size"),
        n_layers=need("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        ffn_dim=need("intermediate_size"),
        vocab=vocab,
        context=int(cfg.get("max_position_embeddings") or 2048),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        experts=int(cfg.get("num_local_experts") or cfg.get("num_experts") or 1),
        experts_per_token=int(cfg.get("num_experts_per_tok") or 1),
    )


def from_counts(params: int, layers: int, hidden: int, heads: int, vocab: int,
                ffn: int = 0, kv_heads: int = 0, seq_len: int = 0) -> ModelSpec:  # fmt: skip
    """Only the parameter count and the shape numbers activations need: the model states follow
    the ZeRO paper's Psi arithmetic (no per-tensor padding or step counters). One embedding
    table (vocab x hidden) is taken as the non-block part, the rest as ``layers`` equal blocks."""
    embedding = min(params, vocab * hidden)
    tensors = (Tensor("embedding", (embedding,), 0, False),
               Tensor("blocks", (params - embedding,), 0, True))  # fmt: skip
    return ModelSpec(f"{params / 1e9:.3g}B-parameter model", layers, hidden, heads,
                     kv_heads or heads, ffn or 4 * hidden, vocab, seq_len or 2048, tensors,
                     counts_only=True)  # fmt: skip


# ------------------------------------------------------------------------------------------
# precision: bytes per parameter of each model state


@dataclass(frozen=True)
class Precision:
    name: str
    param: int  # the working copy forward/backward use
    grad: int
    adam: int  # exp_avg + exp_avg_sq, fp32
    master: int  # fp32 master weights (mixed precision only)
    activation: int  # bytes per activation element

    def describe(self) -> str:
        if self.name == "fp32":
            return "fp32 (4 + 4 + 8 bytes/param; DeepSpeed adds a 4-byte fp32 master)"
        return (
            f"{self.name} mixed precision ({self.param} + {self.grad} + "
            f"{self.adam + self.master} bytes/param)"
        )


PRECISIONS = {
    "fp32": Precision("fp32", param=4, grad=4, adam=8, master=0, activation=4),
    # The ZeRO paper's mixed-precision Adam: 2 + 2 + K with K = 12 (master 4, m 4, v 4).
    # torch autocast DDP and FSDP2's MixedPrecisionPolicy hold the same 16 bytes as fp32
    # params + grads (4 + 4) and Adam (8); the split between the columns is the paper's.
    "bf16": Precision("bf16", param=2, grad=2, adam=8, master=4, activation=2),
}
ADAM_STEP_BYTES = 4  # torch.optim.AdamW's per-tensor `step` is a float32 scalar tensor
DS_ALIGNMENT = 2  # DeepSpeed's nccl_start_alignment_factor: flat groups pad to 2 * N elements
DS_SUB_GROUP_SIZE = 10**9  # ZeRO-3 zero_optimization.sub_group_size default (elements)
DS_REDUCE_BUCKET = 5 * 10**8  # ZeRO-1/2 zero_optimization.reduce_bucket_size default
DS_MASTER_BYTES = 4  # DeepSpeed keeps an fp32 master partition whatever the training dtype


# ------------------------------------------------------------------------------------------
# elements one rank holds, per layout


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
# activations (Korthikanti et al. 2022, section 4)

RECOMPUTE = ("none", "selective", "full")


def layer_activation_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    *,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    ffn: int = 0,
    gated: bool = False,
) -> float:
    """Bytes one transformer layer keeps for its backward, 16-bit activations.

    sbh(34 + 5as/h) without model parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor
    parallelism, sbh/t (34 + 5as/h) with tensor + sequence parallelism (Korthikanti et al.
    2022, section 4 and table 2); selective recomputation drops the 5as/h term; full
    recomputation keeps the layer input, 2sbh (2sbh/t under SP). 34 = 18 + 4f/h and
    24 = 8 + 4f/h for an MLP of width f (= 4h in the paper); a gated MLP stores twice the
    inner activations.
    """
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    mlp = 4 * (ffn or 4 * h) / h * (2 if gated else 1)
    scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h / t * (18 + mlp + scores)
    return s * b * h * (10 + (8 + mlp) / t + scores / t)


def output_activation_bytes(s: int, b: int, h: int, v: int, *, t: int = 1, sp: bool = False,
                            scale: float = 1.0) -> float:  # fmt: skip
    """Final norm + output projection input and the fp32 logits the loss keeps,
    4sbh(1 + v/h) (Korthikanti et al. section 4, on the output layer); the logits are
    vocab-parallel under TP, the hidden part is sharded only with SP. ``scale`` (fp32
    activations) applies to the hidden part only: the logits are fp32 either way."""
    hidden_part = 4 * s * b * h * scale / (t if sp else 1)
    return hidden_part + 4 * s * b * v / t


def activation_bytes(model: ModelSpec, s: int, b: int, precision: Precision, recompute: str,
                     t: int = 1, sp: bool = False) -> float:  # fmt: skip
    """All layers, plus the one layer being recomputed under full recomputation (its
    activations exist again while its backward runs), plus the output layer."""
    scale = precision.activation / 2  # the paper's formulas count 2-byte activations
    ffn = model.ffn * model.experts_per_token  # each token goes through top-k experts

    def layer(mode: str) -> float:
        return layer_activation_bytes(s, b, model.hidden, model.heads, t=t, sp=sp,
                                      recompute=mode, ffn=ffn, gated=model.gated_mlp)  # fmt: skip

    total = model.layers * layer(recompute)
    if recompute == "full":
        total += layer("none")
    total *= scale
    return total + output_activation_bytes(s, b, model.hidden, model.vocab, t=t, sp=sp,
                                           scale=scale)  # fmt: skip


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
    if shards == 1:
        return 0
    prec = settings.precision
    block = local_numel(model, tp, blocks=True) / model.layers
    root = local_numel(model, tp, blocks=False)
    return int((2 * block + root) * prec.param + block * prec.grad)


def estimate_all(model: ModelSpec, settings: Settings) -> list[Estimate]:
    n, t, prec = settings.gpus, settings.tp, settings.precision
    s, b, rc = settings.seq_len, settings.micro_batch, settings.recompute
    dense_acts = int(activation_bytes(model, s, b, prec, rc))
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
                 activations=int(activation_bytes(model, s, b, prec, rc, t=t))),
        Estimate("tp_sp", "TP + SP", layout, dict(tp_state), buffers=buckets,
                 activations=int(activation_bytes(model, s, b, prec, rc, t=t, sp=True))),
        Estimate("tp_fsdp", "TP x DP (FSDP on dp)", layout,
                 torch_adam_state(model, settings, tp=t, fsdp=dp),
                 buffers=gathered_block_bytes(model, settings, dp, tp=t),
                 activations=int(activation_bytes(model, s, b, prec, rc, t=t, sp=True))),
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


# ------------------------------------------------------------------------------------------
# the decision framework


@dataclass
class Recommendation:
    key: str  # the strategy key, or "none"
    reason: str
    advice: list[str] = field(default_factory=list)  # PP / CP / EP and other hints
    # Settings the recommendation needs that differ from the ones asked about.
    changes: dict[str, object] = field(default_factory=dict)


def choose(model: ModelSpec, settings: Settings, rows: list[Estimate]) -> tuple[str, str] | None:
    """The seed's framework, in order: everything fits -> DDP; the model states are what
    overflow -> ZeRO-1, ZeRO-2, FSDP2 (least communication first); a layer too wide for data
    parallelism (its activations or gathered parameters) -> TP + SP, then TP x FSDP; only
    offload fits -> ZeRO-3 + CPU offload. None when nothing fits."""
    budget = settings.budget
    by_key = {r.key: r for r in rows}
    fits = {r.key: r.fits(budget) for r in rows}
    ddp = by_key["ddp"].columns
    states = ddp["params"] + ddp["grads"] + ddp["optimizer"]
    if fits["ddp"]:
        return "ddp", (
            f"everything fits on one GPU ({format_size(ddp['total'])} of "
            f"{format_size(budget)}): replicate the model; DDP's one gradient all-reduce per "
            "step overlaps with the backward and nothing is gathered."
        )
    if ddp["activations"] + ddp["buffers"] < budget:
        for key, why in (
            ("zero1", "sharding the optimizer states alone is enough, and ZeRO-1 moves as many "
                      "bytes as DDP (reduce-scatter + all-gather = all-reduce)"),
            ("zero2", "sharding optimizer states and gradients is enough, and ZeRO-2 still "
                      "moves as many bytes as DDP"),
            ("fsdp2", "the parameters must be sharded too: FSDP2 (ZeRO-3) gathers each block "
                      "before use, 1.5x DDP's communication"),
        ):  # fmt: skip
            if fits[key]:
                biggest = max(("optimizer", "grads", "params"), key=lambda k: ddp[k])
                return key, (
                    f"optimizer/gradient-bound: DDP needs {format_size(ddp['total'])} per GPU, "
                    f"{format_size(states)} of it model states ({biggest} the largest), over "
                    f"the {format_size(budget)} budget; {why}."
                )
    for key, why in (
        ("tp_sp", "tensor parallelism splits every layer's matrices and, with sequence "
                  "parallelism, its activations over the TP group (keep it inside a node)"),
        ("tp_fsdp", "TP inside a node splits each layer, FSDP over the TP groups shards the "
                    "remaining model states (jobs/tp2d)"),
    ):  # fmt: skip
        if fits[key]:
            fsdp = by_key["fsdp2"].columns
            return key, (
                f"a layer is too wide for data parallelism alone: even FSDP2 needs "
                f"{format_size(fsdp['total'])} per GPU ({format_size(fsdp['activations'])} of "
                f"activations, {format_size(fsdp['buffers'])} of gathered parameters); {why}."
            )
    if fits["zero3_offload"]:
        row = by_key["zero3_offload"]
        return "zero3_offload", (
            f"only CPU offload fits: the GPUs keep activations and gathered blocks "
            f"({format_size(row.columns['total'])}) while "
            f"{format_size(row.cpu_bytes * settings.gpus_per_node)} of model states per node "
            "live in CPU RAM and the optimizer step runs on the CPU: expect it to be slow."
        )
    return None


def relaxations(settings: Settings) -> list[Settings]:
    """The settings as given, then with more recomputation, then with halved micro-batches.

    Recomputation first: selective costs a few percent (Korthikanti et al. report 2.7% for
    GPT-3), full one extra forward; a smaller micro-batch makes every matmul less efficient
    and needs gradient accumulation to keep the global batch."""
    levels = RECOMPUTE[RECOMPUTE.index(settings.recompute) :]
    batches, b = [], settings.micro_batch
    while b >= 1:
        batches.append(b)
        b //= 2
    return [dataclasses.replace(settings, recompute=r, micro_batch=b)
            for b in batches for r in levels]  # fmt: skip


def recommend(model: ModelSpec, settings: Settings, rows: list[Estimate]) -> Recommendation:
    """Apply the framework to the settings as given; if nothing fits, to the first relaxation
    that fits (saying which flags change); then add the advised-only parts (PP, CP, EP)."""
    advice = general_advice(model, settings, rows)
    for relaxed in relaxations(settings):
        relaxed_rows = rows if relaxed == settings else estimate_all(model, relaxed)
        choice = choose(model, relaxed, relaxed_rows)
        if choice is None:
            continue
        key, reason = choice
        changes = {k: getattr(relaxed, k) for k in ("recompute", "micro_batch")
                   if getattr(relaxed, k) != getattr(settings, k)}  # fmt: skip
        if changes:
            flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in changes.items())
            reason = (
                f"nothing fits as asked; with {flags}"
                + (" (accumulate gradients to keep the global batch)" if "micro_batch" in changes
                   else "")
                + f": {reason}"
            )  # fmt: skip
        return Recommendation(key, reason, advice, changes)
    most_relaxed = relaxations(settings)[-1]
    advice = [*deep_model_advice(model, most_relaxed), *advice]
    return Recommendation("none", (
        f"no strategy fits {settings.gpus} x {format_size(settings.gpu_mem)}, not even with "
        "full recomputation and micro-batch 1; see the advice."), advice)  # fmt: skip


def deep_model_advice(model: ModelSpec, settings: Settings) -> list[str]:
    """When nothing fits: how many GPUs FSDP2 would need, and pipeline parallelism."""
    fsdp = next(r for r in estimate_all(model, settings) if r.key == "fsdp2")
    cols = fsdp.columns
    fixed = cols["activations"] + cols["buffers"]  # what sharding over more GPUs cannot shrink
    sharded = (cols["params"] + cols["grads"] + cols["optimizer"]) * settings.gpus
    advice = []
    if fixed < settings.budget:
        gpus = math.ceil(sharded / (settings.budget - fixed))
        advice.append(
            f"FSDP2 with full recomputation and micro-batch 1 needs about {gpus} GPUs of this "
            "size (the model states shard, the activations and gathered blocks do not)."
        )
    per_layer = cols["total"] / model.layers
    if per_layer < settings.budget:
        stages = min(max(2, math.ceil(cols["total"] / settings.budget)), model.layers)
        advice.append(
            f"too deep: pipeline parallelism (PP) in ~{stages} stages gives each GPU "
            f"{math.ceil(model.layers / stages)} of the {model.layers} layers with their states "
            "and activations (advised, not implemented in these templates)."
        )
    else:
        advice.append(
            f"one layer alone needs about {format_size(per_layer)}: split inside the layer "
            "(TP + SP, and context parallelism for long sequences) rather than across layers."
        )
    return advice


def general_advice(model: ModelSpec, settings: Settings, rows: list[Estimate]) -> list[str]:
    """Hints beyond the table: what recomputation would save, context parallelism for very
    long sequences and expert parallelism for MoE (the last two advised, not implemented)."""
    advice = []
    s, h, a, b = settings.seq_len, model.hidden, model.heads, settings.micro_batch
    scores = 5 * a * s / h  # Korthikanti et al.: the attention-score share of a layer
    if settings.recompute == "none":
        stored = next(r for r in rows if r.key == "ddp").activations
        selective = activation_bytes(model, s, b, settings.precision, "selective")
        if stored > 1.5 * selective:
            advice.append(
                f"attention scores dominate the activations (5as/h = {scores:.0f} against 34 "
                f"for the rest of a layer): selective recomputation or flash attention cuts "
                f"the data-parallel activations from {format_size(stored)} to "
                f"{format_size(selective)} per GPU."
            )
    # The most the templates do for one sequence: TP + SP over a whole node, full recompute.
    node = max(settings.gpus_per_node, 1)
    one_sequence = activation_bytes(model, s, 1, settings.precision, "full", t=node, sp=True)
    if s >= 32768 or one_sequence > settings.budget / 2:
        advice.append(
            f"very long sequences ({s} tokens): context parallelism (ring attention; advised, "
            "not implemented) splits each sequence over GPUs beyond the TP group; one sequence "
            f"needs {format_size(one_sequence)} of activations per GPU even with TP + SP over "
            f"{node} GPUs and full recomputation."
        )
    if model.experts > 1:
        advice.append(
            f"MoE: {model.experts} experts per layer; expert parallelism (EP) places different "
            "experts on different GPUs and all-to-alls the tokens (advised, not implemented)."
        )
    return advice


# ------------------------------------------------------------------------------------------
# the plan: model + settings -> rows + recommendation, as a table or JSON


@dataclass
class Plan:
    model: ModelSpec
    settings: Settings
    rows: list[Estimate]
    recommendation: Recommendation


def make_plan(model: ModelSpec, settings: Settings) -> Plan:
    rows = estimate_all(model, settings)
    return Plan(model, settings, rows, recommend(model, settings, rows))


def plan_header(plan: Plan) -> list[str]:
    st = plan.settings
    return [
        f"model: {plan.model.describe()}",
        f"GPUs: {st.gpus} ({st.gpus_per_node} per node) x {format_size(st.gpu_mem)}, budget "
        f"{format_size(st.budget)} after {format_size(st.headroom)} headroom",
        f"micro-batch {st.micro_batch} x {st.seq_len} tokens | {st.precision.describe()} | "
        f"recompute {st.recompute} | tp {st.tp}",
    ]


COLUMNS = ("params", "grads", "optimizer", "activations", "buffers", "total")


def render_table(plan: Plan) -> str:
    budget = plan.settings.budget
    header = ["strategy", "layout", *COLUMNS, "fits"]
    body = []
    for row in plan.rows:
        if not row.applicable:
            body.append([row.name, "n/a", *([""] * len(COLUMNS)), "n/a"])
            continue
        cols = row.columns
        verdict = "yes" if row.fits(budget) else "no"
        body.append([row.name, row.layout, *(format_size(cols[c]) for c in COLUMNS), verdict])
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header) - 1)]

    def line(cells: list[str]) -> str:
        left = [cells[0].ljust(widths[0]), cells[1].ljust(widths[1])]
        right = [c.rjust(w) for c, w in zip(cells[2:-1], widths[2:], strict=True)]
        return "  ".join([*left, *right, cells[-1]]).rstrip()

    rec = plan.recommendation
    names = {r.key: r.name for r in plan.rows}
    out = [*plan_header(plan), "", line(header), *(line(r) for r in body), ""]
    for note in dict.fromkeys(r.note for r in plan.rows if not r.applicable):
        out.append(f"n/a: {note}")
    offload = next(r for r in plan.rows if r.key == "zero3_offload")
    out.append(
        f"ZeRO-3 + CPU offload keeps {format_size(offload.cpu_bytes)} per GPU "
        f"({format_size(offload.cpu_bytes * plan.settings.gpus_per_node)} per node) in CPU RAM."
    )
    out.append(f"recommended: {names.get(rec.key, 'nothing fits')} - {rec.reason}")
    out += [f"advice: {a}" for a in rec.advice]
    return "\n".join(out)


def to_json(plan: Plan) -> dict:
    st, model = plan.settings, plan.model
    return {
        "model": {
            "name": model.name, "params": model.n_params, "layers": model.layers,
            "hidden": model.hidden, "heads": model.heads, "kv_heads": model.kv_heads,
            "ffn": model.ffn, "vocab": model.vocab, "experts": model.experts,
        },
        "settings": {
            "gpus": st.gpus, "gpus_per_node": st.gpus_per_node, "gpu_mem_bytes": st.gpu_mem,
            "headroom_bytes": st.headroom, "budget_bytes": st.budget,
            "micro_batch": st.micro_batch, "seq_len": st.seq_len,
            "precision": st.precision.name, "recompute": st.recompute, "tp": st.tp,
        },
        "strategies": [
            {
                "key": r.key, "name": r.name, "layout": r.layout, "applicable": r.applicable,
                "bytes_per_gpu": r.columns if r.applicable else None,
                "model_state_bytes_per_rank": r.state, "cpu_offloaded_bytes": r.cpu_bytes,
                "fits": r.fits(st.budget), "note": r.note,
            }
            for r in plan.rows
        ],
        "recommendation": {
            "strategy": plan.recommendation.key, "reason": plan.recommendation.reason,
            "advice": plan.recommendation.advice, "changes": plan.recommendation.changes,
        },
    }  # fmt: skip


# ------------------------------------------------------------------------------------------
# command line


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints the usage before its error; the project's contract is one line."""

    def error(self, message: str):
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="python -m shared.planner",
        description="Per-GPU memory of DDP, ZeRO-1/2/3, FSDP2, TP, TP+SP and TP x FSDP, and "
        "the strategy to use.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="gpt2-tiny gpt2 gpt2-medium gpt2-large gpt2-xl "
                     "llama-tiny llama-500m llama-7b llama-13b llama-70b")  # fmt: skip
    src.add_argument("--config", help="a transformers config.json (GPT-2 or Llama-style)")
    src.add_argument("--params", type=float, help="parameter count (with the shape flags)")
    p.add_argument("--layers", type=int, help="--params: transformer layers")
    p.add_argument("--hidden", type=int, help="--params: hidden size")
    p.add_argument("--heads", type=int, help="--params: attention heads")
    p.add_argument("--kv-heads", type=int, default=0, help="--params: KV heads (default heads)")
    p.add_argument("--ffn", type=int, default=0, help="--params: MLP width (default 4 x hidden)")
    p.add_argument("--vocab", type=int, default=0, help="vocabulary (presets: the tokenizer's)")
    p.add_argument("--gpus", type=int, default=8, help="GPUs in total (default 8)")
    p.add_argument("--gpus-per-node", type=int, default=0, help="default min(gpus, 8)")
    p.add_argument("--gpu-mem", default="80GiB", help="memory per GPU: 16GiB, 80GB, bytes")
    p.add_argument(
        "--headroom",
        default="10%",
        help="kept free for the CUDA context and fragmentation: 10%%, 0.1 or 2GiB",
    )
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per data-parallel rank")
    p.add_argument("--seq-len", type=int, default=0, help="default: the model's context")
    p.add_argument("--precision", choices=sorted(PRECISIONS), default="bf16")
    p.add_argument("--recompute", choices=RECOMPUTE, default="none")
    p.add_argument("--tp", type=int, default=0,
                   help="tensor-parallel size (default: the largest that fits a node)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def model_from_args(args: argparse.Namespace) -> ModelSpec:
    if args.preset:
        return from_preset(args.preset, args.vocab, args.seq_len)
    if args.config:
        return from_hf_config(args.config, args.vocab, args.seq_len)
    missing = [f"--{n}" for n in ("layers", "hidden", "heads") if not getattr(args, n)]
    if missing or not args.vocab:
        raise ConfigError(
            f"--params needs {', '.join(missing + ([] if args.vocab else ['--vocab']))} "
            "for the activation estimate."
        )
    if args.params < 1:
        raise ConfigError(f"--params must be >= 1 (got {args.params:g}).")
    return from_counts(int(args.params), args.layers, args.hidden, args.heads, args.vocab,
                       args.ffn, args.kv_heads, args.seq_len)  # fmt: skip


def parse_headroom(text: str, gpu_mem: int) -> int:
    """A fraction ('10%', '0.1') of the GPU memory, or a size ('2GiB')."""
    text = text.strip()
    try:
        fraction = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        fraction = None
    if fraction is not None and fraction < 1:
        if fraction < 0:
            raise ConfigError(f"--headroom must be >= 0 (got '{text}').")
        return int(gpu_mem * fraction)
    headroom = parse_size(text, "--headroom")
    if headroom >= gpu_mem:
        raise ConfigError(
            f"--headroom ({format_size(headroom)}) must be less than --gpu-mem "
            f"({format_size(gpu_mem)})."
        )
    return headroom


def settings_from_args(args: argparse.Namespace, model: ModelSpec) -> Settings:
    for name in ("gpus", "micro_batch"):
        if getattr(args, name) < 1:
            raise ConfigError(
                f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})."
            )
    if args.seq_len < 0 or args.gpus_per_node < 0 or args.tp < 0:
        raise ConfigError("--seq-len, --gpus-per-node and --tp must be >= 1 when given.")
    per_node = args.gpus_per_node or min(args.gpus, 8)
    if args.gpus > per_node and args.gpus % per_node:
        raise ConfigError(
            f"--gpus ({args.gpus}) must be a multiple of --gpus-per-node ({per_node})."
        )
    per_node = min(per_node, args.gpus)
    gpu_mem = parse_size(args.gpu_mem, "--gpu-mem")
    if gpu_mem <= 0:
        raise ConfigError(f"--gpu-mem must be > 0 (got '{args.gpu_mem}').")
    return Settings(
        gpus=args.gpus,
        gpus_per_node=per_node,
        gpu_mem=gpu_mem,
        headroom=parse_headroom(args.headroom, gpu_mem),
        micro_batch=args.micro_batch,
        seq_len=args.seq_len or model.default_seq_len,
        precision=PRECISIONS[args.precision],
        recompute=args.recompute,
        tp=resolve_tp(args.tp, model, args.gpus, per_node),
    )


def resolve_tp(tp: int, model: ModelSpec, gpus: int, gpus_per_node: int) -> int:
    """The requested TP size after the same checks jobs/tp2d makes, or the largest valid."""
    if not tp:
        candidates = tp_candidates(model, gpus, gpus_per_node)
        return max(candidates) if candidates else 1
    for what, size in (("attention heads", model.heads), ("KV heads", model.kv_heads)):
        if size % tp:
            raise ConfigError(f"--tp ({tp}) must divide the {size} {what} of {model.name}.")
    if gpus % tp:
        raise ConfigError(f"--gpus ({gpus}) must be divisible by --tp ({tp}).")
    if tp > gpus_per_node:
        raise ConfigError(
            f"--tp ({tp}) must not exceed --gpus-per-node ({gpus_per_node}): a TP group talks "
            "in every layer and has to stay inside one node."
        )
    return tp


def main(argv: Iterable[str] | None = None, out: Callable[[str], None] = print) -> int:
    args = build_parser().parse_args(None if argv is None else list(argv))
    try:
        model = model_from_args(args)
        plan = make_plan(model, settings_from_args(args, model))
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out(json.dumps(to_json(plan), indent=2) if args.json else render_table(plan))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
