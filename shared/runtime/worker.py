"""The worker side of a Ray Train job: each rank's session (data, checkpoints, reports) and the
first lines every GPT-2 ``train_loop_per_worker`` shares. The driver side is
shared/runtime/driver.py."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import random
import time
from collections.abc import Iterator

import numpy as np
import torch

from shared import storage
from shared.checkpoint import init_from, resume
from shared.data import EpochReader, PackedDataset, ray_rows
from shared.data.session import data_position_record, data_read_summary
from shared.observability.stack import register_process


def seed_everything(seed: int) -> None:
    """Same seed on every rank: identical initial weights without a broadcast."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def quiet_train_worker_logs() -> None:
    """Ray Train logs every report's full metrics dict and every checkpoint path at INFO (to
    the modules' loggers); the jobs print their own progress and checkpoint lines."""
    from ray.train.v2._internal.execution import context, storage

    logging.getLogger(context.__file__).setLevel(logging.WARNING)
    logging.getLogger(storage.__name__).setLevel(logging.WARNING)


class RaySession:
    """What the shared loop needs from Ray Train, inside a training worker.

    Data: this rank's slice of each global batch of the epoch's order (shared/data/order.py),
    read through Ray Data from the packed dataset (shared/data/reader.py), starting after the
    checkpoint's position. The order does not depend on the world size, so a run resumed on
    any number of workers trains on exactly the samples not yet trained on.
    """

    uses_ray = True  # the preemption check may ask Ray Train (shared/runtime/preemption.py)

    def __init__(self, cfg, packed: PackedDataset, batch_size: int | None = None):
        import ray.train
        import ray.train.torch

        self.started_at = time.time()  # this worker's start-up mark (observability/startup.py)
        quiet_train_worker_logs()
        context = ray.train.get_context()
        self.cfg = cfg
        self.packed = packed
        self.rank = context.get_world_rank()
        self.world_size = context.get_world_size()
        self.device = ray.train.torch.get_device()
        self.batch_size = batch_size or cfg.micro_batch_size  # sequences read per batch
        self.samples_per_micro_batch = self.batch_size * self.world_size
        register_process(cfg.run_dir, f"rank{self.rank}")  # for `make stack`
        self._resume_plan: resume.ResumePlan | None = None
        self._reader: EpochReader | None = None
        self._stats: list[str] = []
        self.attempt = _attempt_id(self.rank)  # same id on every rank of this worker group
        self.sample_log = None
        if getattr(cfg, "log_samples", False):  # flushed at every report, with the checkpoint
            self.sample_log = storage.AppendLog(
                storage.join(cfg.run_dir, "samples", f"{self.attempt}-rank{self.rank}.jsonl"),
                flush_every_s=float("inf"),
            )

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[str | None]:
        """The newest registered checkpoint that verifies (checkpoint/resume.py), as a local dir."""
        with resume.open_checkpoint(self.resume_plan().checkpoint) as directory:
            yield directory

    def resume_plan(self) -> resume.ResumePlan:
        """Decided once per worker-group start, by rank 0, for every rank (a collective)."""
        if self._resume_plan is None:
            import ray.train

            latest = ray.train.get_checkpoint()
            name = posixpath.basename(latest.path.rstrip("/")) if latest is not None else None
            self._resume_plan = resume.plan_resume(self.cfg.run_dir, name, self.rank)
        return self._resume_plan

    def use_batch_size(self, batch_size: int) -> None:
        """Read ``batch_size`` sequences per micro-batch (elastic: chosen per world size)."""
        self.batch_size = batch_size
        self.samples_per_micro_batch = batch_size * self.world_size
        if self._reader is not None:
            self._reader.close()  # its early read is for the old batch size
        self._reader = None

    @property
    def reader(self) -> EpochReader:
        if self._reader is None:
            self._reader = EpochReader(
                ray_rows(self.packed, self._stats), self.packed.num_samples,
                self.packed.chunk_rows, self.cfg.seed, reader=self.rank,
                readers=self.world_size, batch=self.batch_size,
                global_batch=self.cfg.global_batch_size,
            )  # fmt: skip
        return self._reader

    def data_stats(self) -> str | None:
        """Ray Data's execution stats of this rank's last epoch read."""
        return self._stats[0] if self._stats else None

    def epoch_batches(
        self, epoch: int, start_sample: int, end_sample: int | None = None
    ) -> Iterator[torch.Tensor]:
        for position, ids, batch in self.reader.micro_batches(epoch, start_sample, end_sample):
            if self.sample_log:
                self.sample_log.append(json.dumps({"attempt": self.attempt, "epoch": epoch,
                                                   "position": position,
                                                   "ids": ids.tolist()}) + "\n")  # fmt: skip
            yield batch

    def data_position(self, epoch: int, samples_in_epoch: int) -> dict:
        """The checkpoint's record of the epoch's consumed samples (shared/data/position.py)."""
        return data_position_record(self.reader, self.packed, epoch, samples_in_epoch)

    def data_summary(self) -> dict:
        return data_read_summary(self.reader, self.device)

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None:
        import ray.train

        if self.sample_log:
            self.sample_log.flush()
        if checkpoint_dir is None:
            ray.train.report(metrics)
            return
        ray.train.report(
            metrics,
            checkpoint=ray.train.Checkpoint.from_directory(checkpoint_dir),
            checkpoint_dir_name=os.path.basename(checkpoint_dir),
            delete_local_checkpoint_after_upload=True,
        )


def _attempt_id(rank: int) -> int:
    """Rank 0's start time in ns, shared with all ranks: orders worker-group attempts."""
    import torch.distributed as dist

    stamp = [time.time_ns() if rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(stamp, src=0)
    return stamp[0]


def start_gpt2_worker(config: dict):
    """The first lines of every GPT-2 ``train_loop_per_worker``: this worker's session and a
    seeded model (same seed on every rank, so all ranks start from identical weights)."""
    from shared.models.gpt2 import build_gpt2

    cfg = config["cfg"]
    session = RaySession(cfg, config["packed"])
    seed_everything(cfg.seed)
    model = build_gpt2(
        cfg.model, config["vocab_size"], cfg.seq_len, cfg.pretrained, config["eos_token_id"]
    )
    init_from.load_weights(cfg, session, model)  # a fresh run with init_from: its weights
    return cfg, session, model
