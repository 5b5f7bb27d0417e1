"""Observability pieces in one process: profile_steps, plots, metrics rows, the progress line.
The shared loop's traces, TensorBoard events and loss curve on 2 gloo ranks are in
tests/dist/test_loop_observability.py."""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pytest
from observability_checks import png_shape

from shared.config import ConfigError, TrainConfig, build_config
from shared.observability.metrics import read_metrics
from shared.observability.plots import run_figure, save_bar_chart, save_run_plots
from shared.observability.profiling import parse_profile_steps

SEQ = 32


# --- profile_steps ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected", [("3-5", (3, 5)), ("7", (7, 7)), (" 2-2 ", (2, 2)), ("", None)]
)
def test_profile_steps_parse(text, expected):
    assert parse_profile_steps(text) == expected


@pytest.mark.parametrize("text", ["5-3", "0-2", "a-b", "3-", "-3", "3-5-7", "3..5"])
def test_malformed_profile_steps_are_rejected(text):
    with pytest.raises(ValueError):
        parse_profile_steps(text)


@pytest.mark.parametrize("text", ["5-3", "abc", "25-40", "0"])
def test_bad_profile_steps_fail_validation_with_one_sentence(text):
    with pytest.raises(ConfigError) as err:
        build_config(TrainConfig, {"smoke": {"max_steps": 30}}, "smoke", {"profile_steps": text})
    assert str(err.value) == (
        "profile_steps must be a step range a-b with 1 <= a <= b <= max_steps (30), "
        f"e.g. 3-5 (got '{text}')."
    )


def test_collective_timeout_must_be_positive():
    with pytest.raises(ConfigError, match=r"^collective_timeout_s must be >= 1 \(got 0\)\.$"):
        build_config(TrainConfig, {"smoke": {}}, "smoke", {"collective_timeout_s": "0"})


# --- plots and metrics rows ---------------------------------------------------------------


def test_run_plot_is_a_png_of_the_requested_figure(tmp_path):
    rows = [
        {"step": s, "loss": 6 - 0.1 * s, "tokens_per_s": 1000.0 + s, "step_time_s": 0.1,
         "data_wait_s": 0.01, "data_wait_fraction": 0.1}
        for s in range(1, 21)
    ]  # fmt: skip
    path = save_run_plots(rows, str(tmp_path / "nested" / "curve.png"), title="ddp t")
    assert path == str(tmp_path / "nested" / "curve.png")
    height, width, _ = png_shape(path)
    assert (width, height) == (880, 660)  # 8 x 6 inches at 110 dpi


def test_run_plot_tolerates_rows_without_some_keys(tmp_path):
    """A missing or null value leaves its point out; a series no row has is not drawn."""
    rows = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "tokens_per_s": None},
            {"step": 3, "tokens_per_s": 900.0, "eval_loss": None}]  # fmt: skip
    fig = run_figure(rows)
    try:
        loss_ax, speed_ax = fig.axes  # no data-wait axis: no row has data_wait_fraction
        # One line each: no eval curve, since no row has an eval loss.
        assert [line.get_xydata().tolist() for line in loss_ax.get_lines()] == [[[1, 5], [2, 4]]]
        assert [line.get_xydata().tolist() for line in speed_ax.get_lines()] == [[[3, 900]]]
        assert loss_ax.get_legend() is None and speed_ax.get_legend() is None
    finally:
        plt.close(fig)
    height, width, _ = png_shape(save_run_plots(rows, str(tmp_path / "partial.png")))
    assert (width, height) == (880, 660)


def test_bar_chart(tmp_path):
    path = save_bar_chart(
        str(tmp_path / "bars.png"), ["ddp", "fsdp", "zero3"], [3.0, 1.5, 1.4], "state", "GiB"
    )
    assert png_shape(path)[2] in (3, 4)
    with pytest.raises(ValueError, match="2 labels but 1 values"):
        save_bar_chart(str(tmp_path / "x.png"), ["a", "b"], [1.0], "t", "y")


def test_read_metrics_keeps_the_latest_row_of_a_replayed_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 6.0}, {"step": 2, "loss": 5.0}, {"step": 2, "loss": 4.9}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_metrics(str(path)) == [{"step": 1, "loss": 6.0}, {"step": 2, "loss": 4.9}]


def test_the_progress_line_and_summary_use_the_same_definitions():
    """Issue 13: the line said `data wait 1-9%` while SUMMARY said 0.53. Both now report the
    steady steps (all but the first), and the first batch's wait separately."""
    from types import SimpleNamespace

    from shared.observability.metrics import StepMetrics

    cfg = SimpleNamespace(tokens_per_step=1000, max_steps=4, driver_start_time=0.0)
    tracker = StepMetrics(cfg, flops_per_token=1e6, peak_tflops=1.0, world_size=2, path=None)
    # (step time, data wait): a slow first batch, then an epoch start at step 3.
    for step, (time_s, wait_s) in enumerate([(10.0, 9.0), (1.0, 0.0), (3.0, 2.0), (1.0, 0.0)], 1):
        row = tracker.record(step=step, epoch=0, loss=5.0, lr=1e-3, grad_norm=1.0,
                             step_time=time_s, data_wait=wait_s)  # fmt: skip
    summary = tracker.summary()
    assert summary["data_wait_fraction"] == pytest.approx(2.0 / 5.0)
    assert summary["first_batch_wait_s"] == 9.0
    assert summary["tokens_per_s"] == pytest.approx(3000 / 5.0)
    assert summary["mfu"] == pytest.approx(600 * 1e6 / 2e12)  # a fraction
    line = tracker.progress_line(row)
    assert "| 600 tok/s |" in line and "| mfu 0.03% |" in line and "| data wait 40% |" in line
