"""Tokenise and pack once: a Ray Data pass writes the packed dataset, later runs reuse it.

``<storage_path>/_data/packed/<key>/`` holds ``chunk-000000.parquet`` ... (``chunk_rows`` rows
each: ``sample_id`` int64 and ``input_ids`` [seq_len] int32, one row per row group) and
``_MANIFEST.json``, written last. ``key`` hashes (source, its files' sizes and dates, tokenizer,
text column, seq_len, max_samples, chunk_rows, packing version), so a change to any of them
packs again. Ray tasks write the chunk files from the tokenised blocks in the object store
(``ChunkWriter``); the driver sees only block references and row counts, then writes the
manifest. A directory without a manifest is incomplete and never read: on local disk the
pass writes into a temp sibling renamed when complete; on object storage (renames are copies)
the manifest is the commit marker, and a leftover partial prefix is removed before a rebuild.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass

import numpy as np

from shared import storage
from shared.data.source import TextSource, parquet_files

PACKING_VERSION = 3  # bump when the packed files change for the same inputs (3: page CRCs)
# A parquet read decodes whole row groups: the sample-id filter prunes row groups by their
# statistics, then drops rows. The ranks of one global batch share chunks (a chunk is one
# window of the order), so with a row group per chunk file every rank decoded the whole file
# for its share of it: about min(ranks, chunk_rows / micro-batch) times the rows it trains.
# One row per group decodes only the rows a rank trains on, at every world size and after any
# resume, for ~0.1 ms per row of parquet overhead inside the read task.
ROW_GROUP_ROWS = 1
MANIFEST = "_MANIFEST.json"


@dataclass(frozen=True)
class PackedDataset:
    """A complete packed dataset on storage (what its manifest says)."""

    path: str
    key: str
    num_samples: int
    seq_len: int
    chunk_rows: int
    files: tuple[str, ...]  # names inside ``path``; file i holds sample ids [i*chunk_rows, ...)
    sizes: tuple[int, ...]

    def chunk_path(self, chunk: int) -> str:
        return storage.join(self.path, self.files[chunk])


def _source_identity(source: TextSource) -> list:
    """Sizes and modification times of the source files: an edited dataset packs again."""
    try:
        fs, files = parquet_files(source.dataset)
        return sorted([i.path, i.size, str(i.mtime)] for i in fs.get_file_info(files))
    except Exception:  # noqa: BLE001 - a hub dataset without listing: its name is the identity
        # Anywhere else a failed listing is an error, not another key: a busy object store
        # timing out once would otherwise pack the same data again under a second key.
        if not source.dataset.startswith("hf://"):
            raise
        return []


def packed_key(source: TextSource, seq_len: int, max_samples: int, chunk_rows: int) -> str:
    inputs = {"dataset": source.dataset, "files": _source_identity(source),
              "tokenizer": source.tokenizer, "text_column": source.text_column,
              "seq_len": seq_len, "max_samples": max_samples, "chunk_rows": chunk_rows,
              "version": PACKING_VERSION}  # fmt: skip
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def packed_dir(storage_path: str, key: str) -> str:
    return storage.join(storage_path, "_data", "packed", key)


def load_packed(path: str) -> PackedDataset | None:
    """The packed dataset at ``path`` if its manifest is there (complete), else None."""
    manifest = storage.join(path, MANIFEST)
    if not storage.exists(manifest):
        return None
    m = json.loads(storage.read_text(manifest))
    return PackedDataset(path=path, key=m["key"], num_samples=m["num_samples"],
                         seq_len=m["seq_len"], chunk_rows=m["chunk_rows"],
                         files=tuple(f["name"] for f in m["files"]),
                         sizes=tuple(f["bytes"] for f in m["files"]))  # fmt: skip


def check_packed(packed: PackedDataset) -> None:
    """Every chunk file is there with the size its manifest recorded (cheap: listing only).
    Raises ConfigError naming the first file that is not."""
    from shared.config import ConfigError

    for name, size in zip(packed.files, packed.sizes, strict=True):
        path = storage.join(packed.path, name)
        fs, inner = storage.filesystem(path)
        found = fs.get_file_info(inner).size
        if found != size:
            state = "is missing" if found is None else f"has {found} bytes, not {size}"
            raise ConfigError(
                f"cached packed shard '{path}' {state}: the cache is corrupt; delete "
                f"'{packed.path}' and rerun to pack the data again."
            )


def _chunk_table(first_id: int, input_ids: np.ndarray):
    import pyarrow as pa

    rows, seq_len = input_ids.shape
    flat = pa.array(input_ids.astype(np.int32).reshape(-1))
    return pa.table({
        "sample_id": pa.array(np.arange(first_id, first_id + rows, dtype=np.int64)),
        "input_ids": pa.FixedSizeListArray.from_arrays(flat, seq_len),
    })  # fmt: skip


def chunk_name(index: int) -> str:
    return f"chunk-{index:06d}.parquet"


def write_chunks(out: str, first_id: int, chunk_rows: int, row_ranges: list[tuple[int, int]],
                 *blocks) -> list[tuple[str, int]]:  # fmt: skip
    """A Ray task: rows ``[start, stop)`` of each packed block, in order, are the samples from
    ``first_id`` on; write them as chunk files of ``chunk_rows`` (the last may be shorter).
    Returns [(file name, bytes)]."""
    import pyarrow.parquet as pq
    from ray.data.block import BlockAccessor

    parts = []
    for block, (start, stop) in zip(blocks, row_ranges, strict=True):
        ids = BlockAccessor.for_block(block).to_numpy("input_ids")[start:stop]
        parts.append(np.stack(list(ids)) if ids.dtype == object else ids)
    rows = np.concatenate(parts)
    fs, inner = storage.filesystem(out)
    written = []
    for offset in range(0, len(rows), chunk_rows):
        name = chunk_name((first_id + offset) // chunk_rows)
        with fs.open_output_stream(f"{inner}/{name}") as f:
            table = _chunk_table(first_id + offset, rows[offset : offset + chunk_rows])
            # Page CRCs: the readers verify every page they decode (reader.read_chunk).
            pq.write_table(table, f, row_group_size=ROW_GROUP_ROWS, write_page_checksum=True)
        written.append((name, fs.get_file_info(f"{inner}/{name}").size))
    return written


class ChunkWriter:
    """Cuts the ordered stream of packed blocks into chunk files of ``chunk_rows`` consecutive
    sample ids. Ray tasks write them where the blocks are: the rows never pass through the
    driver, which only counts rows and hands block references on - one task per arriving
    block, writing every chunk the stream has completed, so a block travels to at most two
    tasks."""

    # Tasks queued ahead of the stream: enough to keep a node's CPUs writing, few enough that
    # the blocks they pin do not fill the object store.
    MAX_IN_FLIGHT = 8

    def __init__(self, out: str, chunk_rows: int):
        import ray

        self.out, self.chunk_rows = out, chunk_rows
        self._task = ray.remote(write_chunks)
        self._pending: list[tuple[object, int, int]] = []  # (block ref, start, stop) in order
        self._pending_rows = 0
        self._next_id = 0  # sample id of the first pending row
        self._in_flight: list = []
        self._written: list[tuple[str, int]] = []

    def add_bundle(self, bundle) -> None:
        """A Ray Data ``RefBundle`` (whole blocks or slices of them), in stream order."""
        for entry, part in zip(bundle.blocks, bundle.slices, strict=True):
            if part is not None:
                self._add(entry.ref, part.start_offset, part.end_offset)
            else:
                self._add(entry.ref, 0, _block_rows(entry))

    def _add(self, ref, start: int, stop: int) -> None:
        if stop <= start:
            return
        self._pending.append((ref, start, stop))
        self._pending_rows += stop - start
        if self._pending_rows >= self.chunk_rows:
            self._submit(self._pending_rows // self.chunk_rows * self.chunk_rows)

    def finish(self) -> list[tuple[str, int]]:
        """Write what is left (a last, shorter chunk); every (file name, bytes) in id order."""
        import ray

        if self._pending_rows:
            self._submit(self._pending_rows)
        for done in ray.get(self._in_flight):
            self._written.extend(done)
        self._in_flight = []
        return sorted(self._written)

    @property
    def rows_written(self) -> int:
        return self._next_id

    def _submit(self, rows: int) -> None:
        import ray

        refs, ranges, taken = [], [], 0
        while taken < rows:
            ref, start, stop = self._pending.pop(0)
            stop_here = min(stop, start + rows - taken)
            refs.append(ref)
            ranges.append((start, stop_here))
            taken += stop_here - start
            if stop_here < stop:  # the rest of this block starts the next task
                self._pending.insert(0, (ref, stop_here, stop))
        self._in_flight.append(
            self._task.remote(self.out, self._next_id, self.chunk_rows, ranges, *refs)
        )
        self._next_id += rows
        self._pending_rows -= rows
        if len(self._in_flight) > self.MAX_IN_FLIGHT:
            ready, self._in_flight = ray.wait(self._in_flight, num_returns=1)
            self._written.extend(ray.get(ready[0]))


def _block_rows(entry) -> int:
    if entry.metadata.num_rows is not None:
        return entry.metadata.num_rows
    import ray
    from ray.data.block import BlockAccessor

    return ray.get(ray.remote(lambda b: BlockAccessor.for_block(b).num_rows()).remote(entry.ref))


def write_packed(source: TextSource, seq_len: int, max_samples: int, chunk_rows: int,
                 final: str, key: str) -> PackedDataset:  # fmt: skip
    """The Ray Data pass: read parquet -> tokenise + pack on CPU workers (``map_batches``, in
    order) -> chunk files with consecutive ``sample_id``, written in parallel by Ray tasks
    (``ChunkWriter``) -> manifest, written last by this process."""
    import ray.data

    from shared.data.source import build_text_dataset

    context = ray.data.DataContext.get_current()
    keep_order = context.execution_options.preserve_order
    context.execution_options.preserve_order = True  # same rows, same ids, every rebuild
    try:
        ds = build_text_dataset(source, seq_len, max_samples)
        remote = storage.is_remote(final)
        if remote and storage.exists(final):  # a killed earlier pass left chunks, no manifest
            storage.remove(final)
        publish = contextlib.nullcontext(final) if remote else storage.atomic_directory(final)
        with publish as out:
            fs, inner = storage.filesystem(out)
            fs.create_dir(inner, recursive=True)
            writer = ChunkWriter(out, chunk_rows)
            for bundle in ds.iter_internal_ref_bundles():
                writer.add_bundle(bundle)
            files = writer.finish()
            manifest = {"key": key, "num_samples": writer.rows_written, "seq_len": seq_len,
                        "chunk_rows": chunk_rows, "source": source.dataset,
                        "tokenizer": source.tokenizer, "written_at": time.time(),
                        "files": [{"name": n, "bytes": s} for n, s in files]}  # fmt: skip
            storage.write_text(storage.join(out, MANIFEST), json.dumps(manifest, indent=1))
    finally:
        context.execution_options.preserve_order = keep_order
    return load_packed(final)


def find_packed(source: TextSource, cfg) -> tuple[str, PackedDataset | None]:
    """(directory, the complete packed dataset there or None) for this run's data settings."""
    key = packed_key(source, cfg.seq_len, cfg.max_samples, cfg.pack_chunk_rows)
    path = packed_dir(cfg.storage_path, key)
    return path, load_packed(path)


