"""Observability pieces without Ray: profile_steps, plots, metrics rows, and the shared loop's
traces + TensorBoard events + loss curve on 2 gloo ranks (torchrun-style), collective timeout."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_corpus_blocks
from observability_checks import assert_trace_has_step_ranges, png_shape, tensorboard_scalars

from shared.config import ConfigError, TrainConfig, build_config
from shared.observability.metrics import read_metrics
from shared.observability.plots import save_bar_chart, save_run_plots
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
    rows = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "tokens_per_s": None}]
    png_shape(save_run_plots(rows, str(tmp_path / "partial.png")))


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


# --- the shared loop on two gloo ranks ----------------------------------------------------


@pytest.fixture(scope="module")
def blocks(tmp_path_factory) -> tuple[torch.Tensor, dict]:
    return tiny_corpus_blocks(str(tmp_path_factory.mktemp("data")), 300, SEQ)


def _ddp_rank(rank, world, init_file, cfg, data, spec):
    from shared.loop import train
    from shared.models.gpt2 import build_gpt2
    from shared.parallel.ddp import DDPStrategy, apply_ddp
    from shared.runtime.torchrun import TorchrunSession, rank_batches
    from shared.runtime.worker import seed_everything

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        seed_everything(cfg.seed)
        model = build_gpt2(cfg.model, spec["vocab_size"], SEQ, eos_token_id=spec["eos_token_id"])
        strategy = DDPStrategy(apply_ddp(model, torch.device("cpu")), cfg, torch.device("cpu"),
                               torch.float32)  # fmt: skip

        session = TorchrunSession(rank_batches(data, 4, rank, world),
                                  os.path.join(cfg.run_dir, "ckpt"), 4, rank, world)  # fmt: skip
        train(cfg, strategy, session)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory, blocks):
    """8 steps, 2 micro-batches each, on 2 DDP ranks; steps 2-3 profiled."""
    data, spec = blocks
    root = tmp_path_factory.mktemp("profiled")
    cfg = TrainConfig(model="gpt2-tiny", seq_len=SEQ, micro_batch_size=4, grad_accum=2,
                      max_steps=8, warmup_steps=1, checkpoint_every=8, log_every=100,
                      num_workers=2, storage_path=str(root), run_name="p", job="test",
                      profile_steps="2-3")  # fmt: skip
    mp.spawn(_ddp_rank, args=(2, str(root / "init"), cfg, data, spec), nprocs=2)
    return cfg


def test_each_rank_traces_the_named_ranges_of_the_profiled_steps(profiled_run):
    for rank in (0, 1):
        counts = assert_trace_has_step_ranges(
            os.path.join(profiled_run.run_dir, "profile", f"rank{rank}.json"), range(2, 4)
        )
        # 2 steps x 2 micro-batches; one gradient all-reduce per step (no_sync on the first
        # micro-batch of each window), one optimizer step per step.
        assert counts["forward"] == counts["backward"] == counts["data_loading"] == 4
        assert counts["gradient_sync"] == 2 and counts["optimizer_step"] == 2
        assert counts["gloo:all_reduce"] >= 2  # the collective itself, by the backend


def test_rank0_writes_tensorboard_scalars_for_every_step(profiled_run):
    scalars = tensorboard_scalars(os.path.join(profiled_run.run_dir, "tensorboard"))
    rows = read_metrics(os.path.join(profiled_run.run_dir, "metrics.jsonl"))
    assert sorted(scalars["train/loss"]) == list(range(1, 9))
    for row in rows:  # the same numbers as metrics.jsonl (TensorBoard stores float32)
        assert scalars["train/loss"][row["step"]] == pytest.approx(row["loss"], rel=1e-6)
        assert scalars["time/data_wait_s"][row["step"]] == pytest.approx(
            row["data_wait_s"], rel=1e-5, abs=1e-9
        )
    expected_tags = {
        "train/lr", "throughput/tokens_per_s", "time/step_time_s", "time/data_wait_fraction",
        "memory/peak_rss_bytes", "memory/params_bytes",
    }  # fmt: skip
    assert expected_tags <= set(scalars), sorted(scalars)
    assert 0 <= min(scalars["time/data_wait_fraction"].values()) <= 1


def test_rank0_draws_the_loss_curve(profiled_run):
    height, width, _ = png_shape(os.path.join(profiled_run.run_dir, "loss_curve.png"))
    assert width > 0 and height > 0


# --- collective timeout -------------------------------------------------------------------


def _timeout_rank(rank, port, flag, result_file):
    from shared.runtime.torchrun import init_distributed

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")  # fmt: skip
    init_distributed(collective_timeout_s=2)
    if rank == 1:  # the "hung" peer: never joins the all-reduce
        while not os.path.exists(flag):
            time.sleep(0.1)
        os._exit(0)
    start = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1))
        outcome = "completed"
    except RuntimeError as err:
        outcome = f"{time.monotonic() - start:.1f}s {err}"
    finally:
        open(flag, "w").close()
    with open(result_file, "w") as f:
        f.write(outcome)
    # A timed-out gloo group cannot be torn down cleanly: its destructor may find a joinable
    # worker thread and abort() (SIGABRT under load). A real run exits after such an error too.
    os._exit(0)


def test_a_hung_collective_fails_after_the_timeout(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = tmp_path / "result.txt"
    mp.spawn(_timeout_rank, args=(port, str(tmp_path / "flag"), str(result)), nprocs=2)
    seconds, message = result.read_text().split("s ", 1)
    assert "Timed out" in message or "timeout" in message.lower(), message
    assert 1.5 <= float(seconds) < 30, seconds


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
