"""What any of the models is made of, whichever builder made it (GPT-2, our Llama, a wrapped
one): the repeated blocks, layer count and width, and the parameter and FLOP counts MFU uses."""

from __future__ import annotations

from torch import nn


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
