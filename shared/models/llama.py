"""A small Llama-style decoder written for tensor parallelism: RMSNorm, RoPE, SwiGLU MLP and
grouped-query attention, with every linear layer a plain ``nn.Linear`` named as in torchtitan
(``wq wk wv wo``, ``w1 w2 w3``), so the TP plan in ``shared/parallel/tp.py`` reads like a
table of the model.

Two details make it TP-ready: attention reshapes with ``view(B, S, -1, head_dim)`` so each
TP rank works on however many heads its shard of ``wq``/``wk``/``wv`` holds, and ``forward``
returns logits (the loss is computed by the strategy, inside ``loss_parallel`` under TP).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn


@dataclass(frozen=True)
class LlamaPreset:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


LLAMA_PRESETS: dict[str, LlamaPreset] = {
    # ~0.1M non-embedding parameters; 4 heads / 2 KV heads so tp=2 splits both.
    "llama-tiny": LlamaPreset(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=256
    ),
    # ~500M with the GPT-2 tokenizer's 50k vocabulary (untied embedding + output: 154M).
    "llama-500m": LlamaPreset(dim=1536, n_layers=14, n_heads=12, n_kv_heads=4, ffn_dim=4096),
    # Llama 2 7B's shape (Touvron et al. 2023), for planning and dry runs at real scale
    # (make dry-run JOB=tp2d PROFILE=full ARGS="model=llama-7b dp=8 tp=8 num_workers=64").
    "llama-7b": LlamaPreset(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, max_seq_len=4096
    ),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_float = x.float()
        normed = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(
    head_dim: int, seq_len: int, theta: float, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the rotary angles, [seq_len, head_dim / 2]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of channels of x [B, S, H, D] by position-dependent angles."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    rotated = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return rotated.type_as(x)


class Attention(nn.Module):
    def __init__(self, p: LlamaPreset):
        super().__init__()
        self.head_dim = p.dim // p.n_heads
        self.rope_theta = p.rope_theta
        self.wq = nn.Linear(p.dim, p.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(p.dim, p.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(p.dim, p.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(p.n_heads * self.head_dim, p.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under TP each rank holds n_heads / tp query heads and n_kv_heads / tp KV heads.
        q = self.wq(x).view(batch, seq, -1, self.head_dim)
        k = self.wk(x).view(batch, seq, -1, self.head_dim)
        v = self.wv(x).view(batch, seq, -1, self.head_dim)
        cos, sin = rope_tables(self.head_dim, seq, self.rope_theta, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, p: LlamaPreset):
        super().__init__()
        self.w1 = nn.Linear(p.dim, p.ffn_dim, bias=False)
        self.w2 = nn.Linear(p.ffn_dim, p.dim, bias=False)
        self.w3 = nn.Linear(p.dim, p.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, p: LlamaPreset):
        super().__init__()
        self.attention_norm = RMSNorm(p.dim, p.norm_eps)
        self.attention = Attention(p)
        self.ffn_norm = RMSNorm(p.dim, p.norm_eps)
        self.feed_forward = FeedForward(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, p: LlamaPreset, vocab_size: int):
        super().__init__()
        self.preset = p
        self.tok_embeddings = nn.Embedding(vocab_size, p.dim)
        self.layers = nn.ModuleList(Block(p) for _ in range(p.n_layers))
        self.norm = RMSNorm(p.dim, p.norm_eps)
        self.output = nn.Linear(p.dim, vocab_size, bias=False)
        self.checkpoint_activations = False
        self.reset_parameters()

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict | None = None):
        """Recompute each block in the backward (same switch as transformers models)."""
        self.checkpoint_activations = True

    def reset_parameters(self) -> None:
        """GPT-2/Llama-style init; residual output projections scaled by 1/sqrt(2 * layers)."""
        for name, param in self.named_parameters():
            if param.dim() < 2:
                continue
            std = (
                0.02 / math.sqrt(2 * self.preset.n_layers)
                if name.endswith(("wo.weight", "w2.weight"))
                else 0.02
            )
            nn.init.normal_(param, mean=0.0, std=std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            if self.checkpoint_activations and self.training:
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.output(self.norm(h))


def next_token_targets(input_ids: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Targets for every position: the next token, and ``ignore_index`` for the last one (the
    sequence keeps its length, which sequence parallelism needs divisible by tp)."""
    targets = torch.full_like(input_ids, ignore_index)
    targets[:, :-1] = input_ids[:, 1:]
    return targets


def build_llama(preset: str, vocab_size: int) -> Llama:
    return Llama(LLAMA_PRESETS[preset], vocab_size)
