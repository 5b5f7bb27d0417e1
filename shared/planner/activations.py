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
    efficient kernels, what shared/llama.py and transformers' GPT-2 use) never stores the
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


def output_activation_bytes(s: int, b: int, h: int, v: int, *, t: int = 1, sp: bool = False,
                            scale: float = 1.0) -> float:  # fmt: skip
    """Final norm + output projection input and the fp32 logits the loss keeps,
    4sbh(1 + v/h) (Korthikanti et al. section 4, on the output layer); the logits are
    vocab-parallel under TP, the hidden part is sharded only with SP. ``scale`` (fp32
    activations) applies to the hidden part only: the logits are fp32 either way."""
    hidden_part = 4 * s * b * h * scale / (t if sp else 1)
    return hidden_part + 4 * s * b * v / t


def activation_bytes(model: ModelSpec, s: int, b: int, precision: Precision, recompute: str,
                     t: int = 1, sp: bool = False, attention: str = "sdpa") -> float:  # fmt: skip
    """All layers, plus the one layer being recomputed under full recomputation (its
    activations exist again while its backward runs), plus the output layer."""
    if not model.has_shape:
        return 0.0  # --params alone: activations are not planned (the table says so)
    scale = precision.activation / 2  # the paper's formulas count 2-byte activations
    ffn = model.ffn * model.experts_per_token  # each token goes through top-k experts

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
