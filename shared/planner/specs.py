"""The model as the planner sees it: every parameter tensor with how TP splits it, built
from a preset of the jobs, a Llama 2 shape, a transformers config.json or a bare count."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

from shared.config import ConfigError


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
    dropout: bool = False  # GPT-2 presets train with dropout 0.1 (masks are saved)
    # Whose activations: "gpt2" (transformers' GPT-2 as shared.models builds it), "llama"
    # (shared.models.llama), "generic" (any other model: Korthikanti et al.'s formula).
    layout: str = "generic"
    experts: int = 1  # MoE experts per layer (1 = dense)
    experts_per_token: int = 1
    # --params: only the count is known, so there are no per-tensor step counters or padding.
    counts_only: bool = False

    @property
    def n_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    def missing_shape(self) -> list[str]:
        """The --params shape flags activations need and this model lacks."""
        given = {"--layers": self.layers, "--hidden": self.hidden, "--heads": self.heads,
                 "--vocab": self.vocab}  # fmt: skip
        return [flag for flag, value in given.items() if not value]

    @property
    def has_shape(self) -> bool:
        return not self.missing_shape()

    def describe(self) -> str:
        moe = f", {self.experts} experts (top-{self.experts_per_token})" if self.experts > 1 else ""
        count = self.n_params
        size = f"{count / 1e9:.3g}B" if count >= 1e9 else f"{count / 1e6:.3g}M"
        if not self.has_shape:
            return f"{self.name} ({size} params; shape not given)"
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
    """``shared.models.llama.Llama``'s parameters in order, TP dims as in ``shared/parallel/tp.py``:
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
    from shared.models.gpt2 import PRESETS
    from shared.models.llama import LLAMA_PRESETS

    return sorted({*PRESETS, *LLAMA_PRESETS, *LLAMA2_SHAPES})


def from_preset(name: str, vocab: int = 0, seq_len: int = 0) -> ModelSpec:
    """A preset of ``shared.models`` (GPT-2 or Llama: the same numbers the jobs train) or a
    Llama 2 shape. ``vocab`` defaults to the real tokenizer's (the smoke runs train a 512-token
    one: pass ``vocab=512`` to compare with them)."""
    from shared.models.gpt2 import PRESETS
    from shared.models.llama import LLAMA_PRESETS

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
            dropout=p.dropout > 0,
            layout="gpt2",
        )
    if name in LLAMA_PRESETS or name in LLAMA2_SHAPES:
        if name not in LLAMA2_SHAPES:  # Llama 2 shapes keep Llama 2's vocabulary and context
            p = LLAMA_PRESETS[name]
            dims = dict(dim=p.dim, n_layers=p.n_layers, n_heads=p.n_heads,
                        n_kv_heads=p.n_kv_heads, ffn_dim=p.ffn_dim)  # fmt: skip
            vocab, context = vocab or GPT2_VOCAB, p.max_seq_len
        else:
            dims, vocab, context = LLAMA2_SHAPES[name], vocab or LLAMA2_VOCAB, LLAMA2_CONTEXT
        # shared.models.llama builds all of these (the Llama 2 shapes too, as jobs/tp2d would).
        return _llama_spec(name, **dims, vocab=vocab, context=context, layout="llama")
    raise ConfigError(f"unknown preset '{name}'; valid presets: {', '.join(preset_names())}.")


def _llama_spec(name, dim, n_layers, n_heads, n_kv_heads, ffn_dim, vocab, context, tied=False,
                experts=1, experts_per_token=1, layout="generic") -> ModelSpec:  # fmt: skip
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
        layout=layout,
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
                         int(cfg.get("n_positions", 1024)), tensors,
                         dropout=float(cfg.get("resid_pdrop", 0.1)) > 0,
                         layout="gpt2")  # fmt: skip
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
    table (vocab x hidden) is taken as the non-block part, the rest as ``layers`` equal blocks.
    With the count alone (shape numbers 0) only the model states can be planned."""
    embedding = min(params, vocab * hidden)
    tensors = (Tensor("embedding", (embedding,), 0, False),
               Tensor("blocks", (params - embedding,), 0, True))  # fmt: skip
    return ModelSpec(f"{params / 1e9:.3g}B-parameter model", layers, hidden, heads,
                     kv_heads or heads, ffn or 4 * hidden, vocab, seq_len or 2048, tensors,
                     counts_only=True)  # fmt: skip
