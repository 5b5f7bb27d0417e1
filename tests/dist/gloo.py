"""Real gloo process groups without Ray, started once and reused (the dist tier's harness).

A ``GlooGroup(world)`` is ``world`` spawned processes joined in one gloo process group; each
``run(fn, *args)`` calls ``fn(*args)`` on every rank and returns the ranks' results. Starting a
rank costs its imports (torch, transformers, DeepSpeed: ~5 CPU-seconds); a Ray worker group
costs ~40. The questions asked here are about torch and DeepSpeed numerics, so they need the
process group, not Ray.

``train_job`` runs one job's worker lines (model -> the strategy's own wrapping -> the shared
loop) on a :class:`~shared.runtime.torchrun.TorchrunSession` that reads the packed blocks in
memory through the same data layer, and logs the sample ids it trains on in the format
``log_samples=true`` writes, so tests/sample_log.py reads both.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared import storage
from shared.runtime.torchrun import TorchrunSession, rank_batches


class GlooGroup:
    """``world`` ranks in one gloo group; a rank that fails or hangs closes the group."""

    def __init__(self, world: int, directory: str):
        self.world = world
        context = mp.get_context("spawn")
        self._pipes, self._procs = [], []
        init_file = os.path.join(directory, f"gloo-init-{world}-{time.time_ns()}")
        for rank in range(world):
            parent, child = context.Pipe()
            proc = context.Process(target=_serve, args=(rank, world, init_file, child),
                                   daemon=True)  # fmt: skip
            proc.start()
            self._pipes.append(parent)
            self._procs.append(proc)

    def run(self, fn, *args, timeout_s: float = 600) -> list:
        """``fn(*args)`` on every rank, results in rank order. Each rank's stdout is kept in
        ``self.output[rank]``. A failure on any rank raises here with its traceback."""
        if not self._procs:
            raise RuntimeError("this GlooGroup was closed after an earlier failure")
        for pipe in self._pipes:
            pipe.send((fn, args))
        results, errors, self.output = [], [], []
        deadline = time.monotonic() + timeout_s
        for rank, pipe in enumerate(self._pipes):
            if not pipe.poll(max(0.0, deadline - time.monotonic())):
                errors.append(f"rank {rank}: no answer within {timeout_s:.0f} s")
                break
            status, value, output = pipe.recv()
            self.output.append(output)
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
                break  # its peers may wait in a collective forever
            results.append(value)
        if errors:
            self.close()
            raise RuntimeError("\n".join(errors))
        return results

    def close(self) -> None:
        for pipe, proc in zip(self._pipes, self._procs, strict=True):
            with contextlib.suppress(OSError):
                pipe.send(None)
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._pipes, self._procs = [], []


def _serve(rank: int, world: int, init_file: str, pipe) -> None:
    # What torchrun (or Ray Train) sets and DeepSpeed reads; one node, so local rank = rank.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")  # fmt: skip
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)  # fmt: skip
    while (call := pipe.recv()) is not None:
        fn, args = call
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                value = fn(*args)
            pipe.send(("ok", value, out.getvalue()))
        except BaseException:  # noqa: BLE001 - the test process reports it
            pipe.send(("error", traceback.format_exc(), out.getvalue()))
            break
    dist.destroy_process_group()


# --- a job's worker on a gloo rank --------------------------------------------------------


class LoggingSession(TorchrunSession):
    """A TorchrunSession that logs each micro-batch's sample ids as ``log_samples`` does."""

    def __init__(self, cfg, *args, **kwargs):
        super().__init__(*args, **kwargs)
        stamp = [time.time_ns()]  # rank 0's: one attempt id for the whole group
        dist.broadcast_object_list(stamp, src=0)
        self.attempt = stamp[0]
        self.log = storage.join(cfg.run_dir, "samples", f"{self.attempt}-rank{self.rank}.jsonl")

    def epoch_batches(self, epoch, start_sample, end_sample=None):
        for position, ids, batch in self.reader.micro_batches(epoch, start_sample, end_sample):
            record = {"attempt": self.attempt, "epoch": epoch, "position": position,
                      "ids": ids.tolist()}  # fmt: skip
            os.makedirs(os.path.dirname(self.log), exist_ok=True)
            with open(self.log, "a") as f:
                f.write(json.dumps(record) + "\n")
            yield batch


