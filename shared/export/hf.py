"""The training models as Hugging Face ``transformers`` models: configs and parameter names.

GPT-2 jobs train a ``GPT2LMHeadModel`` already, so only the config is rebuilt. The tp2d job
trains our Llama (shared/models/llama.py); it maps onto ``LlamaForCausalLM`` name by name, with one
numerical difference: our RoPE rotates *consecutive* channel pairs (2i, 2i+1) of each head,
transformers' ``rotate_half`` rotates channel i with channel i + head_dim/2. Both give the
same attention scores once the rows of ``wq`` and ``wk`` are reordered inside every head
(q.k is invariant under one permutation applied to both): exactly what Meta's
``convert_llama_weights_to_hf`` does. Without it the exported model still produces
plausible text, with wrong logits (tests/dist/test_export.py checks them to 1e-5).
"""

from __future__ import annotations

import re

import torch
from torch import nn


def gpt2_hf_model(state_dict: dict[str, torch.Tensor], n_head: int, eos_token_id: int | None,
                  config_source: str = "") -> nn.Module:  # fmt: skip
    """A ``GPT2LMHeadModel`` holding ``state_dict`` (names as trained). The shapes give the
    sizes; heads are not visible in shapes, so they come from the run's preset or
    ``config_source`` (the pretrained model's hub name or directory)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    vocab, n_embd = state_dict["transformer.wte.weight"].shape
    n_layer = 1 + max(int(m.group(1)) for k in state_dict
                      if (m := re.match(r"transformer\.h\.(\d+)\.", k)))  # fmt: skip
    if config_source:
        config = GPT2Config.from_pretrained(config_source)
    else:
        config = GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                            bos_token_id=eos_token_id, eos_token_id=eos_token_id)  # fmt: skip
    config.vocab_size = vocab
    config.n_positions = state_dict["transformer.wpe.weight"].shape[0]
    config.n_layer, config.n_embd = n_layer, n_embd
    model = GPT2LMHeadModel(config)
    _load_exactly(model, state_dict)
    return model


def _load_exactly(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> None:
    """Every parameter of ``model`` must come from the checkpoint (a tied LM head may be
    absent: it is the token embedding)."""
    state_dict = {k: v for k, v in state_dict.items() if k in model.state_dict()}
    missing, _ = model.load_state_dict(state_dict, strict=False)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = set(missing) - tied
    if missing:
        raise ValueError(f"the checkpoint lacks {sorted(missing)[:3]} (another model?)")
    if tied:
        model.tie_weights()


# our name (per layer: layers.<i>.<suffix>) -> LlamaForCausalLM's
LLAMA_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LLAMA_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}


def interleaved_to_half_rotary(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder a q/k projection's output rows within each head: pair (2i, 2i+1) -> (i, i + D/2)."""
    out_dim, in_dim = weight.shape
    head_dim = out_dim // n_heads
    return (weight.view(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2)
            .reshape(out_dim, in_dim))  # fmt: skip


def llama_hf_state_dict(ours: dict[str, torch.Tensor], preset) -> dict[str, torch.Tensor]:
    hf = {}
    for name, tensor in ours.items():
        if name in LLAMA_NAMES:
            hf[LLAMA_NAMES[name]] = tensor
            continue
        match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if not match or match.group(2) not in LLAMA_LAYER_NAMES:
            raise ValueError(f"unexpected parameter {name} in a Llama checkpoint")
        layer, suffix = match.groups()
        if suffix == "attention.wq.weight":
            tensor = interleaved_to_half_rotary(tensor, preset.n_heads)
        elif suffix == "attention.wk.weight":
            tensor = interleaved_to_half_rotary(tensor, preset.n_kv_heads)
        hf[f"model.layers.{layer}.{LLAMA_LAYER_NAMES[suffix]}"] = tensor
    return hf


def llama_hf_model(ours: dict[str, torch.Tensor], preset, eos_token_id: int | None) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = ours["tok_embeddings.weight"].shape[0]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=preset.dim,
        intermediate_size=preset.ffn_dim,
        num_hidden_layers=preset.n_layers,
        num_attention_heads=preset.n_heads,
        num_key_value_heads=preset.n_kv_heads,
        max_position_embeddings=preset.max_seq_len,
        rms_norm_eps=preset.norm_eps,
        rope_theta=preset.rope_theta,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=eos_token_id,
        eos_token_id=eos_token_id,
    )
    model = LlamaForCausalLM(config)
    _load_exactly(model, llama_hf_state_dict(ours, preset))
    return model
