"""The training loop every job shares. Pure torch: it runs under Ray Train or plain torchrun.

What varies is passed in:
  * a ``Strategy`` (shared/parallel): forward/backward, optimizer step, checkpoint format;
  * a ``Session`` (Ray Train or torchrun): this rank's batches, the checkpoint to resume
    from, and where metrics and checkpoints are reported.

What a user sees comes from here too (docs/observability.md): the progress line, and on rank 0
metrics.jsonl, TensorBoard events and the loss-curve PNG; on every rank the named trace ranges
and, for ``profile_steps=a-b``, a profiler trace.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from typing import Protocol

import torch
import torch.distributed as dist

from shared import checkpoint, evaluation, generation, optim, storage
from shared.checkpoint import TrainState, init_from, resume
from shared.divergence import any_rank, nonfinite_reason
from shared.models.structure import count_params, flops_per_token, model_dims, unwrap
from shared.observability.metrics import (
    DIVERGENCE_FILE,
    StepMetrics,
    device_peak_tflops,
    diverged_sentence,
    peak_memory_bytes,
    rank0_metrics_path,
    strict_json,
)
from shared.observability.profiling import DATA_LOADING, HOST_TO_DEVICE, StepProfiler, trace_range
from shared.observability.run_outputs import RankZeroOutputs
from shared.parallel.base import Strategy
from shared.precision import DTYPE_NAMES
from shared.runtime import preemption


class Session(Protocol):
    rank: int
    world_size: int
    device: torch.device

    def latest_checkpoint(self) -> contextlib.AbstractContextManager[str | None]: ...

    # Sequences all ranks together consume per micro-step (the data position's unit).
    samples_per_micro_batch: int

    def epoch_batches(
        self, epoch: int, start_sample: int, end_sample: int | None = None
    ) -> Iterable[torch.Tensor]:
        """This rank's micro-batches of ``epoch``, resuming after ``start_sample`` sequences
        the run already trained on, up to ``end_sample`` (the run's last step) or the epoch's
        end: nothing past the last step is read."""
        ...

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None: ...

    # Optional: ``data_stats() -> str | None``, the input pipeline's execution statistics,
    # printed by rank 0 at the end (RaySession: Ray Data's stats for the training dataset).


def global_mean(value: torch.Tensor) -> float:
    """Average a scalar over all ranks, so the logged loss is the whole batch's loss."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return float(value)


def restore(cfg, strategy: Strategy, session: Session) -> tuple[TrainState, int | None]:
    """Load the latest checkpoint if the session has one; return (state, step resumed from)."""
    with session.latest_checkpoint() as directory:
        if directory is None:  # a fresh run: step 0, or where init_from's source left off
            return init_from.start_state(cfg, strategy, session), None
        strategy.load(directory)
        state = checkpoint.load_train_state(directory, session.rank)
    # The checkpoint's scheduler aims at the max_steps it was trained with; a longer (or
    # shorter) run continues its decay from here instead of jumping (shared/optim.py).
    horizon_changed = optim.continue_schedule(strategy.scheduler, state.step, cfg.max_steps)
    if session.rank == 0:
        print(
            f"resumed from checkpoint at step {state.step} (epoch {state.epoch}, "
            f"{state.samples_in_epoch} samples into it)",
            flush=True,
        )
        if horizon_changed:
            print(f"learning rate continues from {strategy.current_lr():.2e} at step "
                  f"{state.step}, decaying to lr x min_lr_ratio at the new max_steps="
                  f"{cfg.max_steps}", flush=True)  # fmt: skip
    return state, state.step


def save_and_report(
    cfg, strategy: Strategy, session: Session, state: TrainState, metrics: dict
) -> None:
    """Every rank writes its part of the checkpoint, then all report it together."""
    state.world_size = session.world_size
    state.global_batch_size = cfg.global_batch_size
    if hasattr(session, "data_position"):  # which samples of the epoch are trained on
        state.data_position = session.data_position(state.epoch, state.samples_in_epoch)

    def write(directory: str) -> None:
        strategy.save(directory, session.rank)
        checkpoint.save_train_state(directory, state, session.rank)
        checkpoint.write_manifest(directory, session.rank, session.world_size, state.step)

    plan = resume.plan_for(session)  # staging keyed by run, attempt and rank; never reused
    root = checkpoint.staging_root(cfg.run_dir, plan.attempt, session.rank)
    with checkpoint.staged_checkpoint(root, plan.checkpoint_name(state.step), write) as directory:
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
    """Progress line, then either a checkpoint (every N steps and at the end) or a report.

    The metrics-only report costs up to Ray Train's 2 s controller poll (a one-slot result
    queue), but it is also what makes the previous checkpoint registered before training goes
    on: without it, a worker lost a few steps after a checkpoint took the unconsumed
    checkpoint report with it and the restart began from scratch."""
    last = state.step == cfg.last_step
    if session.rank == 0 and (state.step % cfg.log_every == 0 or state.step == 1 or last):
        print(tracker.progress_line(row), flush=True)
    if checkpoint_due(cfg, state.step):
        tracker.flush()
        metrics = dict(row)
        if last:  # the driver reads the run's summary from the last checkpoint's metrics
            metrics |= run_summary(tracker, strategy, session, state, resumed_from)
        save_and_report(cfg, strategy, session, state, metrics)
    elif state.step % cfg.log_every == 0:
        session.report(row)


def checkpoint_due(cfg, step: int) -> bool:
    return step == cfg.last_step or step % cfg.checkpoint_every == 0


def stop_diverged(cfg, strategy, session, state: TrainState, tracker: StepMetrics, row: dict,
                  reason: str, resumed_from: int | None,
                  last_saved: int | None) -> dict:  # fmt: skip
    """No checkpoint for this step (the weights are not trustworthy): say so, record it for
    the driver and return the summary with ``status: diverged``."""
    summary = {
        **run_summary(tracker, strategy, session, state, resumed_from),
        "status": "diverged",
        "diverged_at_step": state.step,
        "divergence": reason or "non-finite values on another rank",
        "last_good_checkpoint_step": last_saved,
    }
    if session.rank == 0:
        print(tracker.progress_line(row), flush=True)
        if not getattr(session, "uses_ray", False):  # under Ray the driver's error line says it
            good = f"step {last_saved}" if last_saved else "none"
            print(f"{diverged_sentence(state.step, summary['divergence'])}; last good "
                  f"checkpoint: {good}", flush=True)  # fmt: skip
        tracker.flush()
        record = {"driver_start_time": cfg.driver_start_time, **summary}
        storage.write_text(storage.join(cfg.run_dir, DIVERGENCE_FILE), strict_json(record))
    return summary


def _save_for_preemption(cfg, strategy, session, state, tracker, row, resumed_from) -> None:
    """A SIGTERM to any worker or to the driver: this step's checkpoint, then the run stops."""
    metrics = {**row, **run_summary(tracker, strategy, session, state, resumed_from),
               "preempted_at_step": state.step}  # fmt: skip
    save_and_report(cfg, strategy, session, state, metrics)


def _save_for_node_drain(cfg, strategy, session, state, row) -> None:
    """A node drain notice from Ray: a just-in-time checkpoint, and keep training (Ray Train
    restarts the group from it when the node goes)."""
    if session.rank == 0:
        print(f"node drain (preemption) notice: checkpoint at step {state.step}", flush=True)
    save_and_report(cfg, strategy, session, state, row)


def train(cfg, strategy: Strategy, session: Session) -> dict:
    """Train to ``cfg.max_steps`` optimizer steps (or ``stop_at_step``); return this rank's
    summary metrics (``status`` is ``diverged`` if a non-finite value stopped the run)."""
    state, resumed_from = restore(cfg, strategy, session)
    tracker = _tracker(cfg, strategy, session)
    # Start-up marks so far (observability/startup.py): the driver's, this worker's start, now.
    tracker.startup_marks = {**cfg.startup_marks, "launch": cfg.driver_start_time,
                             "model_ready": time.time()}  # fmt: skip
    if getattr(session, "started_at", None):
        tracker.startup_marks["worker_start"] = session.started_at
    outputs = RankZeroOutputs(cfg, strategy, session)
    profiler = StepProfiler.for_run(cfg, session.rank, session.device)
    strategy.model.train()
    micro, loss_sum, data_wait = 0, torch.zeros((), device=session.device), 0.0
    last_saved = resumed_from
    step_start = time.perf_counter()
    stop = preemption.StopCheck(cfg, session.rank, cfg.log_every,
                                use_ray=getattr(session, "uses_ray", False),
                                device=session.device)  # fmt: skip
    preempted = False
    evaluator = evaluation.Evaluator.for_run(cfg, session)  # None with eval_every=0
    preemption.training(True)
    while state.step < cfg.last_step and not preempted:
        # Read no further than this launch's last step: a run that stops mid-epoch (max_steps,
        # stop_at_step) reads each row it trains on once and nothing else.
        steps_left = cfg.last_step - state.step
        end_sample = state.samples_in_epoch + steps_left * cfg.global_batch_size
        batches = iter(session.epoch_batches(state.epoch, state.samples_in_epoch, end_sample))
        seen_in_epoch = state.samples_in_epoch
        while state.step < cfg.last_step:
            if micro == 0:
                profiler.step_starting(state.step + 1)
            wait_start = time.perf_counter()
            with trace_range(DATA_LOADING):
                input_ids = next(batches, None)
            data_wait += time.perf_counter() - wait_start
            if input_ids is None:
                break
            tracker.startup_marks.setdefault("first_batch", time.time())
            # Sessions yield host tensors; the copy is its own trace range (a no-op on CPU).
            with trace_range(HOST_TO_DEVICE):
                input_ids = input_ids.to(session.device, non_blocking=True)
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
            step_time = time.perf_counter() - step_start  # evaluation is not part of the step
            held_out = evaluation.run_if_due(evaluator, cfg, strategy, state.step)
            row = tracker.record(
                step=state.step,
                epoch=state.epoch,
                loss=global_mean(loss_sum / cfg.grad_accum),
                lr=strategy.current_lr(),
                grad_norm=grad_norm,
                step_time=step_time,
                data_wait=data_wait,
                **held_out,
            )
            if state.initial_loss is None:
                state.initial_loss = row["loss"]
            profiler.step_finished(state.step)
            outputs.step(row)
            # Which checkpoint this step writes, if any: a regular one, one for a stop
            # (SIGTERM to a worker or the driver) or a just-in-time one for a node drain.
            due = checkpoint_due(cfg, state.step)
            preempted = state.step != cfg.last_step and stop.stop()
            drain_save = not preempted and stop.node_draining(state.step) and not due
            saving = due or preempted or drain_save
            reason = nonfinite_reason(strategy, row, saving)
            # Loss and gradient norm are global, so every rank reaches the same verdict on
            # them; only the weights check (saving steps, each rank its own shard) needs a
            # vote, which keeps a collective out of every other step.
            diverged = bool(reason)
            if saving:
                diverged = any_rank(diverged, session.device)
            if diverged:
                preemption.training(False)
                profiler.close()
                summary = stop_diverged(cfg, strategy, session, state, tracker, row, reason,
                                        resumed_from, last_saved)  # fmt: skip
                outputs.finish(tracker)
                return summary
            if preempted:
                _save_for_preemption(cfg, strategy, session, state, tracker, row, resumed_from)
                break
            _after_step(cfg, strategy, session, state, tracker, row, resumed_from)
            if drain_save:
                _save_for_node_drain(cfg, strategy, session, state, row)
            if due or drain_save:
                last_saved = state.step
            micro, loss_sum, data_wait = 0, torch.zeros((), device=session.device), 0.0
            step_start = time.perf_counter()
        if seen_in_epoch == 0:
            raise RuntimeError(
                f"epoch {state.epoch} gave rank {session.rank} no batches: the dataset has fewer "
                f"than {cfg.micro_batch_size} sequences of {cfg.seq_len} tokens per worker."
            )
        if state.step < cfg.last_step and not preempted:
            state.samples_per_epoch[str(state.epoch)] = state.samples_in_epoch
            state.epoch += 1
            state.samples_in_epoch = 0
    preemption.training(False)
    profiler.close()
    tracker.flush()
    if session.rank == 0:
        if not tracker.history:
            print(f"nothing to train: the run is already at step {state.step}", flush=True)
        elif preempted:
            print(f"preempted: stopped at step {state.step} with its checkpoint; run again with "
                  f"run_name={cfg.run_name} to continue from it", flush=True)  # fmt: skip
        elif cfg.stop_at_step and state.step == cfg.stop_at_step:
            print(f"stopped at step {state.step} of {cfg.max_steps} (stop_at_step); run again "
                  f"with run_name={cfg.run_name} to continue", flush=True)  # fmt: skip
    if state.step == cfg.max_steps and tracker.history:  # the run finished training
        generation.write_samples(cfg, strategy, session)
    outputs.finish(tracker)
    summary = {
        **run_summary(tracker, strategy, session, state, resumed_from),
        "status": "succeeded",
    }
    return {**summary, "preempted_at_step": state.step} if preempted else summary


def run_summary(
    tracker: StepMetrics,
    strategy: Strategy,
    session: Session,
    state: TrainState,
    resumed_from: int | None,
) -> dict:
    return {
        **tracker.summary(),
        # The run's first step ever (kept in the checkpoint), not this attempt's first loss.
        "initial_loss": state.initial_loss,
        "resumed_from_step": resumed_from,
        "samples_per_epoch": state.samples_seen(),
        "world_size": session.world_size,
        "dtype": DTYPE_NAMES[strategy.dtype],
        "model_state_bytes_per_rank": strategy.measured_state_bytes,
        **peak_memory_bytes(session.device),
        # Rows read / rows trained, all ranks (a collective: every rank gets here together).
        **(session.data_summary() if hasattr(session, "data_summary") else {}),
    }
