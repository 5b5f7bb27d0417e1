"""The training loop every job shares. Pure torch: it runs under Ray Train or plain torchrun.

What varies is passed in:
  * a ``Strategy`` (shared/parallel): forward/backward, optimizer step, checkpoint format;
  * a ``Session`` (Ray Train or torchrun): this rank's batches, the checkpoint to resume
    from, and where metrics and checkpoints are reported.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Protocol

import torch
import torch.distributed as dist

from shared import checkpoint
from shared.checkpoint import TrainState
from shared.metrics import StepMetrics, device_peak_tflops, peak_memory_bytes, rank0_metrics_path
from shared.models import count_params, flops_per_token, model_dims, unwrap
from shared.parallel.base import Strategy
from shared.precision import DTYPE_NAMES


class Session(Protocol):
    rank: int
    world_size: int
    device: torch.device

    def latest_checkpoint(self) -> contextlib.AbstractContextManager[str | None]: ...

    # Sequences all ranks together consume per micro-step (the data position's unit).
    samples_per_micro_batch: int

    def epoch_batches(self, epoch: int, start_sample: int) -> Iterable[torch.Tensor]:
        """This rank's micro-batches of ``epoch``, resuming after ``start_sample`` sequences
        the run already trained on."""
        ...

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None: ...


def global_mean(value: torch.Tensor) -> float:
    """Average a scalar over all ranks, so the logged loss is the whole batch's loss."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return float(value)


def restore(strategy: Strategy, session: Session) -> tuple[TrainState, int | None]:
    """Load the latest checkpoint if the session has one; return (state, step resumed from)."""
    with session.latest_checkpoint() as directory:
        if directory is None:
            return TrainState(world_size=session.world_size), None
        strategy.load(directory)
        state = checkpoint.load_train_state(directory, session.rank)
    if session.rank == 0:
        print(
            f"resumed from checkpoint at step {state.step} (epoch {state.epoch}, "
            f"{state.samples_in_epoch} samples into it)",
            flush=True,
        )
    return state, state.step


def save_and_report(
    cfg, strategy: Strategy, session: Session, state: TrainState, metrics: dict
) -> None:
    """Every rank writes its part of the checkpoint, then all report it together."""
    state.world_size = session.world_size
    state.global_batch_size = cfg.global_batch_size

    def write(directory: str) -> None:
        strategy.save(directory, session.rank)
        checkpoint.save_train_state(directory, state, session.rank)

    root = checkpoint.staging_root(cfg.run_name, session.rank)
    directory = checkpoint.stage_checkpoint(root, f"step_{state.step:06d}", write)
    session.report({**metrics, "checkpoint_step": state.step}, checkpoint_dir=directory)
    if session.rank == 0:
        print(f"checkpoint saved at step {state.step}", flush=True)


def _print_header(
    cfg, strategy: Strategy, session: Session, n_params: int, peak_source: str
) -> None:
    print(
        f"training {cfg.model} ({n_params / 1e6:.2f}M params) with {strategy.name} on "
        f"{session.world_size} x {session.device.type} in {DTYPE_NAMES[strategy.dtype]} | "
        f"global batch {cfg.global_batch_size} x {cfg.seq_len} tokens "
        f"({cfg.micro_batch_size} per data-parallel rank x {cfg.grad_accum} accumulation) | "
        f"{cfg.max_steps} steps | MFU peak: {peak_source} | run dir {cfg.run_dir}",
        flush=True,
    )


def _tracker(cfg, strategy: Strategy, session: Session) -> StepMetrics:
    model = unwrap(strategy.model)
    n_params = count_params(model)
    layers, hidden = model_dims(model)
    peak_tflops, peak_source = device_peak_tflops(session.device, cfg.peak_tflops)
    if session.rank == 0:
        _print_header(cfg, strategy, session, n_params, peak_source)
    return StepMetrics(
        cfg,
        flops_per_token(n_params, layers, hidden, cfg.seq_len),
        peak_tflops,
        session.world_size,
        rank0_metrics_path(cfg.run_dir, session.rank),
    )


