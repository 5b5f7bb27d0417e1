"""Held-out evaluation: loss and perplexity on validation data the run never trains on.

Validation data (built on each worker, once, from the same read/tokenise/pack helpers as
training):
  * ``eval_dataset`` set (full profiles: AG News' test split, Wikitext's validation split):
    its first rows, tokenised with the run's tokenizer and packed into ``seq_len`` blocks;
  * empty (smoke): news rows generated from another seed range (``seed + HELD_OUT_SEED``),
    minus any row whose text is also in the training file.

The fixed set is ``eval_batches`` micro-batches per data-parallel rank. Data-parallel rank d
of D takes blocks d, d + D, ... (the ranks of one TP group share a dp rank, so they compute
on the same rows and the group counts once). The last batches may be short or empty when the
set does not divide evenly: every rank still runs the same number of forwards (FSDP and
ZeRO-3 gather parameters collectively), an empty one on a dummy row with weight 0, so no row
is dropped and none counts twice. Loss is token-weighted: sum of per-token losses over all
dp ranks / number of predicted tokens, and perplexity = exp(loss).

Evaluation must not change training: the model is put in eval mode (and back), no gradient
is computed, the RNG state is restored afterwards, and the training batches are not touched.
A run with and without evaluation ends with bitwise-identical weights
(tests/dist/test_evaluation.py).
"""

from __future__ import annotations

import contextlib
import math

import numpy as np
import torch
import torch.distributed as dist

HELD_OUT_SEED = 1_000_003  # generated validation rows: a seed range training never uses
HELD_OUT_ROWS = 400


def eval_due(cfg, step: int) -> bool:
    every = getattr(cfg, "eval_every", 0)
    return every > 0 and (step % every == 0 or step == cfg.last_step)


def _texts_for_validation(cfg, source) -> list[str]:
    import pyarrow.parquet as pq

    from shared.data.source import _dataset_filesystem, generate_news_rows, parquet_files

    if cfg.eval_dataset:
        fs, files = parquet_files(cfg.eval_dataset)  # a file, a directory or a split's pattern
        texts: list[str] = []
        for file in files:
            table = pq.read_table(file, filesystem=fs, columns=[cfg.text_column])
            texts += [t for t in table.column(cfg.text_column).to_pylist() if t]
            if len(texts) >= 50_000:
                break
        return texts
    training = set()
    if source is not None and source.dataset.endswith(".parquet"):
        fs, path = _dataset_filesystem(source.dataset)
        training = set(pq.read_table(path, filesystem=fs, columns=["text"]).column(0).to_pylist())
    rows = generate_news_rows(HELD_OUT_ROWS, cfg.seed + HELD_OUT_SEED)
    return [r["text"] for r in rows if r["text"] not in training]


def validation_blocks(cfg, needed: int) -> torch.Tensor:
    """``[N, seq_len]`` token blocks of held-out text, at most ``needed`` of them."""
    from shared.data import resolve_text_source, tokenize_and_pack

    source = resolve_text_source(cfg)
    texts = _texts_for_validation(cfg, source)
    blocks = []
    have = 0
    for start in range(0, len(texts), 512):  # tokenise only as much as the set needs
        batch = {cfg.text_column: np.array(texts[start : start + 512], dtype=object)}
        ids = tokenize_and_pack(batch, source.tokenizer, cfg.text_column, cfg.seq_len)
        blocks.append(ids["input_ids"])
        have += len(ids["input_ids"])
        if have >= needed:
            break
    if not have:
        raise RuntimeError("the validation data gave no block of seq_len tokens")
    return torch.from_numpy(np.concatenate(blocks)[:needed])


def data_parallel_coords(cfg, rank: int, world_size: int) -> tuple[int, int, bool]:
    """(dp rank, dp size, counts): TP groups are consecutive ranks (shared/parallel/tp.py's
    row-major mesh); only the group's first rank counts its (identical) sums."""
    tp = getattr(cfg, "tp", 1) or 1
    return rank // tp, world_size // tp, rank % tp == 0


def _batch_loss_sum(strategy, input_ids: torch.Tensor) -> torch.Tensor:
    """Sum of per-token next-token losses of one micro-batch (all strategies)."""
    tokens = input_ids.shape[0] * (input_ids.shape[1] - 1)
    if getattr(strategy, "name", "") == "tp x fsdp":
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel

        from shared.models.llama import next_token_targets

        with loss_parallel():
            logits = strategy.model(input_ids)
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), next_token_targets(input_ids).flatten()
            )
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    else:
        loss = strategy.loss(input_ids)  # mean over the batch's predicted tokens
    return loss.float() * tokens


class Evaluator:
    """Built once per worker; ``evaluate(strategy)`` is collective (every rank calls it)."""

    def __init__(self, cfg, rank: int, world_size: int, device: torch.device,
                 blocks: torch.Tensor | None = None):  # fmt: skip
        self.cfg, self.device = cfg, device
        self.dp_rank, self.dp_size, self.counts = data_parallel_coords(cfg, rank, world_size)
        micro = cfg.micro_batch_size
        if blocks is None:
            blocks = validation_blocks(cfg, cfg.eval_batches * micro * self.dp_size)
        mine = blocks[self.dp_rank :: self.dp_size]
        self.batches = [mine[i : i + micro] for i in range(0, len(mine), micro)]
        # Every rank runs as many forwards as the rank with the most rows.
        self.forwards = math.ceil(math.ceil(len(blocks) / self.dp_size) / micro)
        self.filler = blocks[:1]  # a dummy row for a rank with nothing left (weight 0)

    @classmethod
    def for_run(cls, cfg, session) -> Evaluator | None:
        if getattr(cfg, "eval_every", 0) <= 0:
            return None
        return cls(cfg, session.rank, session.world_size, session.device)

    @torch.no_grad()
    def evaluate(self, strategy) -> dict[str, float]:
        model = strategy.model
        was_training = model.training
        model.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, tokens
        with _rng_untouched(self.device):
            for i in range(self.forwards):
                batch = self.batches[i] if i < len(self.batches) else None
                ids = (batch if batch is not None and len(batch) else self.filler).to(self.device)
                loss_sum = _batch_loss_sum(strategy, ids)
                if batch is not None and len(batch) and self.counts:
                    totals[0] += loss_sum.double()
                    totals[1] += batch.shape[0] * (batch.shape[1] - 1)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(totals)
        if was_training:
            model.train()
        loss = float(totals[0] / totals[1])
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)),
                "eval_tokens": int(totals[1])}  # fmt: skip


@contextlib.contextmanager
def _rng_untouched(device: torch.device):
    """Restore every RNG evaluation could draw from (dropout is off in eval mode anyway)."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


def run_if_due(evaluator: Evaluator | None, cfg, strategy, step: int) -> dict:
    """{eval_loss, eval_ppl, eval_tokens} on evaluation steps, {} otherwise."""
    if evaluator is None or not eval_due(cfg, step):
        return {}
    return evaluator.evaluate(strategy)
