"""The jobs as a user runs them: a driver process, a real local Ray cluster, 2 workers."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_job
from observability_checks import (
    assert_held_out_loss_fell,
    assert_trace_has_step_ranges,
    png_shape,
    tensorboard_scalars,
)

from shared.observability.metrics import read_metrics

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory):
    """One 20-step run (steps 3-5 profiled), then the same run name again with 30 steps: it
    must resume at 20."""
    storage = tmp_path_factory.mktemp("runs")
    first = run_job(
        "ddp", "run_name=resume", "max_steps=20", "checkpoint_every=10", "profile_steps=3-5",
        storage=storage,
    )  # fmt: skip
    second = run_job(
        "ddp", "run_name=resume", "max_steps=30", "checkpoint_every=10", storage=storage
    )
    return first, second, storage


# The smoke profile's step: micro_batch_size 8 x grad_accum 2 x 2 workers = 32 sequences of 64.
SEQUENCES_PER_STEP = 32
TOKENS_PER_STEP = SEQUENCES_PER_STEP * 64


def first_run(ddp_runs) -> tuple[dict, list[dict]]:
    """The 20-step run's SUMMARY and its metrics rows (metrics.jsonl also holds the resume's
    steps 21-30)."""
    first = ddp_runs[0]
    assert first.returncode == 0, first.output[-3000:]
    rows = read_metrics(os.path.join(first.summary["run_dir"], "metrics.jsonl"))
    assert [r["step"] for r in rows[:20]] == list(range(1, 21))
    return first.summary, rows[:20]


def test_ddp_smoke_run_succeeds_on_two_workers(ddp_runs):
    s, _ = first_run(ddp_runs)
    assert s["status"] == "succeeded" and s["job"] == "ddp" and s["profile"] == "smoke"
    assert s["world_size"] == 2 and s["steps"] == 20 and s["steps_this_run"] == 20
    assert s["resumed_from_step"] is None
    assert s["run_dir"] == os.path.join(ddp_runs[2], "ddp", "resume")


def test_ddp_smoke_loss_falls(ddp_runs):
    s, rows = first_run(ddp_runs)
    # Random init starts at ~ln(512) = 6.24; the topic-structured corpus lets 20 steps reach
    # ~4.1. Requiring a 20% drop leaves a wide margin over step-to-step noise (~0.05).
    assert s["initial_loss"] == pytest.approx(6.24, abs=0.15)
    assert s["final_loss"] < 0.8 * s["initial_loss"]
    assert (s["initial_loss"], s["final_loss"]) == (rows[0]["loss"], rows[-1]["loss"])


def test_ddp_smoke_held_out_loss_falls(ddp_runs):
    assert_held_out_loss_fell(first_run(ddp_runs)[0])  # evaluations at steps 10 and 20


def test_ddp_smoke_tokens_per_s_is_tokens_trained_over_step_time(ddp_runs):
    s, rows = first_run(ddp_runs)
    for row in rows:  # each step's own rate
        assert row["tokens_per_s"] * row["step_time_s"] == pytest.approx(TOKENS_PER_STEP)
    # SUMMARY's rate leaves out step 1, which waits for the pipeline to start.
    steady_time = sum(r["step_time_s"] for r in rows[1:])
    assert s["tokens_per_s"] == pytest.approx(19 * TOKENS_PER_STEP / steady_time, rel=1e-9)
    assert s["step_time_median_s"] == pytest.approx(
        sorted(r["step_time_s"] for r in rows[1:])[9], rel=1e-9
    )  # the 10th of 19


def test_ddp_smoke_start_up_phases_add_up_to_the_time_to_first_step(ddp_runs):
    """Every second of the start-up accounted for, phase by phase (observability/startup.py)."""
    s, rows = first_run(ddp_runs)
    startup = s["startup_s"]
    assert list(startup) == ["cluster_start", "data_preparation", "driver_setup",
                             "worker_group_start", "model_build", "first_batch", "first_step",
                             "total"]  # fmt: skip
    phases = [seconds for name, seconds in startup.items() if name != "total"]
    assert min(phases) >= 0
    assert sum(phases) == pytest.approx(startup["total"], abs=0.01)  # each rounded to 1 ms
    assert startup["total"] == pytest.approx(s["time_to_first_step_s"], abs=0.01)
    # The first step phase starts at the first batch, inside step 1's own time.
    assert startup["first_step"] <= rows[0]["step_time_s"] + 0.01


def test_ddp_smoke_wall_time_covers_start_up_and_every_later_step(ddp_runs):
    s, rows = first_run(ddp_runs)
    # Steps 2-20 run one after another after the first step ended; wall_s is rounded to 10 ms.
    later_steps = sum(r["step_time_s"] for r in rows[1:])
    assert s["wall_s"] >= s["time_to_first_step_s"] + later_steps - 0.01
    assert s["time_to_first_step_s"] >= rows[0]["step_time_s"]


def test_ddp_smoke_reads_each_row_once(ddp_runs):
    """Each row of the packed dataset read once, across the epoch boundary."""
    s, _ = first_run(ddp_runs)
    assert s["data_rows_trained"] == 20 * SEQUENCES_PER_STEP
    assert s["data_rows_trained"] <= s["data_rows_read"] <= 1.05 * s["data_rows_trained"]
    assert s["data_read_amplification"] == round(s["data_rows_read"] / (20 * SEQUENCES_PER_STEP), 4)


def test_ddp_smoke_checkpoint_holds_the_state_to_resume_from(ddp_runs):
    """The checkpoint Ray Train registered: rank 0's model/optimizer, both ranks' RNG, counters."""
    ckpt = first_run(ddp_runs)[0]["checkpoint"]
    assert os.path.basename(ckpt) == "step_000020"
    assert sorted(os.listdir(ckpt)) == ["manifest", "model.pt", "rng", "train_state.json"]
    assert sorted(os.listdir(os.path.join(ckpt, "rng"))) == ["rank0.pt", "rank1.pt"]
    state = json.loads(Path(os.path.join(ckpt, "train_state.json")).read_text())
    assert state["step"] == 20 and state["world_size"] == 2
    saved = torch.load(os.path.join(ckpt, "model.pt"), weights_only=True)
    assert set(saved) == {"model", "optimizer", "scheduler"}
    assert saved["scheduler"]["last_epoch"] == 20


def test_ddp_smoke_log_shows_progress_every_log_every_steps_and_ends_with_summary(ddp_runs):
    first = ddp_runs[0]
    _, rows = first_run(ddp_runs)
    progress = re.findall(r"step +(\d+)/20 \| epoch \d+ \| loss (\d+\.\d{4}) \|.* eta (\S+)",
                          first.stdout)  # fmt: skip
    # Step 1, then every log_every=5 steps; the loss as metrics.jsonl has it; nothing left.
    assert [int(step) for step, _, _ in progress] == [1, 5, 10, 15, 20]
    assert [loss for _, loss, _ in progress] == [
        f"{rows[step - 1]['loss']:.4f}" for step in (1, 5, 10, 15, 20)
    ]
    assert progress[-1][2] == "0:00:00"
    assert first.stdout.splitlines()[-1].startswith("SUMMARY {")


def test_ddp_resume_starts_at_the_saved_step(ddp_runs):
    first, second, _ = ddp_runs
    assert second.returncode == 0, second.output[-3000:]
    s = second.summary
    assert s["resumed_from_step"] == 20 and s["steps"] == 30 and s["steps_this_run"] == 10
    assert "resumed from checkpoint at step 20" in second.stdout
    # Tokenised once: the second start reuses the first's packed dataset, and reads only the
    # rows of its 10 steps.
    assert "data: reusing packed dataset" in second.stdout
    assert "no tokenisation" in second.stdout
    assert s["data_rows_trained"] == 10 * 32 and s["data_read_amplification"] <= 1.05
    assert (
        "resuming ddp/resume with changed settings: max_steps 20 -> 30, profile_steps '3-5' -> ''\n"
        in second.stdout
    )
    # Restored weights, not a fresh init: the first resumed step is already near where the
    # first run ended, far below the random-init loss. initial_loss stays the run's first.
    assert s["attempt_initial_loss"] < first.summary["final_loss"] + 0.3
    assert s["attempt_initial_loss"] < 0.8 * first.summary["initial_loss"]
    assert s["initial_loss"] == first.summary["initial_loss"]
    # The run contract: summary.json holds the same JSON as the last SUMMARY line, and
    # metrics.jsonl one row per step across both runs of this run name.
    assert json.loads(Path(os.path.join(s["run_dir"], "summary.json")).read_text()) == s
    metrics = [
        json.loads(line) for line in Path(s["run_dir"], "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in metrics] == list(range(1, 31))
    # The first run ended its 20-step cosine at lr x min_lr_ratio = 3e-4; extended to 30 steps
    # the learning rate stays there instead of jumping back up a 30-step cosine.
    assert [m["lr"] for m in metrics[19:]] == pytest.approx([3e-4] * 11, rel=1e-9)


def test_a_resume_that_changes_seq_len_is_refused_before_ray_starts(ddp_runs):
    _, _, storage = ddp_runs
    result = run_job("ddp", "run_name=resume", "max_steps=30", "seq_len=32",
                     "micro_batch_size=4", storage=storage, timeout=120)  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: run ddp/resume ")
    assert "seq_len=64" in result.stderr and "seq_len=32" in result.stderr
    assert "Ray dashboard" not in result.stdout


def test_a_healthy_run_prints_what_matters_and_ends_with_summary(ddp_runs):
    """No error-looking lines from Ray or torch, no Ray Data statistics dump, a bounded log
    (start block + ~14 lines per run + progress lines), SUMMARY last: for a fresh run (with
    the profiler on) and for its resume (the smoke profile's settings, 30 steps)."""
    for run in ddp_runs[:2]:
        lines = run.output.splitlines()
        assert not [line for line in lines if re.search(r"\bERROR\b|Traceback", line)]
        assert len(lines) < 60, "\n".join(lines)
        assert run.stdout.splitlines()[-1].startswith("SUMMARY {")
        assert "data pipeline stats: " in run.stdout and "Operator 1" not in run.output


def test_ddp_run_is_observable(ddp_runs):
    """Start block, profiler traces per rank, TensorBoard scalars, loss curve, data stats."""
    first, second, _ = ddp_runs
    run_dir = Path(first.summary["run_dir"])
    assert f"run ddp/resume (profile smoke): {run_dir}\n" in first.stdout
    assert "  settings: run_name=resume " in first.stdout and "profile_steps=3-5" in first.stdout
    for rank in (0, 1):
        assert_trace_has_step_ranges(run_dir / "profile" / f"rank{rank}.json", range(3, 6))
    assert "profiler: steps 3-5 traced to" in first.stdout
    # One TensorBoard folder per run: the resumed run appended steps 21-30 to it.
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    rows = read_metrics(str(run_dir / "metrics.jsonl"))
    assert sorted(scalars["train/loss"]) == [r["step"] for r in rows] == list(range(1, 31))
    for row in rows:
        assert scalars["train/loss"][row["step"]] == pytest.approx(row["loss"], rel=1e-6)
        assert scalars["time/data_wait_s"][row["step"]] == pytest.approx(
            row["data_wait_s"], rel=1e-5, abs=1e-9
        )
    # The data-wait metric in SUMMARY is the first run's steps' waits added up.
    assert first.summary["data_wait_total_s"] == pytest.approx(
        sum(r["data_wait_s"] for r in rows[:20]), rel=1e-6
    )
    assert 0 <= first.summary["data_wait_fraction"] <= 1
    assert png_shape(run_dir / "loss_curve.png")[:2] == (660, 880)
    # Ray Data's stats for the training dataset: kept in a file, pointed at in the log.
    assert f"data pipeline stats: {run_dir / 'data_stats.txt'}" in second.stdout
    stats = (run_dir / "data_stats.txt").read_text()
    # The training read: this rank's chunk files of the packed dataset (packing ran earlier).
    assert "MapBatches(read_packed_chunks)" in stats and "Dataset throughput" in stats


def test_bad_override_fails_before_ray_starts(tmp_path):
    result = run_job("ddp", "num_workers=-1", storage=tmp_path, timeout=60)
    assert result.returncode == 2
    assert result.stderr == "error: num_workers must be >= 1 (got -1).\n"
    assert "Ray dashboard" not in result.stdout and not (tmp_path / "ddp").exists()


def test_make_rejects_an_unknown_job_with_one_line():
    proc = subprocess.run(
        ["make", "-s", "run-local", "JOB=nope"], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown JOB 'nope'; valid jobs: " in lines[0] and "ddp" in lines[0]


def test_a_dataset_that_is_not_parquet_fails_before_ray_starts(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("hello world\n")
    result = run_job("ddp", f"dataset={text}", storage=tmp_path, timeout=300)
    assert result.returncode == 2
    assert result.stderr == (
        f"error: dataset '{text}' is not a .parquet file; the jobs read parquet only: convert it "
        "(e.g. pandas.read_csv(...).to_parquet(...)) or point dataset= at a parquet file.\n"
    )
    assert "Ray dashboard" not in result.stdout and "SUMMARY" not in result.stdout