def check_enough_samples(packed: PackedDataset, global_batch: int, what: str = "dataset") -> None:
    from shared.config import ConfigError

    if packed.num_samples == 0:
        raise ConfigError(f"the {what} packs into no sequences of {packed.seq_len} tokens: it is "
                          "empty or its texts are blank.")  # fmt: skip
    if packed.num_samples < global_batch:
        raise ConfigError(
            f"the {what} packs into {packed.num_samples} sequences of {packed.seq_len} tokens, "
            f"fewer than one global batch of {global_batch}: use more data or a smaller batch."
        )


def packed_dataset(source: TextSource, cfg, log=print) -> PackedDataset:
    """Reuse the packed dataset for these settings, or pack it now (needs Ray). One line says
    which."""
    path, packed = find_packed(source, cfg)
    if packed is not None:
        log(f"data: reusing packed dataset {path} ({packed.num_samples} sequences of "
            f"{packed.seq_len} tokens; no tokenisation)")  # fmt: skip
        return packed
    start = time.time()
    key = os.path.basename(path.rstrip("/"))
    packed = write_packed(source, cfg.seq_len, cfg.max_samples, cfg.pack_chunk_rows, path, key)
    log(f"data: tokenised and packed {source.dataset} into {path} ({packed.num_samples} "
        f"sequences of {packed.seq_len} tokens, {time.time() - start:.1f} s)")  # fmt: skip
    return packed
