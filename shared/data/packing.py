"""Tokenise and pack once: a Ray Data pass writes the packed dataset, later runs reuse it.

``<storage_path>/_data/packed/<key>/`` holds ``chunk-000000.parquet`` ... (``chunk_rows`` rows
each: ``sample_id`` int64 and ``input_ids`` [seq_len] int32, one row per row group) and
``_MANIFEST.json``, written last. ``key`` hashes (source, its files' sizes and dates, tokenizer,
text column, seq_len, max_samples, chunk_rows, packing version), so a change to any of them
packs again. A directory without a manifest is incomplete and never read: on local disk the
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

PACKING_VERSION = 2  # bump when the packed files change for the same inputs
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


def write_packed(source: TextSource, seq_len: int, max_samples: int, chunk_rows: int,
                 final: str, key: str) -> PackedDataset:  # fmt: skip
    """The Ray Data pass: read parquet -> tokenise + pack on CPU workers (``map_batches``, in
    order) -> chunk files with consecutive ``sample_id`` written by this process -> manifest."""
    import pyarrow.parquet as pq
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
            files, sizes, count = [], [], 0
            fs, inner = storage.filesystem(out)
            fs.create_dir(inner, recursive=True)
            for batch in ds.iter_batches(batch_size=chunk_rows, batch_format="numpy"):
                ids = np.asarray(batch["input_ids"])
                if ids.dtype == object:
                    ids = np.stack(list(ids))
                name = f"chunk-{len(files):06d}.parquet"
                with fs.open_output_stream(f"{inner}/{name}") as f:
                    pq.write_table(_chunk_table(count, ids), f, row_group_size=ROW_GROUP_ROWS)
                files.append(name)
                sizes.append(fs.get_file_info(f"{inner}/{name}").size)
                count += len(ids)
            manifest = {"key": key, "num_samples": count, "seq_len": seq_len,
                        "chunk_rows": chunk_rows, "source": source.dataset,
                        "tokenizer": source.tokenizer, "written_at": time.time(),
                        "files": [{"name": n, "bytes": s}
                                  for n, s in zip(files, sizes, strict=True)]}  # fmt: skip
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
