"""The shared loop + DDP strategy, without Ray: single process and 2 gloo ranks."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_corpus_blocks

from shared.config import TrainConfig
from shared.loop import train
from shared.models.gpt2 import build_gpt2
from shared.models.structure import unwrap
from shared.parallel.ddp import DDPStrategy, apply_ddp
from shared.runtime import preemption
from shared.runtime.torchrun import TorchrunSession, rank_batches
from shared.runtime.worker import seed_everything

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


def test_a_corrupt_latest_checkpoint_resumes_from_the_previous_one(tmp_path, blocks, capsys):
    """A torn upload of the newest checkpoint's model.pt: its manifest no longer verifies, so
    the resume says so in one warning and starts from the one before (checkpoint/resume.py;
    under Ray Train the newest is the one the controller registered, the same plan)."""
    data, spec = blocks
    root = str(tmp_path / "ckpt")
    run(make_cfg(tmp_path, max_steps=8, checkpoint_every=4), data, spec, root)
    model = Path(root, "step_000008", "model.pt")
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    capsys.readouterr()
    summary, _, _ = run(make_cfg(tmp_path, max_steps=12, checkpoint_every=4), data, spec, root)
    printed = capsys.readouterr()
    warnings = [line for line in (printed.out + printed.err).splitlines()
                if "warning: checkpoint" in line]  # fmt: skip
    assert len(warnings) == 1, warnings
    assert "step_000008 fails verification: model.pt has" in warnings[0]
    assert "resuming from step_000004" in warnings[0]
    assert summary["resumed_from_step"] == 4 and summary["steps_this_run"] == 8
    state = json.loads(Path(root, "step_000012", "train_state.json").read_text())
    assert state["step"] == 12


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


def strict_rows(path) -> list[dict]:
    """metrics.jsonl parsed by a strict JSON reader (NaN/Infinity are refused)."""

    def refuse(constant):
        raise ValueError(f"non-JSON constant {constant} in {path}")

    with open(path) as f:
        return [json.loads(line, parse_constant=refuse) for line in f if line.strip()]


def test_a_diverging_run_stops_without_writing_non_finite_checkpoints(tmp_path, blocks):
    """lr=1e9 blows the weights up within a few steps. The run stops at the first step whose
    loss, grad norm or weights are not finite; every checkpoint written is finite."""
    data, spec = blocks
    cfg = make_cfg(tmp_path, lr=1e9, max_steps=10, checkpoint_every=1)
    summary, _, session = run(cfg, data, spec, str(tmp_path / "ckpt"))
    assert summary["status"] == "diverged"
    step = summary["diverged_at_step"]
    assert 1 <= step < 10 and summary["steps_this_run"] == step
    saved = [int(os.path.basename(c).removeprefix("step_")) for c in session.checkpoints()]
    assert saved == list(range(1, step))
    assert summary["last_good_checkpoint_step"] == (step - 1 or None)
    for directory in session.checkpoints():
        weights = torch.load(os.path.join(directory, "model.pt"), weights_only=True)["model"]
        assert all(torch.isfinite(t).all() for t in weights.values()), directory
    rows = strict_rows(os.path.join(cfg.run_dir, "metrics.jsonl"))
    assert [r["step"] for r in rows] == list(range(1, step + 1))
    bad = rows[-1]
    assert bad["nonfinite"] and all(bad[key] is None for key in bad["nonfinite"])
    with open(os.path.join(cfg.run_dir, "divergence.json")) as f:
        record = json.load(f)
    assert record["diverged_at_step"] == step and record["status"] == "diverged"


class WeightsTurnNaN(DDPStrategy):
    """Step ``nan_at``'s loss and gradient norm are finite, and then its update leaves a NaN
    weight; with ``sigterm``, a SIGTERM arrives during that step."""

    nan_at, sigterm, steps = 3, False, 0

    def optimizer_step(self) -> float:
        grad_norm = super().optimizer_step()
        self.steps += 1
        if self.steps == self.nan_at:
            with torch.no_grad():
                next(unwrap(self.model).parameters()).view(-1)[0] = float("nan")
            if self.sigterm:
                preemption._stop.set()  # what this process's SIGTERM handler sets
        return grad_norm


def train_until_nan(tmp_path, blocks, nan_at: int, sigterm: bool = False, **settings):
    """(summary, session) of a one-rank DDP run whose weights turn NaN at step ``nan_at``."""
    data, spec = blocks
    cfg = make_cfg(tmp_path, max_steps=10, **settings)
    seed_everything(cfg.seed)
    model = build_gpt2(
        cfg.model, spec["vocab_size"], cfg.seq_len, eos_token_id=spec["eos_token_id"]
    )
    model = apply_ddp(model, torch.device("cpu"))
    strategy = WeightsTurnNaN(model, cfg, torch.device("cpu"), torch.float32)
    strategy.nan_at, strategy.sigterm = nan_at, sigterm
    session = TorchrunSession(rank_batches(data, cfg.micro_batch_size, 0, 1),
                              str(tmp_path / "ckpt"), cfg.micro_batch_size, 0, 1)  # fmt: skip
    try:
        return train(cfg, strategy, session), session
    finally:
        preemption._stop.clear()


def test_a_stop_checkpoint_is_never_written_from_non_finite_weights(tmp_path, blocks):
    """The weights check once ran on regular checkpoint steps only: a preemption stop saved
    NaN weights as the latest checkpoint, and the rerun resumed from them."""
    summary, session = train_until_nan(tmp_path, blocks, 3, sigterm=True, checkpoint_every=2)
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == 3, summary
    assert summary["divergence"] == "non-finite weights"
    assert [os.path.basename(c) for c in session.checkpoints()] == ["step_000002"]


def test_a_node_drain_checkpoint_counts_as_the_last_good_one(tmp_path, blocks, monkeypatch):
    """A drain notice at step 3 saves step_000003 and training goes on; when step 5's update
    then leaves a NaN weight (step 6's loss is NaN), the last good checkpoint is step 3 (it
    once said none: only regular checkpoints were counted)."""
    # The notice Ray Train would give (ray.train.get_preemption_info) arrives before step 3 ends.
    monkeypatch.setattr(preemption.StopCheck, "node_draining", lambda self, step: step == 3)
    summary, session = train_until_nan(tmp_path, blocks, 5, checkpoint_every=10)
    assert summary["status"] == "diverged" and summary["diverged_at_step"] == 6, summary
    assert [os.path.basename(c) for c in session.checkpoints()] == ["step_000003"]
    assert summary["last_good_checkpoint_step"] == 3


def lr_rows(run_dir) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in strict_rows(os.path.join(run_dir, "metrics.jsonl"))}


def test_extending_max_steps_continues_the_learning_rate_from_the_resume_step(tmp_path, blocks):
    """Trained 5 steps of a 10-step schedule, resumed with max_steps=20: the LR at step 5 is
    unchanged and from there a half-cosine decays to lr x min_lr_ratio at step 20 (README
    "Resuming a run"). Rebuilding the schedule would jump to the 20-step cosine's value."""
    data, spec = blocks
    first = make_cfg(tmp_path / "a", max_steps=10, checkpoint_every=5)
    _, _, session = run(first, data, spec, str(tmp_path / "a" / "ckpt"))
    resumed_root = tmp_path / "b" / "ckpt"
    resumed_root.mkdir(parents=True)
    shutil.copytree(session.checkpoints()[0], resumed_root / "step_000005")
    longer = make_cfg(tmp_path / "b", max_steps=20, checkpoint_every=5)
    summary, _, _ = run(longer, data, spec, str(resumed_root))
    assert summary["resumed_from_step"] == 5
    before, after = lr_rows(first.run_dir), lr_rows(longer.run_dir)
    lr, floor = first.lr, first.lr * first.min_lr_ratio
    # The row of step k holds the LR of the next update: multiplier(k).
    m5 = before[5] / lr
    for step in range(6, 21):
        progress = (step - 5) / (20 - 5)
        expected = floor + (before[5] - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        assert after[step] == pytest.approx(expected, rel=1e-9), step
    assert after[20] == pytest.approx(floor, rel=1e-9)
    series = [before[5]] + [after[s] for s in range(6, 21)]
    assert all(b <= a for a, b in zip(series, series[1:], strict=False))  # never rises
    # Warm-up 2, cosine over steps 2..10: m5 = 0.72. Rebuilding the schedule for 20 steps
    # gave 0.90 at step 6: a jump up.
    assert m5 == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 3 / 8)), rel=1e-9)
    assert after[6] / lr < m5 < 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 18))