def _after_step(cfg, strategy, session, state: TrainState, tracker: StepMetrics, row: dict,
                resumed_from: int | None) -> None:  # fmt: skip
    """Progress line, then either a checkpoint (every N steps and at the end) or a report."""
    last = state.step == cfg.last_step
    if session.rank == 0 and (state.step % cfg.log_every == 0 or state.step == 1 or last):
        print(tracker.progress_line(row), flush=True)
    if last or state.step % cfg.checkpoint_every == 0:
        metrics = dict(row)
        if last:  # the driver reads the run's summary from the last checkpoint's metrics
            metrics |= run_summary(tracker, strategy, session, state, resumed_from)
        save_and_report(cfg, strategy, session, state, metrics)
    elif state.step % cfg.log_every == 0:
        session.report(row)


def train(cfg, strategy: Strategy, session: Session) -> dict:
    """Train to ``cfg.max_steps`` optimizer steps (or ``stop_at_step``); return this rank's
    summary metrics."""
    state, resumed_from = restore(strategy, session)
    tracker = _tracker(cfg, strategy, session)
    strategy.model.train()
    micro, loss_sum, data_wait = 0, torch.zeros((), device=session.device), 0.0
    step_start = time.perf_counter()
    while state.step < cfg.last_step:
        batches = iter(session.epoch_batches(state.epoch, state.samples_in_epoch))
        seen_in_epoch = state.samples_in_epoch
        while state.step < cfg.last_step:
            wait_start = time.perf_counter()
            input_ids = next(batches, None)
            data_wait += time.perf_counter() - wait_start
            if input_ids is None:
                break
            seen_in_epoch += 1
            state.samples_in_epoch += session.samples_per_micro_batch
            micro += 1
            # Gradients are synchronised only on the last micro-batch of the window.
            loss_sum += strategy.forward_backward(input_ids, sync=micro == cfg.grad_accum)
            if micro < cfg.grad_accum:
                continue

            grad_norm = strategy.optimizer_step()
            state.step += 1
            state.tokens_seen += cfg.tokens_per_step
            row = tracker.record(
                step=state.step,
                epoch=state.epoch,
                loss=global_mean(loss_sum / cfg.grad_accum),
                lr=strategy.current_lr(),
                grad_norm=grad_norm,
                step_time=time.perf_counter() - step_start,
                data_wait=data_wait,
            )
            _after_step(cfg, strategy, session, state, tracker, row, resumed_from)
            micro, loss_sum, data_wait = 0, torch.zeros((), device=session.device), 0.0
            step_start = time.perf_counter()
        if seen_in_epoch == 0:
            raise RuntimeError(
                f"epoch {state.epoch} gave rank {session.rank} no batches: the dataset has fewer "
                f"than {cfg.micro_batch_size} sequences of {cfg.seq_len} tokens per worker."
            )
        if state.step < cfg.last_step:
            state.samples_per_epoch[str(state.epoch)] = state.samples_in_epoch
            state.epoch += 1
            state.samples_in_epoch = 0
    if session.rank == 0:
        if not tracker.history:
            print(f"nothing to train: the run is already at step {state.step}", flush=True)
        elif cfg.stop_at_step and state.step == cfg.stop_at_step:
            print(f"stopped at step {state.step} of {cfg.max_steps} (stop_at_step); run again "
                  f"with run_name={cfg.run_name} to continue", flush=True)  # fmt: skip
    return run_summary(tracker, strategy, session, state, resumed_from)


def run_summary(
    tracker: StepMetrics,
    strategy: Strategy,
    session: Session,
    state: TrainState,
    resumed_from: int | None,
) -> dict:
    return {
        **tracker.summary(),
        "resumed_from_step": resumed_from,
        "samples_seen": state.samples_seen(),
        "world_size": session.world_size,
        "dtype": DTYPE_NAMES[strategy.dtype],
        "model_state_bytes_per_rank": strategy.measured_state_bytes,
        **peak_memory_bytes(session.device),
    }
