"""The shared loop + DDP strategy, without Ray: single process and 2 gloo ranks."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_corpus_blocks

from shared.config import TrainConfig
from shared.launch import seed_everything
from shared.loop import train
from shared.models import build_gpt2, unwrap
from shared.parallel.ddp import DDPStrategy, apply_ddp
from shared.torchrun import TorchrunSession, rank_batches

SEQ = 32


@pytest.fixture(scope="module")
def blocks(tmp_path_factory) -> tuple[torch.Tensor, dict]:
    return tiny_corpus_blocks(str(tmp_path_factory.mktemp("data")), 400, SEQ)


def make_cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(model="gpt2-tiny", seq_len=SEQ, micro_batch_size=8, grad_accum=1, max_steps=10,
                warmup_steps=2, checkpoint_every=5, log_every=100, num_workers=1, lr=3e-3,
                storage_path=str(tmp_path), run_name="t", job="test")  # fmt: skip
    return TrainConfig(**{**base, **kw})


def run(cfg, data, spec, root, rank=0, world=1):
    seed_everything(cfg.seed)
    model = build_gpt2(
        cfg.model, spec["vocab_size"], cfg.seq_len, eos_token_id=spec["eos_token_id"]
    )
    model = apply_ddp(model, torch.device("cpu"))
    strategy = DDPStrategy(model, cfg, torch.device("cpu"), torch.float32)
    session = TorchrunSession(
        rank_batches(data, cfg.micro_batch_size, rank, world),
        root,
        cfg.micro_batch_size,
        rank,
        world,
    )
    summary = train(cfg, strategy, session)
    params = {k: v.detach().clone() for k, v in unwrap(strategy.model).state_dict().items()}
    return summary, params, session


def test_loss_falls_and_checkpoints_are_written(tmp_path, blocks):
    data, spec = blocks
    cfg = make_cfg(tmp_path, max_steps=20, checkpoint_every=10)
    summary, _, session = run(cfg, data, spec, str(tmp_path / "ckpt"))
    # Random init predicts ~uniformly: loss ~ ln(512) = 6.24. Twenty steps on topic-structured
    # text reach ~4.3; 15% below the start is far outside step-to-step noise (~0.05).
    assert summary["initial_loss"] == pytest.approx(6.24, abs=0.15)
    assert summary["final_loss"] < 0.85 * summary["initial_loss"]
    assert [os.path.basename(c) for c in session.checkpoints()] == ["step_000010", "step_000020"]
    # DDP holds everything: grads = params; AdamW keeps exp_avg + exp_avg_sq (2x params) plus
    # one 4-byte step counter per parameter tensor.
    state = summary["model_state_bytes_per_rank"]
    assert state["grads"] == state["params"]
    extra = state["optimizer"] - 2 * state["params"]
    assert extra % 4 == 0 and 0 < extra < 0.01 * state["params"]


def test_gradient_accumulation_matches_one_big_batch(tmp_path, blocks):
    data, spec = blocks
    big, _, _ = run(
        make_cfg(tmp_path / "a", micro_batch_size=8, grad_accum=1, max_steps=5),
        data,
        spec,
        str(tmp_path / "a"),
    )
    acc, _, _ = run(
        make_cfg(tmp_path / "b", micro_batch_size=4, grad_accum=2, max_steps=5),
        data,
        spec,
        str(tmp_path / "b"),
    )
    # Same 8 sequences per step, summed as 2 x (mean / 2): equal up to fp32 summation order.
    assert acc["final_loss"] == pytest.approx(big["final_loss"], rel=1e-5)


def test_resume_continues_bit_exactly(tmp_path, blocks):
    """Stop at step 5, resume from that checkpoint: weights after 10 steps are identical."""
    data, spec = blocks
    cfg = make_cfg(tmp_path, max_steps=12, checkpoint_every=5)
    _, uninterrupted, session = run(cfg, data, spec, str(tmp_path / "full"))
    resumed_root = tmp_path / "resumed"
    resumed_root.mkdir()
    shutil.copytree(session.checkpoints()[0], resumed_root / "step_000005")
    summary, resumed, _ = run(cfg, data, spec, str(resumed_root))
    assert summary["resumed_from_step"] == 5 and summary["steps_this_run"] == 7
    for name, tensor in uninterrupted.items():
        assert torch.equal(tensor, resumed[name]), name


def _ddp_worker(rank, world, init_file, cfg, data, spec, root, out):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        summary, params, session = run(cfg, data, spec, root, rank, world)
        if rank == 0:
            torch.save({"summary": summary, "params": params}, out)
    finally:
        dist.destroy_process_group()


def test_two_rank_ddp_equals_one_process_with_the_same_global_batch(tmp_path, blocks):
    data, spec = blocks
    single_cfg = make_cfg(tmp_path / "one", micro_batch_size=8, max_steps=6)
    single, single_params, _ = run(single_cfg, data, spec, str(tmp_path / "one"))
    ddp_cfg = make_cfg(tmp_path / "two", micro_batch_size=4, max_steps=6, num_workers=2)
    out = tmp_path / "ddp.pt"
    mp.spawn(
        _ddp_worker,
        args=(2, str(tmp_path / "init"), ddp_cfg, data, spec, str(tmp_path / "two"), str(out)),
        nprocs=2,
    )
    ddp = torch.load(out, weights_only=False)
    # Rank r takes micro-batches r, r+2, ... ; each step the two ranks together see the same 8
    # sequences as the single process. All-reduce averages the grads: fp32 rounding only.
    assert ddp["summary"]["final_loss"] == pytest.approx(single["final_loss"], rel=1e-5)
    # Adam divides by sqrt(v): for a weight whose gradient is ~0, fp32 rounding noise in the
    # all-reduced sum becomes a visible update (seen: 3.5e-6 after 6 steps at lr 3e-3), so
    # weights get an absolute tolerance of 5e-5, ~1% of one step's largest update.
    for name, tensor in single_params.items():
        torch.testing.assert_close(ddp["params"][name], tensor, rtol=1e-4, atol=5e-5)
