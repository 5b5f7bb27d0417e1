"""A rank's micro-batches of an epoch: the order's slice for this rank, read through Ray Data
(or pyarrow / memory without Ray), each sample read once.

A reader gets the sample ids it must train on, in training order (shared/data/order.py). It
reads only the chunk files holding them, in the order they are needed, with the ids pushed
into the parquet read as a filter (``("sample_id", "in", ids)``): it keeps only the row groups
holding them (one row each, shared/data/packing.py), so rows already trained on or belonging
to other ranks are never decoded. Rows of one chunk arrive in ``sample_id``
order and are held until their micro-batch is complete (at most about one chunk per rank).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

import numpy as np

from shared import storage
from shared.data.order import epoch_order, reader_micro_batches, usable_samples
from shared.data.packing import PackedDataset

if TYPE_CHECKING:  # torch is imported where tensors are made: Ray Data's read tasks need none
    import torch

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


def read_tasks(packed: PackedDataset, chunks: list[int]) -> int:
    total = sum(packed.sizes[c] for c in chunks)
    return max(1, min(len(chunks), -(-total // READ_TASK_BYTES)))


def read_chunk(path: str, ids: list[int]):
    """The rows of one chunk file among ``ids``, as a pyarrow Table (the ids are pushed into
    the parquet read as a filter: row groups without them, one row each, are never decoded).

    Every page read is checked against the CRC the packing pass wrote: a damaged byte that
    keeps the file's size (which ``check_packed`` compares) would otherwise decode into other
    token ids - silently, for about 60% of single-byte flips in an ``input_ids`` page."""
    import pyarrow.parquet as pq

    fs, inner = storage.filesystem(path)
    try:
        return pq.read_table(inner, filesystem=fs, columns=["sample_id", "input_ids"],
                             filters=[("sample_id", "in", ids)],
                             page_checksum_verification=True)  # fmt: skip
    except OSError as err:
        if "checksum" not in str(err):
            raise  # not damage: e.g. the object store is unreachable
        from shared.config import ConfigError

        cache_dir = path.rsplit("/", 1)[0]
        raise ConfigError(
            f"cached packed shard '{path}' failed its page checksum: the cache is corrupt; "
            f"delete '{cache_dir}' and rerun to pack the data again."
        ) from None


def read_units(packed: PackedDataset, ids: np.ndarray) -> list[dict]:
    """(chunk file, the ids wanted from it) for each chunk holding ``ids``, in need order."""
    return [{"path": packed.chunk_path(chunk),
             "ids": np.sort(ids[ids // packed.chunk_rows == chunk]).tolist()}
            for chunk in chunks_in_need_order(packed.chunk_rows, ids)]  # fmt: skip


def read_packed_chunks(units):
    """Ray Data's read task: a block of read units in, their rows out (a pyarrow Table)."""
    import pyarrow as pa

    paths, ids = units.column("path").to_pylist(), units.column("ids").to_pylist()
    return pa.concat_tables([read_chunk(p, i) for p, i in zip(paths, ids, strict=True)])


def ray_rows(packed: PackedDataset, stats: list | None = None) -> RowSource:
    """Rows through Ray Data: read tasks over the needed chunk files, in need order.

    The dataset is built from the list of (file, ids) read units, not with ``read_parquet``:
    Ray Data 2.60's parquet datasource lists the files in a task, samples footers and infers
    the schema in the calling process, and starts footer-reading actors, for every read. A
    rank reads a new slice every epoch, and that start-up cost 2-7 s per read (and the GIL of
    the training process) where the same rows through ``from_items`` + ``map_batches`` take
    0.1-0.5 s. The rows still stream: read tasks run on the cluster, blocks arrive in order,
    back-pressure holds the rest."""

    def read(ids: np.ndarray):
        import ray.data

        if not len(ids):
            return
        units = read_units(packed, ids)
        context = ray.data.DataContext.get_current()
        context.execution_options.preserve_order = True  # need order: a chunk at a time
        tasks = read_tasks(packed, chunks_in_need_order(packed.chunk_rows, ids))
        # A small CPU share per read task: the training workers hold most of the node's CPUs
        # and a whole CPU per read can starve (the pipeline waits for resources forever).
        ds = ray.data.from_items(units, override_num_blocks=tasks).map_batches(
            read_packed_chunks, batch_size=None, batch_format="pyarrow", num_cpus=0.1
        )
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
            yield _rows_of(batch)
        if stats is not None:
            stats[:] = [ds.stats()]

    return read


def arrow_rows(packed: PackedDataset) -> RowSource:
    """The same rows without Ray (torchrun sessions): pyarrow reads each needed chunk file."""

    def read(ids: np.ndarray):
        for unit in read_units(packed, ids):
            yield _rows_of(read_chunk(unit["path"], unit["ids"]))

    return read


