"""PNG plots for runs and benchmarks (matplotlib, headless).

One place for every picture the project draws, so a run's loss curve and `make bench`'s
comparison charts look alike. The Agg backend renders to files only: train workers, CI and
SSH sessions have no display. Every function returns the path it wrote.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import matplotlib

matplotlib.use("Agg")  # before pyplot is imported anywhere: no display on workers or in CI

import matplotlib.pyplot as plt  # noqa: E402  (must follow matplotlib.use)

from shared import storage  # noqa: E402

FIGURE_DPI = 110


def _save(fig, path: str) -> str:
    """Render to PNG bytes and write them through the storage layer (local or s3://)."""
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=FIGURE_DPI)
    plt.close(fig)  # long-lived workers draw more than one figure: do not leak them
    storage.write_bytes(path, buffer.getvalue())
    return path


def _column(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) for the rows that carry a number under `key`."""
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
    return [s for s, _ in points], [v for _, v in points]


def save_run_plots(rows: list[dict], path: str, title: str = "") -> str:
    """Loss (top) and tokens/s with the share of step time spent waiting for data (bottom).

    `rows` are metrics.jsonl rows (keys step, loss, tokens_per_s, data_wait_fraction);
    missing keys are skipped, so a partial row set still plots.
    """
    return _save(run_figure(rows, title), path)


def run_figure(rows: list[dict], title: str = ""):
    """The figure :func:`save_run_plots` writes, open, so its series can be inspected (the
    caller closes it: ``plt.close(fig)``)."""
    fig, (loss_ax, speed_ax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)

    steps, losses = _column(rows, "loss")
    loss_ax.plot(steps, losses, color="tab:blue", label="train")
    evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if evals:  # held-out loss, on evaluation steps only
        loss_ax.plot(*zip(*evals, strict=True), color="tab:orange", marker="o", label="eval")
        loss_ax.legend(loc="upper right")
    loss_ax.set_ylabel("loss")
    loss_ax.set_title(title or "training loss")
    loss_ax.grid(alpha=0.3)

    steps, speeds = _column(rows, "tokens_per_s")
    speed_ax.plot(steps, speeds, color="tab:green", label="tokens/s")
    speed_ax.set_ylabel("tokens/s")
    speed_ax.set_xlabel("step")
    speed_ax.grid(alpha=0.3)

    # Data wait as % of step time on a second axis: a throughput dip that lines up with a
    # wait spike is the input pipeline, not the model (the "GPU sawtooth").
    waits = [(r["step"], 100 * r["data_wait_fraction"]) for r in rows if "data_wait_fraction" in r]
    if waits:
        wait_ax = speed_ax.twinx()
        wait_ax.plot(*zip(*waits, strict=True), color="tab:red", alpha=0.5, label="data wait %")
        wait_ax.set_ylabel("data wait (% of step)")
        wait_ax.set_ylim(0, 100)
        lines = speed_ax.get_lines() + wait_ax.get_lines()
        speed_ax.legend(lines, [line.get_label() for line in lines], loc="lower right")
    return fig


def save_bar_chart(
    path: str,
    labels: Sequence[str],
    values: Sequence[float],
    title: str,
    ylabel: str,
) -> str:
    """One bar per label with its value printed on top (e.g. tokens/s or GiB per strategy)."""
    if len(labels) != len(values):
        raise ValueError(f"{len(labels)} labels but {len(values)} values")
    fig, ax = plt.subplots(figsize=(max(4, 1.2 * len(labels) + 2), 4))
    bars = ax.bar(list(labels), list(values), color="tab:blue")
    ax.bar_label(bars, fmt="%.3g")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    ax.grid(axis="y", alpha=0.3)
    if len(labels) > 4:
        ax.tick_params(axis="x", labelrotation=30)
    return _save(fig, path)
