"""jobs/tp2d on a real local Ray cluster: 4 CPU workers as dp=2 x tp=2. Its resumes (same
mesh, half the dp ranks) are tests/dist/test_tp2d.py, on gloo ranks without Ray."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import run_job
from observability_checks import assert_held_out_loss_fell, assert_trace_has_step_ranges
from sample_log import committed_samples

# Jobs join one Ray cluster shared by this module (conftest.py: `job_cluster`).
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("job_cluster")]

STEPS = ("max_steps=12", "checkpoint_every=6")


def ok(result) -> dict:
    assert result.returncode == 0, result.output[-4000:]
    return result.summary


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp2d")


@pytest.fixture(scope="module")
def uninterrupted(storage):
    return run_job("tp2d", *STEPS, "run_name=full", "profile_steps=3-5", "log_samples=true",
                   storage=storage)  # fmt: skip


def test_tp2d_smoke_trains_on_a_2x2_mesh(uninterrupted):
    s = ok(uninterrupted)
    assert s["world_size"] == 4 and s["steps"] == 12
    # ln(512) = 6.24 at random init; 12 steps on the topic-structured corpus reach ~4.6.
    assert s["initial_loss"] == pytest.approx(6.24, abs=0.15)
    assert s["final_loss"] < 0.85 * s["initial_loss"]
    assert_held_out_loss_fell(s)  # evaluations at steps 10 and 12
    # TP peers read halves of their dp rank's micro-batch through Ray Data, then all-gather:
    # each sample id of the 12 global batches of 16 trained once.
    committed = committed_samples(s["run_dir"])
    assert all(set(c.values()) == {1} for c in committed.values())
    assert sum(len(c) for c in committed.values()) == 12 * 16
    for rank, (dp, tp) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        assert f"rank {rank}: node " in uninterrupted.stdout
        assert f"(dp={dp}, tp={tp})" in uninterrupted.stdout
    # Every rank wrote its shards of the 2-D sharded model and optimizer; rank 0 the metadata.
    dcp = Path(s["checkpoint"], "dcp")
    assert sorted(p.name for p in dcp.iterdir()) == [
        ".metadata",
        *(f"__{r}_0.distcp" for r in range(4)),
    ]


def test_tp2d_traces_the_named_ranges_on_all_four_ranks(uninterrupted):
    run_dir = Path(ok(uninterrupted)["run_dir"])
    for rank in range(4):
        counts = assert_trace_has_step_ranges(run_dir / "profile" / f"rank{rank}.json", range(3, 6))
        # Each rank reads half a micro-batch and all-gathers the other half from its TP peer.
        assert counts["gloo:all_gather"] >= 3


def test_planner_predicts_the_measured_model_state_bytes(uninterrupted):
    """TP halves the matrices, SequenceParallel keeps the norms whole on both TP ranks, then
    FSDP halves everything over dp: the planner's TP x FSDP layout, byte for byte."""
    from shared.planner import from_preset, model_state_per_rank

    model = from_preset("llama-tiny", vocab=512, seq_len=64)  # the smoke tokenizer's vocabulary
    planned = model_state_per_rank(model, "tp_fsdp", gpus=4, tp=2)
    assert planned == ok(uninterrupted)["model_state_bytes_per_rank"]


def test_invalid_mesh_fails_before_ray_starts(tmp_path):
    result = run_job("tp2d", "tp=3", "num_workers=6", "dp=2", storage=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr == "error: tp (3) must divide the attention heads of llama-tiny (4).\n"
    assert "Ray dashboard" not in result.stdout