def memory_rows(blocks: torch.Tensor, chunk_rows: int) -> RowSource:
    """Rows of an in-memory ``[N, seq_len]`` tensor (sample_id = row index): unit tests."""
    import torch

    def read(ids: np.ndarray):
        for chunk in chunks_in_need_order(chunk_rows, ids):
            mine = np.sort(ids[ids // chunk_rows == chunk])
            yield mine, blocks[torch.from_numpy(mine)].numpy()

    return read


class ReadAhead:
    """A row read started before it is needed, on a thread; at most ``depth`` blocks of rows
    wait in memory (Ray Data's own back-pressure holds the rest of the read).

    Starting a Ray Data read costs seconds (its streaming executor, a file-listing task, task
    worker processes), and an epoch's read cannot start before the previous epoch ends unless
    someone starts it early: without this, every epoch boundary stalled each rank 3-9 s."""

    _END = object()

    def __init__(self, rows: RowSource, ids: np.ndarray, depth: int = 2):
        self.ids = ids
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(rows, ids), daemon=True,
                                        name="epoch-read-ahead")  # fmt: skip
        self._thread.start()

    def _read(self, rows: RowSource, ids: np.ndarray) -> None:
        source = iter(rows(ids))
        try:
            for item in source:
                if self._cancelled.is_set():
                    return
                self._queue.put(item)
            self._queue.put(self._END)
        except BaseException as error:  # handed to the consumer, raised where it reads
            self._queue.put(error)
        finally:
            close = getattr(source, "close", None)
            if close is not None:
                close()  # a cancelled Ray Data read shuts its executor down

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        while (item := self._queue.get()) is not self._END:
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self) -> None:
        """Stop the read: the thread ends at its next block (the queue is emptied so that a
        blocked put returns)."""
        self._cancelled.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return


class EpochReader:
    """Micro-batches of ``batch`` sequences for reader ``reader`` of ``readers`` (a world rank;
    TP ranks read parts of their dp rank's micro-batch), counting rows read and trained.

    When a call's ``stop`` lies past the end of its epoch (the run goes on into the next), the
    next epoch's read starts as soon as this epoch's first batch is out (``ReadAhead``), so
    its start-up overlaps training instead of stalling the epoch boundary."""

    def __init__(self, rows: RowSource, num_samples: int, chunk_rows: int, seed: int,
                 reader: int, readers: int, batch: int, global_batch: int):  # fmt: skip
        self.rows, self.num_samples, self.chunk_rows = rows, num_samples, chunk_rows
        self.seed, self.reader, self.readers, self.batch = seed, reader, readers, batch
        self.global_batch = global_batch
        self.rows_read = 0
        self.rows_trained = 0
        self.reads_started_early = 0  # epochs whose read started before they did
        self._read_ahead: ReadAhead | None = None

    def order(self, epoch: int) -> np.ndarray:
        return epoch_order(self.seed, epoch, self.num_samples, self.chunk_rows)

    def plan(self, epoch: int, start: int, stop: int | None) -> list[tuple[int, np.ndarray]]:
        """(first position, sample ids) of this reader's micro-batches in ``[start, stop)``."""
        end = usable_samples(self.num_samples, self.global_batch)
        if stop is not None:
            end = min(end, stop)
        return list(reader_micro_batches(self.order(epoch), start, end, self.reader,
                                         self.readers, self.batch))  # fmt: skip

    def read_ahead(self, epoch: int, start: int, stop: int | None) -> None:
        """Start reading what ``micro_batches(epoch, start, stop)`` will ask for (a guess: a
        different call cancels it)."""
        self.close()
        plan = self.plan(epoch, start, stop)
        if plan:
            self._read_ahead = ReadAhead(self.rows, np.concatenate([ids for _, ids in plan]))

    def _rows_for(self, ids: np.ndarray) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        early, self._read_ahead = self._read_ahead, None
        if early is not None and np.array_equal(early.ids, ids):
            self.reads_started_early += 1
            return iter(early)
        if early is not None:
            early.cancel()  # the loop asked for something else (another stop, a new batch size)
        return iter(self.rows(ids))

    def close(self) -> None:
        """Stop a read started early that nobody will ask for."""
        if self._read_ahead is not None:
            self._read_ahead.cancel()
            self._read_ahead = None

    def micro_batches(
        self, epoch: int, start: int, stop: int | None = None
    ) -> Iterator[tuple[int, np.ndarray, torch.Tensor]]:
        """(first position, sample ids, input_ids) from position ``start`` to ``stop`` or the
        epoch's end, whichever comes first; rows past ``stop`` are never read."""
        import torch

        plan = self.plan(epoch, start, stop)
        if not plan:
            return
        held: dict[int, np.ndarray] = {}
        rows = self._rows_for(np.concatenate([ids for _, ids in plan]))
        # The training loop asks for (epoch + 1, 0, stop - end) when this epoch ends first.
        end = usable_samples(self.num_samples, self.global_batch)
        goes_on = stop is not None and stop > end
        try:
            for n, (position, ids) in enumerate(plan, start=1):
                while any(i not in held for i in ids.tolist()):
                    got_ids, got_tokens = next(rows)
                    self.rows_read += len(got_ids)
                    held.update(zip(got_ids.tolist(), got_tokens, strict=True))
                if n == 1 and goes_on:
                    self.read_ahead(epoch + 1, 0, stop - end)
                if n == len(plan):
                    # Finish the read before the last batch: the loop stops at its last step
                    # without asking for more, and a read left suspended never records its
                    # stats.
                    for got_ids, _ in rows:
                        self.rows_read += len(got_ids)
                batch = torch.from_numpy(np.stack([held.pop(i) for i in ids.tolist()]))
                self.rows_trained += len(ids)
                yield position, ids, batch
        except GeneratorExit:
            self.close()  # the epoch was abandoned (preemption, divergence): so is the next
            raise
