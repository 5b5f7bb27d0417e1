"""Held-out evaluation in the shared loop (shared/evaluation.py), without Ray."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_corpus_blocks

from shared.config import TrainConfig
from shared.data import generate_news_corpus
from shared.evaluation import HELD_OUT_SEED, Evaluator, validation_blocks
from shared.loop import train
from shared.models.gpt2 import build_gpt2
from shared.models.structure import unwrap
from shared.parallel.ddp import DDPStrategy, apply_ddp
from shared.runtime.torchrun import TorchrunSession, rank_batches
from shared.runtime.worker import seed_everything

SEQ = 32


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("data"))
    blocks, spec = tiny_corpus_blocks(directory, 400, SEQ)
    return blocks, spec, generate_news_corpus(directory, num_rows=400, seed=0)


def make_cfg(tmp_path, source, **kw) -> TrainConfig:
    base = dict(model="gpt2-tiny", seq_len=SEQ, micro_batch_size=8, grad_accum=1, max_steps=8,
                warmup_steps=2, checkpoint_every=8, log_every=100, num_workers=1, lr=3e-3,
                storage_path=str(tmp_path), run_name="t", job="test", tensorboard=False,
                dataset=source.dataset, tokenizer=source.tokenizer, eval_every=4,
                eval_batches=2)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def strategy_for(cfg, spec):
    seed_everything(cfg.seed)
    model = build_gpt2(cfg.model, spec["vocab_size"], SEQ, eos_token_id=spec["eos_token_id"])
    return DDPStrategy(apply_ddp(model, torch.device("cpu")), cfg, torch.device("cpu"),
                       torch.float32)  # fmt: skip


def run(cfg, data, spec):
    strategy = strategy_for(cfg, spec)
    session = TorchrunSession(rank_batches(data, cfg.micro_batch_size), cfg.run_dir,
                              cfg.micro_batch_size)  # fmt: skip
    summary = train(cfg, strategy, session)
    return summary, {k: v.clone() for k, v in unwrap(strategy.model).state_dict().items()}


def test_validation_rows_are_held_out_from_the_training_file(tmp_path, corpus):
    import pyarrow.parquet as pq

    from shared.data import generate_news_rows

    _, _, source = corpus
    training = set(pq.read_table(source.dataset).column("text").to_pylist())
    held_out = [r["text"] for r in generate_news_rows(400, 0 + HELD_OUT_SEED)]
    assert len(set(held_out) - training) >= 300  # another seed range: mostly new rows
    cfg = make_cfg(tmp_path, source)
    blocks = validation_blocks(cfg, 16)
    assert blocks.shape == (16, SEQ)


def test_eval_does_not_change_training_and_its_loss_falls(tmp_path, corpus):
    data, spec, source = corpus
    with_eval, weights_with = run(make_cfg(tmp_path / "a", source), data, spec)
    without, weights_without = run(make_cfg(tmp_path / "b", source, eval_every=0), data, spec)
    for name, tensor in weights_without.items():
        assert torch.equal(weights_with[name], tensor), name  # bitwise
    assert with_eval["final_loss"] == without["final_loss"]
    assert "eval_loss" not in without
    assert with_eval["eval_loss"] < with_eval["first_eval_loss"]
    assert with_eval["eval_ppl"] == pytest.approx(math.exp(with_eval["eval_loss"]))
    # Samples at the end (shared/generation.py): greedy, so both runs write the same text.
    samples = [(tmp_path / run / "test" / "t" / "samples.txt").read_text() for run in "ab"]
    assert samples[0] == samples[1] and len(samples[0].splitlines()) == 3
    assert samples[0].startswith("'the market' -> '")


def _eval_worker(rank, init_file, cfg, spec, blocks, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        strategy = strategy_for(cfg, spec)
        result = Evaluator(cfg, rank, 2, torch.device("cpu"), blocks=blocks).evaluate(strategy)
        if rank == 0:
            torch.save(result, out)
    finally:
        dist.destroy_process_group()


def test_eval_is_token_weighted_over_uneven_ranks_without_dropping_rows(tmp_path, corpus):
    """5 rows, 2 ranks, micro-batch 2: rank 0 gets rows 0 2 4 (batches of 2 and 1), rank 1
    rows 1 3 (one batch, then a weight-0 filler forward). The result must equal the mean
    over all 5 rows' tokens in one process."""
    data, spec, source = corpus
    cfg = make_cfg(tmp_path, source, micro_batch_size=2, num_workers=2)
    blocks = data[:5].clone()
    out = str(tmp_path / "eval.pt")
    mp.spawn(_eval_worker, args=(str(tmp_path / "init"), cfg, spec, blocks, out), nprocs=2)
    two_ranks = torch.load(out)

    model = unwrap(strategy_for(cfg, spec).model).eval()
    with torch.no_grad():
        losses = [model(input_ids=blocks[i : i + 1], labels=blocks[i : i + 1]).loss
                  for i in range(5)]  # fmt: skip
    expected = float(torch.stack(losses).mean())  # every row has SEQ - 1 predicted tokens
    assert two_ranks["eval_tokens"] == 5 * (SEQ - 1)
    assert two_ranks["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert os.path.exists(out)
