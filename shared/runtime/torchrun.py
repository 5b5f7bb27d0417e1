"""The shared loop without Ray: a Session for plain ``torchrun`` (or a single process).

Used where Ray cannot go (the GPU benchmark machine, which cannot carry Ray's wheel) and by
the unit tests. Checkpoints are directories ``<root>/step_<N>`` promoted by rename; every rank
writes its own files into the same directory, which must be on storage all ranks share.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
from collections.abc import Iterator

import torch
import torch.distributed as dist

from shared.checkpoint import resume
from shared.data import EpochReader, memory_rows, tokenize_and_pack
from shared.data.session import data_position_record, data_read_summary


def init_distributed(collective_timeout_s: float = 1800.0) -> tuple[int, int, torch.device]:
    """(rank, world size, device) from torchrun's environment; no process group if alone.

    A collective that waits longer than ``collective_timeout_s`` raises instead of hanging
    (pass ``cfg.collective_timeout_s``; Ray Train gets the same through TorchConfig)."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
    return rank, world_size, device


def packed_blocks(dataset: str, tokenizer, text_column: str, seq_len: int) -> torch.Tensor:
    """A parquet file tokenised and packed into ``[N, seq_len]`` blocks, in memory: the data
    path of a Ray-free run (the jobs stream the same blocks through Ray Data)."""
    import pyarrow.parquet as pq

    texts = pq.read_table(dataset).column(text_column).to_numpy()
    ids = tokenize_and_pack({text_column: texts}, tokenizer, text_column, seq_len)["input_ids"]
    return torch.from_numpy(ids)


def rank_batches(
    blocks: torch.Tensor,
    micro: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    global_batch: int | None = None,
    chunk_rows: int = 32,
) -> EpochReader:
    """This rank's micro-batches of in-memory blocks (sample_id = row index) through the same
    data layer as the jobs: the epoch order from (seed, epoch), this rank's slice of each
    global batch (``global_batch`` defaults to ``micro * world_size``)."""
    return EpochReader(memory_rows(blocks, chunk_rows), len(blocks), chunk_rows, seed,
                       reader=rank, readers=world_size, batch=micro,
                       global_batch=global_batch or micro * world_size)  # fmt: skip


class TorchrunSession:
    """Batches from an :class:`~shared.data.EpochReader` (see :func:`rank_batches`),
    checkpoints in a local directory, metrics kept in memory."""

    def __init__(
        self,
        reader: EpochReader,
        checkpoint_root: str,
        batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | None = None,
    ):
        self.reader = reader
        self.checkpoint_root = checkpoint_root
        self.rank = rank
        self.world_size = world_size
        self.device = device or torch.device("cpu")
        self.reports: list[dict] = []
        self.samples_per_micro_batch = batch_size * world_size

    def epoch_batches(
        self, epoch: int, start_sample: int, end_sample: int | None = None
    ) -> Iterator[torch.Tensor]:
        for _, _, batch in self.reader.micro_batches(epoch, start_sample, end_sample):
            yield batch

    def data_position(self, epoch: int, samples_in_epoch: int) -> dict:
        return data_position_record(self.reader, None, epoch, samples_in_epoch)

    def data_summary(self) -> dict:
        return data_read_summary(self.reader, self.device)

    def checkpoints(self) -> list[str]:
        if not os.path.isdir(self.checkpoint_root):
            return []
        names = sorted(n for n in os.listdir(self.checkpoint_root) if n.startswith("step_"))
        return [os.path.join(self.checkpoint_root, n) for n in names]

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[str | None]:
        """The newest checkpoint whose manifests verify (shared/checkpoint/resume.py)."""
        with resume.open_checkpoint(self.resume_plan().checkpoint) as directory:
            yield directory

    def resume_plan(self) -> resume.ResumePlan:
        if getattr(self, "_resume_plan", None) is None:
            found = self.checkpoints()
            latest = os.path.basename(found[-1]) if found else None
            self._resume_plan = resume.plan_resume(self.checkpoint_root, latest, self.rank)
        return self._resume_plan

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def report(self, metrics: dict, checkpoint_dir: str | None = None) -> None:
        """Merge every rank's staged directory into ``<root>/.<name>.tmp``, then rank 0 renames
        it to ``<root>/<name>``: the checkpoint appears only once all ranks' parts are in."""
        if checkpoint_dir is not None:
            name = os.path.basename(checkpoint_dir)
            merged = os.path.join(self.checkpoint_root, f".{name}.tmp")
            for writer in range(self.world_size):  # one rank at a time into the shared dir
                if self.rank == writer:
                    shutil.copytree(checkpoint_dir, merged, dirs_exist_ok=True)
                self._barrier()
            shutil.rmtree(checkpoint_dir, ignore_errors=True)
            if self.rank == 0:
                os.rename(merged, os.path.join(self.checkpoint_root, name))
            self._barrier()
        self.reports.append({**metrics, "checkpoint": checkpoint_dir is not None})
