"""Samples at the end of a run: greedy continuations of fixed prompts, on every strategy.

Every rank runs the same decoding loop in lockstep, because a forward is collective for the
sharded strategies (FSDP2 and ZeRO-3 gather parameters, TP exchanges activations and its
logits are vocab-sharded DTensors, gathered here with ``full_tensor``). Rank 0 prints the
lines and writes them to ``<run_dir>/samples.txt`` (shared/storage.py: local or s3://).
Greedy and a fixed length, so the same weights always give the same text; the RNG is not
touched.
"""

from __future__ import annotations

import torch

SAMPLES_FILE = "samples.txt"
PROMPTS = ("the market", "scientists", "the team")
NEW_TOKENS = 16


def _logits(strategy, ids: torch.Tensor) -> torch.Tensor:
    model = strategy.model
    if getattr(strategy, "name", "") == "tp x fsdp":
        logits = model(ids)
        return logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return model(input_ids=ids).logits


@torch.no_grad()
def greedy(strategy, ids: torch.Tensor, new_tokens: int, max_len: int, multiple_of: int = 1):
    """Append ``new_tokens`` argmax tokens (the context is cut to ``max_len``). With
    ``multiple_of`` > 1 (TP's sequence parallelism needs lengths divisible by tp) the input
    is right-padded and the logits are read at the last real position: attention is causal,
    so the padding after it changes nothing."""
    for _ in range(new_tokens):
        context = ids[:, -max_len:]
        length = context.shape[1]
        pad = (-length) % multiple_of
        if pad:
            context = torch.cat([context, context[:, -1:].expand(-1, pad)], dim=1)
        token = _logits(strategy, context)[:, length - 1, :].float().argmax(-1, keepdim=True)
        ids = torch.cat([ids, token], dim=1)
    return ids


def write_samples(cfg, strategy, session) -> list[str] | None:
    """Collective. Returns (and on rank 0 prints and stores) one line per prompt."""
    from shared import storage
    from shared.data import load_tokenizer, resolve_text_source

    tokenizer = load_tokenizer(resolve_text_source(cfg).tokenizer)
    model = strategy.model
    was_training = model.training
    model.eval()
    lines = []
    try:
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer.encode(prompt)], device=session.device)
            tp = getattr(cfg, "tp", 1) or 1
            out = greedy(strategy, ids, NEW_TOKENS, cfg.seq_len - tp, tp)
            text = tokenizer.decode(out[0, ids.shape[1] :].tolist())
            lines.append(f"{prompt!r} -> {text!r}")
    finally:
        if was_training:
            model.train()
    if session.rank == 0:
        print("samples (greedy, " + f"{NEW_TOKENS} tokens):", flush=True)
        for line in lines:
            print(f"  {line}", flush=True)
        storage.write_text(storage.join(cfg.run_dir, SAMPLES_FILE), "\n".join(lines) + "\n")
    return lines
