"""What `make bench` reports from its runs (benchmarks/bench.py): the Ray Train vs torchrun
numbers its JSON carries, from summaries shaped like the jobs' SUMMARY lines. No runs."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import bench

DDP, TORCHRUN = (next(v for v in bench.VARIANTS if v.key == k) for k in ("ddp", "torchrun"))


def result(variant, repeat: int, step_s: float, startup: dict, amplification=1.0):
    summary = {"run_dir": f"/runs/{variant.key}-r{repeat}", "world_size": 2,
               "tokens_per_s": 2048 / step_s, "time_to_first_step_s": startup["total"],
               "startup_s": startup, "data_read_amplification": amplification,
               "model_state_bytes_per_rank": {"params": 1}, "peak_rss": 1}  # fmt: skip
    return bench.RunResult(variant, summary, [step_s] * 5, wall_s=30.0)


def test_the_json_has_per_variant_medians_paired_ratios_and_the_startup_breakdown(tmp_path):
    results = [
        result(DDP, 0, 0.042, {"cluster_start": 4.0, "first_step": 0.5, "total": 10.0}),
        result(TORCHRUN, 0, 0.040, {"worker_group_start": 2.0, "first_step": 0.4, "total": 4.0}),
        result(DDP, 1, 0.044, {"cluster_start": 6.0, "first_step": 0.7, "total": 12.0}),
        result(TORCHRUN, 1, 0.040, {"worker_group_start": 3.0, "first_step": 0.6, "total": 5.0}),
    ]
    rows = [bench.aggregate(results, v) for v in (DDP, TORCHRUN)]
    assert rows[0]["startup_s"] == {"cluster_start": 5.0, "first_step": 0.6, "total": 11.0}
    numbers = bench.ray_vs_torchrun(rows, results)
    assert [round(p["ratio"], 3) for p in numbers["paired_ratios"]] == [1.05, 1.1]
    assert numbers["paired_ratio_median"] == pytest.approx(1.075)
    assert numbers["step_ratio"] == pytest.approx(0.043 / 0.040)
    assert numbers["time_to_first_step_s"] == {"ray": 11.0, "torchrun": 4.5}
    assert numbers["startup_s"]["torchrun"]["worker_group_start"] == 2.5
    json.dumps(numbers)  # what --json writes
    bench_state = bench.Bench(tmp_path, steps=20)
    bench_state.results = results
    args = argparse.Namespace(steps=20, repeats=2, budget_s=840)
    info = {"cpu": "cpu", "cores": 2, "os": "linux", "load_average": "1", "python": "3.11",
            "torch": "t", "ray": "r", "deepspeed": "d", "date": "today"}  # fmt: skip
    text = bench.render_markdown(rows, info, bench_state, args, "chart.png")
    assert "| cluster_start | 5.00 | - |" in text and "| worker_group_start | - | 2.50 |" in text
    assert "repeat 0: 42.0 vs 40.0 ms = 1.05" in text


def test_a_regenerated_report_keeps_the_hand_written_notes():
    """docs/benchmarks.md explains where the time went; `make bench` must not erase that."""
    notes = "\n## Where the time went\n\nthe reasons\n"
    previous = "# old numbers\n\n" + bench.NOTES_MARKER + notes
    new = bench.with_kept_notes("# new numbers\n", previous)
    assert new == "# new numbers\n\n" + bench.NOTES_MARKER + notes
    assert bench.with_kept_notes("# new numbers\n", "# no notes\n") == "# new numbers\n"
