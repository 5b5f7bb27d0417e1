"""Activation bytes per layer (Korthikanti et al. 2022, section 4)."""

from __future__ import annotations

from shared.planner.hardware import Precision
from shared.planner.specs import ModelSpec

RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("sdpa", "eager")


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
    attention: str = "eager",
) -> float:
    """Bytes one transformer layer keeps for its backward, 16-bit activations.

    sbh(34 + 5as/h) without model parallelism, sbh(10 + 24/t + 5as/(ht)) with tensor
    parallelism, sbh/t (34 + 5as/h) with tensor + sequence parallelism (Korthikanti et al.
    2022, section 4 and table 2); selective recomputation drops the 5as/h term; full
    recomputation keeps the layer input, 2sbh (2sbh/t under SP). 34 = 18 + 4f/h and
    24 = 8 + 4f/h for an MLP of width f (= 4h in the paper); a gated MLP stores twice the
    inner activations.

    ``attention="sdpa"`` (PyTorch's fused scaled_dot_product_attention: flash or memory-
    efficient kernels, what shared/models/llama.py and transformers' GPT-2 use) never stores the
    a*s*s score matrix, softmax or its dropout: the 5as/h term is gone whatever the
    recomputation. ``"eager"`` is the paper's attention, which stores them.
    """
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    mlp = 4 * (ffn or 4 * h) / h * (2 if gated else 1)
    scores = 0.0 if recompute == "selective" or attention == "sdpa" else 5 * a * s / h
    if sp:
        return s * b * h / t * (18 + mlp + scores)
    return s * b * h * (10 + (8 + mlp) / t + scores / t)


