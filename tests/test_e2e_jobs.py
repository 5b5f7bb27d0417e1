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


def test_ddp_smoke_trains_and_checkpoints(ddp_runs):
    first, _, storage = ddp_runs
    assert first.returncode == 0, first.output[-3000:]
    s = first.summary
    assert s["status"] == "succeeded" and s["job"] == "ddp" and s["profile"] == "smoke"
    assert s["world_size"] == 2 and s["steps"] == 20 and s["resumed_from_step"] is None
    # Random init starts at ~ln(512) = 6.24; the topic-structured corpus lets 20 steps reach
    # ~4.1. Requiring a 20% drop leaves a wide margin over step-to-step noise (~0.05).
    assert s["initial_loss"] == pytest.approx(6.24, abs=0.15)
    assert s["final_loss"] < 0.8 * s["initial_loss"]
    assert s["time_to_first_step_s"] > 0 and s["tokens_per_s"] > 0 and s["wall_s"] > 0
    # Every second of the start-up accounted for, phase by phase (shared/observability/startup.py).
    startup = s["startup_s"]
    assert list(startup) == ["cluster_start", "data_preparation", "driver_setup",
                             "worker_group_start", "model_build", "first_batch", "first_step",
                             "total"]  # fmt: skip
    assert startup["total"] == pytest.approx(s["time_to_first_step_s"], abs=0.01)
    assert all(v >= 0 for v in startup.values())
    assert_held_out_loss_fell(s)  # evaluations at steps 10 and 20
    # Each row of the packed dataset read once, across the epoch boundary.
    assert s["data_rows_trained"] == 20 * 32 and s["data_read_amplification"] <= 1.05
    # The checkpoint Ray Train registered: rank 0's model/optimizer, both ranks' RNG, counters.
    ckpt = s["checkpoint"]
    assert os.path.basename(ckpt) == "step_000020"
    assert sorted(os.listdir(ckpt)) == ["manifest", "model.pt", "rng", "train_state.json"]
    assert sorted(os.listdir(os.path.join(ckpt, "rng"))) == ["rank0.pt", "rank1.pt"]
    state = json.loads(Path(os.path.join(ckpt, "train_state.json")).read_text())
    assert state["step"] == 20 and state["world_size"] == 2
    saved = torch.load(os.path.join(ckpt, "model.pt"), weights_only=True)
    assert set(saved) == {"model", "optimizer", "scheduler"}
    assert saved["scheduler"]["last_epoch"] == 20
    # The run contract: the same JSON beside the run, plus one metrics row per step.
    run_dir = os.path.join(storage, "ddp", "resume")
    assert s["run_dir"] == run_dir
    assert "SUMMARY {" in first.stdout.splitlines()[-1]
    assert "step 20/20" in first.stdout and "eta" in first.stdout


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


def test_a_diverging_run_fails_with_status_diverged(tmp_path):
    result = run_job("ddp", "lr=1e9", "max_steps=10", "run_name=div", storage=tmp_path)
    assert result.returncode == 1
    s = result.summary
    assert s["status"] == "diverged" and s["checkpoint"] is None
    step = s["diverged_at_step"]
    # One line names the step and says what is safe to resume from.
    named = [
        line
        for line in result.output.splitlines()
        if f"diverged at step {step}" in line and not line.startswith("SUMMARY ")
    ]
    assert named == [
        f"error: TrainingDiverged: training diverged at step {step} "
        f"({s['divergence']}); this step was not saved; last good checkpoint: none"
    ]
    assert result.stdout.splitlines()[-1].startswith("SUMMARY {")

    def refuse(constant):
        raise ValueError(constant)

    run_dir = Path(s["run_dir"])
    assert json.loads((run_dir / "summary.json").read_text(), parse_constant=refuse) == s
    rows = [json.loads(line, parse_constant=refuse)
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    assert rows[-1]["step"] == step and rows[-1]["nonfinite"]
    assert not [name for name in os.listdir(run_dir) if name.startswith("step_")]


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


def test_env_check_reports_topology_bandwidth_and_matmul(tmp_path):
    result = run_job("env_check", "allreduce_sizes_mb=0.01,1", storage=tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    for heading in ("== nodes", "== workers", "== all-reduce across 2 workers"):
        assert heading in result.stdout
    assert "run env_check/" in result.stdout and "collective_timeout_s=1800.0" in result.stdout
    report = json.loads(Path(result.summary["report"]).read_text())
    assert len(report["nodes"]) == 1 and report["nodes"][0]["role"] == "head"
    assert report["nodes"][0]["cpus"] == os.cpu_count()
    assert len(report["workers"]) == 2
    for worker in report["workers"]:
        assert worker["torch"] == torch.__version__ and worker["backend"] == "gloo"
        assert worker["bf16"] in ("native", "emulated", "no")
        assert worker["matmul_tflops"]["fp32"] > 0
    assert [r["bytes"] for r in report["allreduce"]] == [10484, 1048576]  # whole fp32 elements
    assert all(r["busbw_GBps"] > 0 and r["time_ms"] > 0 for r in report["allreduce"])
    assert result.summary["status"] == "succeeded" and result.summary["world_size"] == 2


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
