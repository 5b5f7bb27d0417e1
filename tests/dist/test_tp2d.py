"""jobs/tp2d's worker lines (TP inside each TP group, FSDP2 over dp) on 4 real gloo ranks,
trained by the shared loop without Ray: resuming on the same mesh repeats the run bitwise, and
resuming on half the dp ranks trains exactly the samples left. tests/e2e/test_tp2d.py runs the
job itself through Ray Train."""

from __future__ import annotations

import pytest
from sample_log import committed_samples
from weights import assert_bitwise_equal, final_weights

from dist.test_strategies import attempt, corpus, groups, losses, storage  # noqa: F401 (fixtures)

STEPS = {"max_steps": "12", "checkpoint_every": "6"}


@pytest.fixture(scope="module")
def uninterrupted(attempt):  # noqa: F811
    return attempt("tp2d", 4, **STEPS, run_name="full")[0]


def test_tp2d_trains_on_a_2x2_mesh(uninterrupted):
    assert uninterrupted["world_size"] == 4 and uninterrupted["steps"] == 12
    # ln(512) = 6.24 at random init; 12 steps on the topic-structured corpus reach ~4.6.
    assert uninterrupted["initial_loss"] == pytest.approx(6.24, abs=0.15)
    assert uninterrupted["final_loss"] < 0.85 * uninterrupted["initial_loss"]
    # TP peers read halves of their dp rank's micro-batch (then all-gather): each id once.
    committed = committed_samples(uninterrupted["run_dir"])
    assert all(set(c.values()) == {1} for c in committed.values())
    assert sum(len(c) for c in committed.values()) == 12 * 16


def test_tp2d_resumes_from_its_dcp_checkpoint_on_the_same_trajectory(uninterrupted, attempt):  # noqa: F811
    full = losses(uninterrupted)
    attempt("tp2d", 4, **STEPS, run_name="resume", stop_at_step="6")
    second, _ = attempt("tp2d", 4, **STEPS, run_name="resume")
    assert second["resumed_from_step"] == 6 and second["steps"] == 12
    resumed = losses(second)
    # Everything restored at the same mesh: the CPU float ops repeat exactly.
    assert [resumed[s] for s in range(7, 13)] == [full[s] for s in range(7, 13)]
    assert_bitwise_equal(final_weights(second), final_weights(uninterrupted))


def test_tp2d_resumes_on_half_the_dp_ranks_with_exactly_the_remaining_samples(
    uninterrupted,
    attempt,  # noqa: F811
):
    """The data unit is the dp rank: dp=2 x tp=2 stops mid-epoch, dp=1 x tp=2 (accumulating
    2 micro-batches, the same global batch of 16) trains exactly the samples left."""
    attempt("tp2d", 4, **STEPS, run_name="shrink", stop_at_step="6")
    half, _ = attempt("tp2d", 2, **STEPS, run_name="shrink", dp="1", grad_accum="2")
    assert half["world_size"] == 2 and half["resumed_from_step"] == 6 and half["steps"] == 12
    committed = committed_samples(half["run_dir"])
    assert all(set(c.values()) == {1} for c in committed.values())
    assert committed == committed_samples(uninterrupted["run_dir"])
    assert sum(len(c) for c in committed.values()) == 12 * 16
    assert half["data_read_amplification"] <= 1.05
    # The same samples per step, summed in another order: equal up to fp32 rounding.
    assert losses(half)[12] == pytest.approx(losses(uninterrupted)[12], rel=1e-4)