def test_extending_a_finished_run_continues_at_the_minimum_learning_rate(tmp_path, blocks):
    """The README's exp1 example: 10 of 10 steps, then max_steps=16. The LR stays at
    lr x min_lr_ratio instead of jumping back up the longer cosine (a rebuilt cosine once put
    step 21 at 1.71e-3 after 3.0e-4 at step 20)."""
    data, spec = blocks
    cfg = make_cfg(tmp_path, max_steps=10, checkpoint_every=10)
    run(cfg, data, spec, str(tmp_path / "ckpt"))
    summary, _, _ = run(make_cfg(tmp_path, max_steps=16, checkpoint_every=10), data, spec,
                        str(tmp_path / "ckpt"))  # fmt: skip
    assert summary["resumed_from_step"] == 10
    rows = lr_rows(cfg.run_dir)
    floor = cfg.lr * cfg.min_lr_ratio
    assert [rows[s] for s in range(10, 17)] == pytest.approx([floor] * 7, rel=1e-9)


def test_initial_loss_is_the_runs_first_step_also_after_a_resume(tmp_path, blocks):
    data, spec = blocks
    cfg = make_cfg(tmp_path, max_steps=10, checkpoint_every=5)
    first, _, session = run(cfg, data, spec, str(tmp_path / "full"))
    resumed_root = tmp_path / "resumed"
    resumed_root.mkdir()
    shutil.copytree(session.checkpoints()[0], resumed_root / "step_000005")
    resumed, _, _ = run(cfg, data, spec, str(resumed_root))
    assert resumed["initial_loss"] == first["initial_loss"] == first["attempt_initial_loss"]
    assert resumed["attempt_initial_loss"] < first["initial_loss"] - 0.3
