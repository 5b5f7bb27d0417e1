"""GPT-2 size presets and the builder the ddp, fsdp, zero and fault_tolerance jobs use.

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


__all__ = ["PRESETS", "GPT2Preset", "build_gpt2"]
