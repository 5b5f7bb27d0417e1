"""Readers for what a run writes for observability (traces, TensorBoard events, PNGs), shared by
the unit and end-to-end tests. Each returns the contents, so tests assert on numbers and names."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from shared.generation import PROMPTS
from shared.observability.profiling import STEP_RANGES

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def trace_range_counts(trace_file: Path) -> Counter:
    """How often each named complete event ("ph": "X") occurs in a Chrome trace."""
    events = json.loads(Path(trace_file).read_text())["traceEvents"]
    return Counter(e["name"] for e in events if e.get("ph") == "X")


def assert_trace_has_step_ranges(
    trace_file: Path, steps: range, ranges: tuple[str, ...] = STEP_RANGES
) -> Counter:
    counts = trace_range_counts(trace_file)
    assert {f"train_step#{s}" for s in steps} <= set(counts), sorted(counts)[:40]
    missing = [name for name in ranges if counts[name] < len(steps)]
    assert not missing, f"{trace_file}: ranges missing or too few: {missing}"
    # Only the requested steps are recorded: a step marker outside them would mean the
    # profiler started early or stopped late.
    recorded = {n for n in counts if n.startswith("train_step#")}
    assert recorded == {f"train_step#{s}" for s in steps}, recorded
    return counts


def tensorboard_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from every event file under ``logdir`` (tensorboard's reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def png_shape(path: Path) -> tuple[int, ...]:
    """(height, width, channels) of a PNG, after checking its signature."""
    import matplotlib.image

    assert Path(path).read_bytes()[:8] == PNG_MAGIC, f"{path} is not a PNG"
    return matplotlib.image.imread(str(path)).shape


def assert_held_out_loss_fell(summary: dict) -> None:
    """Issue 17's acceptance for a smoke run: SUMMARY carries the held-out loss and
    perplexity, and the last evaluation is below the first (eval_every=10 in the smoke
    profiles, so a run of more than 10 steps evaluates at least twice)."""
    assert {"eval_loss", "eval_ppl", "first_eval_loss"} <= set(summary), sorted(summary)
    assert summary["eval_ppl"] == pytest.approx(math.exp(summary["eval_loss"]), rel=1e-9)
    assert summary["eval_loss"] < summary["first_eval_loss"], summary
    # The same evaluations in metrics.jsonl and TensorBoard, and the run's samples.txt: one
    # greedy continuation per prompt, written collectively by whichever strategy trained.
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evaluated = {r["step"]: r["eval_loss"] for r in rows if r.get("eval_loss") is not None}
    assert len(evaluated) >= 2 and evaluated[summary["steps"]] == summary["eval_loss"], evaluated
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert scalars["eval/loss"] == pytest.approx(evaluated, rel=1e-6)
    samples = (run_dir / "samples.txt").read_text().splitlines()
    assert [line.split(" -> ")[0] for line in samples] == [repr(p) for p in PROMPTS], samples
    assert all(len(line.split(" -> ")[1]) > 2 for line in samples), samples
