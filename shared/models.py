"""Model builders, size presets, and parameter / FLOP counts (for MFU).

GPT-2 models are Hugging Face ``GPT2LMHeadModel`` s: the full profile loads the real
pretrained weights, the smoke profile builds the same class from a tiny config.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class GPT2Preset:
    n_layer: int
    n_head: int
    n_embd: int
    n_positions: int = 1024
    dropout: float = 0.1


PRESETS: dict[str, GPT2Preset] = {
    # ~0.1M non-embedding parameters: trains in seconds on two CPU cores. No dropout so a
    # smoke run is deterministic and its loss falls fast enough to assert on.
    "gpt2-tiny": GPT2Preset(n_layer=2, n_head=4, n_embd=64, n_positions=256, dropout=0.0),
    "gpt2": GPT2Preset(n_layer=12, n_head=12, n_embd=768),  # 124M
    "gpt2-medium": GPT2Preset(n_layer=24, n_head=16, n_embd=1024),  # 355M
    "gpt2-large": GPT2Preset(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": GPT2Preset(n_layer=48, n_head=25, n_embd=1600),  # 1.5B
}


def build_gpt2(
    preset: str,
    vocab_size: int,
    seq_len: int,
    pretrained: str = "",
    eos_token_id: int | None = None,
) -> nn.Module:
    """A ``GPT2LMHeadModel``: pretrained weights from the hub/path, or random init from a preset.

    Call after seeding: every rank then builds identical weights (DDP also broadcasts rank 0's).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    if pretrained:
        model = GPT2LMHeadModel.from_pretrained(pretrained)
        if model.config.vocab_size < vocab_size or model.config.n_positions < seq_len:
            raise ValueError(
                f"pretrained model '{pretrained}' has vocab {model.config.vocab_size} and "
                f"{model.config.n_positions} positions; the data needs {vocab_size} and {seq_len}."
            )
        return _with_causal_lm_loss(model)
    p = PRESETS[preset]
    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=max(p.n_positions, seq_len),
        n_layer=p.n_layer,
        n_head=p.n_head,
        n_embd=p.n_embd,
        resid_pdrop=p.dropout,
        embd_pdrop=p.dropout,
        attn_pdrop=p.dropout,
        bos_token_id=eos_token_id,  # GPT-2 uses <|endoftext|> for both
        eos_token_id=eos_token_id,
    )
    return _with_causal_lm_loss(GPT2LMHeadModel(config))


def _with_causal_lm_loss(model: nn.Module) -> nn.Module:
    # transformers infers the loss from the class name; "GPT2LMHeadModel" matches none and
    # every forward warns before falling back to this same causal-LM loss.
    model.loss_type = "ForCausalLM"
    return model


def count_params(model: nn.Module, exclude_position_embeddings: bool = True) -> int:
    """Parameters that cost FLOPs (full sizes, also when sharded). Embedding tables are lookups,
    so they are left out (GPT-2's position table, Llama's token table); GPT-2's tied token
    embedding stays in because it is also the output projection (as in nanoGPT)."""

    def numel(p: nn.Parameter) -> int:
        return getattr(p, "ds_numel", p.numel())  # ZeRO-3 leaves an empty placeholder

    total = sum(numel(p) for p in model.parameters())
    if exclude_position_embeddings:
        for name, p in model.named_parameters():
            if name.endswith(("wpe.weight", "tok_embeddings.weight")):
                total -= numel(p)
    return total


def flops_per_token(n_params: int, n_layer: int, d_model: int, seq_len: int) -> float:
    """Training FLOPs per token: 6N for the matmuls (forward 2N + backward 4N) plus the
    attention score/value matmuls, 12 * L * d * T (PaLM, Chowdhery et al. 2022, appendix B)."""
    return 6.0 * n_params + 12.0 * n_layer * d_model * seq_len


def model_dims(model: nn.Module) -> tuple[int, int]:
    """(layers, hidden size) of a transformers model or our Llama, for the attention FLOPs."""
    preset = getattr(model, "preset", None)
    if preset is not None:
        return preset.n_layers, preset.dim
    config = getattr(model, "config", None)
    layers = getattr(config, "n_layer", None) or getattr(config, "num_hidden_layers", 0)
    hidden = getattr(config, "n_embd", None) or getattr(config, "hidden_size", 0)
    return int(layers), int(hidden)


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The repeated decoder blocks: the unit FSDP shards and activation checkpointing wraps."""
    for path in ("transformer.h", "model.layers", "layers"):  # GPT-2, HF Llama, our Llama
        module = model
        for part in path.split("."):
            module = getattr(module, part, None)
        if isinstance(module, nn.ModuleList):
            return module
    raise ValueError(f"cannot find the transformer blocks of {type(model).__name__}")


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP (``.module``) or similar wrappers."""
    return model.module if hasattr(model, "module") else model


__all__ = [
    "PRESETS",
    "build_gpt2",
    "count_params",
    "flops_per_token",
    "model_dims",
    "transformer_blocks",
    "unwrap",
]
