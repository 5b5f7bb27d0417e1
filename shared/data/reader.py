"""A rank's micro-batches of an epoch: the order's slice for this rank, read through Ray Data
(or pyarrow / memory without Ray), each sample read once.

A reader gets the sample ids it must train on, in training order (shared/data/order.py). It
reads only the chunk files holding them, in the order they are needed, with the ids pushed
into the parquet read as a filter (``col("sample_id").is_in(ids)``), so rows already trained
on or belonging to other ranks never leave the read. Rows of one chunk arrive in ``sample_id``
order and are held until their micro-batch is complete (at most about one chunk per rank).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from shared import storage
from shared.data.order import epoch_order, reader_micro_batches, usable_samples
from shared.data.packing import PackedDataset

RowSource = Callable[[np.ndarray], Iterable[tuple[np.ndarray, np.ndarray]]]


def _rows_of(table) -> tuple[np.ndarray, np.ndarray]:
    ids = table.column("sample_id").to_numpy()
    import pyarrow as pa

    col = table.column("input_ids").combine_chunks()
    if pa.types.is_fixed_size_list(col.type) or pa.types.is_list(col.type):
        tokens = col.flatten().to_numpy(zero_copy_only=False)
    else:  # Ray Data's tensor extension type
        tokens = np.asarray(col.to_numpy(zero_copy_only=False))
    return ids, tokens.astype(np.int64).reshape(len(ids), -1)


def chunks_in_need_order(packed_chunk_rows: int, ids: np.ndarray) -> list[int]:
    return list(dict.fromkeys((ids // packed_chunk_rows).tolist()))


# Bytes of chunk files per read task. Every task costs a scheduling round and often a worker
# process start, and every rank's read competes with the others for Ray Data's share of the
# cluster: one task per (tiny) chunk file made a smoke epoch's read take 30-45 s at 2 ranks
# where one task takes 2-6 s. Large slices still stream, one ~64 MB task at a time.
READ_TASK_BYTES = 64 << 20
FOOTER_READERS = 2  # actors reading a slice's parquet footers (Ray Data's default: 32)


def read_tasks(packed: PackedDataset, chunks: list[int]) -> int:
    total = sum(packed.sizes[c] for c in chunks)
    return max(1, min(len(chunks), -(-total // READ_TASK_BYTES)))


def ray_rows(packed: PackedDataset, stats: list | None = None) -> RowSource:
    """Rows through Ray Data: the needed chunk files, in need order, ids filtered in the read."""

    def read(ids: np.ndarray):
        import ray.data
        from ray.data.expressions import col

        if not len(ids):
            return
        chunks = chunks_in_need_order(packed.chunk_rows, ids)
        fs, _ = storage.filesystem(packed.path)
        paths = [storage.filesystem(packed.chunk_path(c))[1] for c in chunks]
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True  # need order: a chunk at a time
        # Ray Data 2.60 reads parquet footers on a pool of actors, 32 by default, started by
        # every read_parquet: 32 processes per rank per epoch for a slice of a few files
        # (seconds each on a busy node). read_parquet reads the size here, in this process.
        os.environ.setdefault("RAY_DATA_PARQUET_FOOTER_NUM_ACTORS", str(FOOTER_READERS))
        # A small CPU share per read task: the training workers hold most of the node's CPUs
        # and a whole CPU per read can starve (the pipeline waits for resources forever).
        ds = ray.data.read_parquet(paths, filesystem=fs, columns=["sample_id", "input_ids"],
                                   num_cpus=0.1,
                                   override_num_blocks=read_tasks(packed, chunks))  # fmt: skip
        ds = ds.filter(expr=col("sample_id").is_in(np.sort(ids).tolist()))
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
            yield _rows_of(batch)
        if stats is not None:
            stats[:] = [ds.stats()]

    return read


def arrow_rows(packed: PackedDataset) -> RowSource:
    """The same rows without Ray (torchrun sessions): pyarrow reads each needed chunk file."""

    def read(ids: np.ndarray):
        import pyarrow.parquet as pq

        wanted = set(ids.tolist())
        for chunk in chunks_in_need_order(packed.chunk_rows, ids):
            fs, inner = storage.filesystem(packed.chunk_path(chunk))
            mine = [i for i in range(chunk * packed.chunk_rows,
                                     (chunk + 1) * packed.chunk_rows) if i in wanted]  # fmt: skip
            table = pq.read_table(inner, filesystem=fs, filters=[("sample_id", "in", mine)])
            yield _rows_of(table)

    return read


def memory_rows(blocks: torch.Tensor, chunk_rows: int) -> RowSource:
    """Rows of an in-memory ``[N, seq_len]`` tensor (sample_id = row index): unit tests."""

    def read(ids: np.ndarray):
        for chunk in chunks_in_need_order(chunk_rows, ids):
            mine = np.sort(ids[ids // chunk_rows == chunk])
            yield mine, blocks[torch.from_numpy(mine)].numpy()

    return read


class EpochReader:
    """Micro-batches of ``batch`` sequences for reader ``reader`` of ``readers`` (a world rank;
    TP ranks read parts of their dp rank's micro-batch), counting rows read and trained."""

    def __init__(self, rows: RowSource, num_samples: int, chunk_rows: int, seed: int,
                 reader: int, readers: int, batch: int, global_batch: int):  # fmt: skip
        self.rows, self.num_samples, self.chunk_rows = rows, num_samples, chunk_rows
        self.seed, self.reader, self.readers, self.batch = seed, reader, readers, batch
        self.global_batch = global_batch
        self.rows_read = 0
        self.rows_trained = 0

    def order(self, epoch: int) -> np.ndarray:
        return epoch_order(self.seed, epoch, self.num_samples, self.chunk_rows)

    def micro_batches(
        self, epoch: int, start: int, stop: int | None = None
    ) -> Iterator[tuple[int, np.ndarray, torch.Tensor]]:
        """(first position, sample ids, input_ids) from position ``start`` to ``stop`` or the
        epoch's end, whichever comes first; rows past ``stop`` are never read."""
        order = self.order(epoch)
        end = usable_samples(self.num_samples, self.global_batch)
        if stop is not None:
            end = min(end, stop)
        plan = list(reader_micro_batches(order, start, end, self.reader, self.readers, self.batch))
        if not plan:
            return
        held: dict[int, np.ndarray] = {}
        rows = iter(self.rows(np.concatenate([ids for _, ids in plan])))
        for n, (position, ids) in enumerate(plan, start=1):
            while any(i not in held for i in ids.tolist()):
                got_ids, got_tokens = next(rows)
                self.rows_read += len(got_ids)
                held.update(zip(got_ids.tolist(), got_tokens, strict=True))
            if n == len(plan):
                # Finish the read before the last batch: the loop stops at its last step
                # without asking for more, and a read left suspended never records its stats.
                for got_ids, _ in rows:
                    self.rows_read += len(got_ids)
            batch = torch.from_numpy(np.stack([held.pop(i) for i in ids.tolist()]))
            self.rows_trained += len(ids)
            yield position, ids, batch
