"""Readers for what a run writes for observability (traces, TensorBoard events, PNGs), shared by
the unit and end-to-end tests. Each returns the contents, so tests assert on numbers and names."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from shared.profiling import STEP_RANGES

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
