"""The shared loop's observability on 2 gloo ranks (torchrun-style, no Ray): each rank's
traces of the profiled steps, rank 0's TensorBoard scalars and loss curve, and a hung
collective that fails after its timeout."""

from __future__ import annotations

import os
import socket
import time

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_corpus_blocks
from observability_checks import assert_trace_has_step_ranges, png_shape, tensorboard_scalars

from shared.config import TrainConfig
from shared.observability.metrics import read_metrics
from shared.observability.plots import save_run_plots

SEQ = 32


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


def pixels_in_color(image: np.ndarray, color: str) -> tuple[set[int], set[int]]:
    """(rows, columns) of the pixels of an RGB(A) image that have one of the lines' colors."""
    distance = np.abs(image[..., :3] - np.array(matplotlib.colors.to_rgb(color))).max(axis=2)
    rows, columns = np.nonzero(distance < 0.06)  # the line's core, not its anti-aliased edge
    return set(rows.tolist()), set(columns.tolist())


def test_rank0_draws_the_loss_curve(profiled_run, tmp_path):
    run_dir = profiled_run.run_dir
    path = os.path.join(run_dir, "loss_curve.png")
    assert png_shape(path)[:2] == (660, 880)  # 8 x 6 inches at 110 dpi, as a run promises
    image = matplotlib.image.imread(path)
    # Drawn from the run's metrics.jsonl, titled "<job> <run_name>": the same pixels again.
    redrawn = save_run_plots(read_metrics(os.path.join(run_dir, "metrics.jsonl")),
                             str(tmp_path / "redrawn.png"), title="test p")  # fmt: skip
    differing = int((image != matplotlib.image.imread(redrawn)).any(axis=2).sum())
    assert differing == 0, f"{differing} pixels differ from the rows drawn again"
    # The curves themselves, across the steps: loss (blue) in the top half, tokens/s (green)
    # in the bottom half, each spanning most of the width (an empty plot has neither color).
    for color, half in (("tab:blue", range(0, 330)), ("tab:green", range(330, 660))):
        rows, columns = pixels_in_color(image, color)
        assert rows and rows <= set(half), (color, min(rows, default=None), max(rows, default=None))
        assert len(columns) > 0.6 * 880, (color, len(columns))


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