@dataclass
class Corpus:
    blocks: torch.Tensor  # [N, seq_len] packed token ids, sample_id = row
    spec: dict  # the tokenizer's vocab_size and eos_token_id


def train_job(job: str, cfg, corpus: Corpus) -> dict:
    """One attempt of ``job`` on this rank, as its ``train_loop_per_worker`` builds it; returns
    the loop's summary plus ``run_dir`` and the newest ``checkpoint``."""
    from shared.checkpoint import init_from
    from shared.loop import train
    from shared.runtime.worker import seed_everything

    cpu, rank, world = torch.device("cpu"), dist.get_rank(), dist.get_world_size()
    # tp2d: each rank reads 1/tp of its dp rank's micro-batch; TP peers all-gather it.
    per_rank = cfg.micro_batch_size // cfg.tp if job == "tp2d" else cfg.micro_batch_size
    reader = rank_batches(corpus.blocks, per_rank, rank, world, cfg.seed,
                          global_batch=cfg.global_batch_size)  # fmt: skip
    session = LoggingSession(cfg, reader, cfg.run_dir, per_rank, rank, world, cpu)
    seed_everything(cfg.seed)
    if job == "tp2d":
        from shared.models.llama import build_llama
        from shared.parallel.fsdp import apply_fsdp
        from shared.parallel.tp import TP2DStrategy, TPGroupSession, apply_tp, device_mesh_2d

        mesh = device_mesh_2d(cpu, cfg.dp, cfg.tp)
        model = build_llama(cfg.model, corpus.spec["vocab_size"])
        model = apply_fsdp(apply_tp(model, mesh["tp"]), mesh["dp"])
        strategy = TP2DStrategy(model, cfg, cpu, torch.float32)
        session = TPGroupSession(session, mesh["tp"])
    else:
        from shared.models.gpt2 import build_gpt2

        model = build_gpt2(cfg.model, corpus.spec["vocab_size"], cfg.seq_len,
                           eos_token_id=corpus.spec["eos_token_id"])  # fmt: skip
        init_from.load_weights(cfg, session, model)  # a fresh run with init_from: its weights
        strategy = gpt2_strategy(job, model, cfg, cpu)
    summary = train(cfg, strategy, session)
    found = sorted(n for n in os.listdir(cfg.run_dir) if n.startswith("step_"))
    last = os.path.join(cfg.run_dir, found[-1]) if found else None
    steps = None  # what the driver's SUMMARY says: the step of the last checkpoint
    if last is not None:
        with open(os.path.join(last, "train_state.json")) as f:
            steps = json.load(f)["step"]
    return {**summary, "run_dir": cfg.run_dir, "checkpoint": last, "steps": steps}


def gpt2_strategy(job: str, model, cfg, device):
    """The strategy lines of jobs/ddp, jobs/fsdp and jobs/zero (fp32 on CPU)."""
    if job in ("ddp", "fault_tolerance"):
        from shared.parallel.ddp import DDPStrategy, apply_ddp

        return DDPStrategy(apply_ddp(model, device), cfg, device, torch.float32)
    if job == "fsdp":
        from shared.parallel.fsdp import FSDPStrategy, apply_fsdp, data_parallel_mesh

        return FSDPStrategy(apply_fsdp(model, data_parallel_mesh(device)), cfg, device,
                            torch.float32)  # fmt: skip
    from shared.parallel.zero import ZeroStrategy

    return ZeroStrategy(model, cfg, device, torch.float32)