def sdpa_layer_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    *,
    kv: int = 0,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    ffn: int = 0,
    gated: bool = False,
    act_bytes: int = 2,
    dropout: bool = False,
) -> float:
    """Bytes one layer of the templates' own models keeps for its backward with fused attention
    (``F.scaled_dot_product_attention``), counted tensor by tensor from what autograd saves and
    checked against the CPU measurement (``shared.planner.measure``, tests/unit/test_planner.py,
    docs/planner.md). In units of s*b*h elements, k = kv_heads / heads, f' = ffn / h:

    * Llama (``shared/models/llama.py``: RMSNorm, separate wq/wk/wv, RoPE, SwiGLU):
      8 + 2k + 4f' - each norm's normed and weighted outputs (2 x 2), q, k, v (1 + 2k), the
      attention output, the residual stream after attention and after the MLP (2), and w1,
      w3, silu and their product (4f'). 16-bit training adds one element per norm: RMSNorm
      upcasts its input to an fp32 copy that replaces the 16-bit one.
    * GPT-2 (transformers' ``GPT2LMHeadModel``: LayerNorm, fused c_attn, gelu_new):
      6 + 4k + 5f' - two LayerNorm outputs, the fused qkv (1 + 2k), the k and v copies the
      KV cache concatenates (2k; ``use_cache`` is on by default), the attention output, the
      two residual streams, c_fc's output and the four tensors gelu_new's tanh formula saves
      (5f'); with dropout, two 1-byte masks (GPU ``native_dropout``).

    Under TP with sequence parallelism (``shared/parallel/tp.py``) the norms' own outputs and
    the residual stream are split over t, but each linear layer keeps its all-gathered input
    whole (torch TP does not re-gather in the backward as Megatron does): 2 + (rest)/t. TP
    without SP keeps the norms and the residual stream whole. Small fp32 terms: the SDPA
    log-sum-exp (a*s*b), the norm statistics (RMSNorm: s*b per norm; LayerNorm: 2 s*b) and
    RoPE's cos/sin tables (s * head_dim). Full recomputation keeps the layer input.
    """
    k, f = (kv or a) / a, (ffn or 4 * h) / h
    sbh = s * b * h
    split = t if sp else 1
    if recompute == "full":
        return sbh * act_bytes / split
    if gated:
        whole, sharded = 6, 2 + 2 * k + 4 * f  # norms 2x2 + residual 2; q, k, v, out, MLP
        upcast = 2 if act_bytes < 4 else 0  # RMSNorm's fp32 copy of its input, per norm
        norm_stats = 2 * s * b * 4 / split
        rope = s * (h // a) * 4
    else:
        whole, sharded = 4, 2 + 4 * k + 5 * f  # norms 2 + residual 2; qkv, kv copies, out, MLP
        upcast = 0
        norm_stats = 4 * s * b * act_bytes / split
        rope = 0
    # Under SP the gathered inputs of the attention and MLP linears stay whole; the rest splits.
    elements = 2 + (whole - 2 + sharded) / t if sp else whole + sharded / t
    masks = 2 * sbh / split if dropout and not gated else 0
    lse = a * s * b * 4 / t
    return (
        sbh * (elements * act_bytes + upcast * act_bytes / split) + masks + norm_stats + lse + rope
    )


def output_activation_bytes(s: int, b: int, h: int, v: int, *, t: int = 1, sp: bool = False,
                            scale: float = 1.0) -> float:  # fmt: skip
    """Final norm + output projection input and the fp32 logits the loss keeps,
    4sbh(1 + v/h) (Korthikanti et al. section 4, on the output layer); the logits are
    vocab-parallel under TP, the hidden part is sharded only with SP. ``scale`` (fp32
    activations) applies to the hidden part only: the logits are fp32 either way."""
    hidden_part = 4 * s * b * h * scale / (t if sp else 1)
    return hidden_part + 4 * s * b * v / t


def layer_bytes(model: ModelSpec, s: int, b: int, precision: Precision, recompute: str,
                t: int = 1, sp: bool = False) -> float:  # fmt: skip
    """One layer of the templates' GPT-2 or Llama with fused attention (what ``measure``
    checks, layer by layer)."""
    return sdpa_layer_bytes(s, b, model.hidden, model.heads, kv=model.kv_heads, t=t, sp=sp,
                            recompute=recompute, ffn=model.ffn * model.experts_per_token,
                            gated=model.gated_mlp, act_bytes=precision.activation,
                            dropout=model.dropout)  # fmt: skip


def activation_bytes(model: ModelSpec, s: int, b: int, precision: Precision, recompute: str,
                     t: int = 1, sp: bool = False, attention: str = "sdpa") -> float:  # fmt: skip
    """All layers, plus the one layer being recomputed under full recomputation (its
    activations exist again while its backward runs), plus the output layer. The templates'
    own models (``layout`` gpt2 / llama) use their measured per-tensor counts; any other model
    (a config.json, ``--params``) Korthikanti et al.'s formula, without the 5as/h score term
    under SDPA."""
    if not model.has_shape:
        return 0.0  # --params alone: activations are not planned (the table says so)
    scale = precision.activation / 2  # the paper's formulas count 2-byte activations
    ffn = model.ffn * model.experts_per_token  # each token goes through top-k experts
    if attention == "sdpa" and model.layout in ("gpt2", "llama"):
        per_layer = {mode: layer_bytes(model, s, b, precision, mode, t=t, sp=sp)
                     for mode in ("none", "full")}  # fmt: skip
        total = model.layers * per_layer["full" if recompute == "full" else "none"]
        if recompute == "full":
            total += per_layer["none"]
        return total + output_activation_bytes(s, b, model.hidden, model.vocab, t=t, sp=sp,
                                               scale=scale)  # fmt: skip

    def layer(mode: str) -> float:
        return layer_activation_bytes(s, b, model.hidden, model.heads, t=t, sp=sp,
                                      recompute=mode, ffn=ffn, gated=model.gated_mlp,
                                      attention=attention)  # fmt: skip

    total = model.layers * layer(recompute)
    if recompute == "full":
        total += layer("none")
    total *= scale
    return total + output_activation_bytes(s, b, model.hidden, model.vocab, t=t, sp=sp,
                                           scale=scale)  # fmt: skip
