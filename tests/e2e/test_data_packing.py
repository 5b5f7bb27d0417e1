"""Tokenise and pack once (real local Ray): reuse, a killed write, a driver killed while packing,
the Ray Data read of a slice, and the bad-input sentences."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, job_env, run_job

from shared import storage
from shared.config import ConfigError
from shared.data import (
    EpochReader,
    TextSource,
    arrow_rows,
    check_enough_samples,
    check_packed,
    find_packed,
    generate_news_corpus,
    packed_dataset,
    ray_rows,
)
from shared.data.reader import read_chunk, read_units

pytestmark = pytest.mark.e2e


@dataclass
class DataSettings:
    storage_path: str
    seq_len: int = 32
    max_samples: int = 0
    pack_chunk_rows: int = 16


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> TextSource:
    return generate_news_corpus(str(tmp_path_factory.mktemp("corpus")), num_rows=300, seed=0)


def test_second_run_reuses_the_packed_dataset_and_killed_writes_are_never_used(
    ray_local, corpus, tmp_path
):
    cfg = DataSettings(str(tmp_path))
    path, found = find_packed(corpus, cfg)
    # A pass killed mid-write leaves only a temp sibling (local) or no manifest (object store).
    os.makedirs(path + ".tmp-killed")
    open(os.path.join(path + ".tmp-killed", "chunk-000000.parquet"), "w").close()
    assert found is None and find_packed(corpus, cfg)[1] is None
    lines: list[str] = []
    first = packed_dataset(corpus, cfg, log=lines.append)
    assert "tokenised and packed" in lines[0] and first.num_samples > 100
    assert first.files[0] == "chunk-000000.parquet"
    assert len(first.files) == -(-first.num_samples // 16)
    second = packed_dataset(corpus, cfg, log=lines.append)
    assert lines[1].startswith("data: reusing packed dataset") and "no tokenisation" in lines[1]
    assert second == first
    # a changed setting is another dataset
    assert find_packed(corpus, DataSettings(str(tmp_path), seq_len=16))[1] is None

    # Ray Data reads one rank's slice with the ids pushed into the read: rows read == trained,
    # and the same rows as the Ray-free reader.
    def reader(rows):
        return EpochReader(rows, first.num_samples, 16, seed=3, reader=1, readers=2, batch=4,
                           global_batch=16)  # fmt: skip

    stats: list[str] = []
    via_ray, via_arrow = reader(ray_rows(first, stats)), reader(arrow_rows(first))
    got = [(p, ids.tolist(), b.numpy()) for p, ids, b in via_ray.micro_batches(1, 32)]
    want = [(p, ids.tolist(), b.numpy()) for p, ids, b in via_arrow.micro_batches(1, 32)]
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert all(np.array_equal(g[2], w[2]) for g, w in zip(got, want, strict=True))
    assert via_ray.rows_read == via_ray.rows_trained == len(got) * 4
    # ... and the parquet reads decode only those rows: the id filter keeps the row groups
    # holding them (by their statistics), and a row group is one row. With a row group per
    # chunk file, this rank decoded 16 rows of every chunk for the 8 it trains on.
    import pyarrow.dataset as pads

    wanted = np.concatenate([ids for _, ids in via_arrow.plan(1, 32, None)])
    decoded = 0
    for unit in read_units(first, wanted):
        fragment = next(pads.dataset(unit["path"], format="parquet").get_fragments())
        for group in fragment.split_by_row_group(pads.field("sample_id").isin(unit["ids"])):
            decoded += sum(g.num_rows for g in group.row_groups)
    assert decoded == len(wanted) == via_ray.rows_trained
    # One read task over the listed chunk files. Not read_parquet: its file-listing task,
    # footer actors and in-process schema sampling cost 2-7 s per rank per epoch.
    assert "MapBatches(read_packed_chunks): 1 tasks executed" in stats[0], stats[0]
    assert "ListFiles" not in stats[0] and "ReadFiles" not in stats[0]

    # A damaged cached chunk: one sentence naming it, before any worker starts.
    with open(os.path.join(first.path, first.files[2]), "ab") as f:
        f.write(b"garbage")
    with pytest.raises(ConfigError, match=r"cached packed shard .*chunk-000002.parquet.* corrupt"):
        check_packed(first)
    with pytest.raises(ConfigError, match="fewer than one global batch of 100000"):
        check_enough_samples(first, 100_000)


def test_ray_tasks_write_the_chunks_in_stream_order_and_the_driver_writes_none(
    ray_local, corpus, tmp_path, monkeypatch
):
    """The rows go from the tokenising tasks to the writing tasks through Ray's object store:
    the driver (this process) only hands block references on and writes the manifest, so the
    pass scales with the cluster, not with one process. The files are the ordered stream cut
    every ``chunk_rows`` rows, whatever the blocks' sizes."""
    import pyarrow.parquet as pq

    from shared.data.source import build_text_dataset

    def driver_write(*args, **kwargs):
        raise AssertionError("the driver wrote a chunk file")

    monkeypatch.setattr(pq, "write_table", driver_write)
    cfg = DataSettings(str(tmp_path), pack_chunk_rows=7)  # blocks never align with chunks
    packed = packed_dataset(corpus, cfg, log=lambda line: None)
    monkeypatch.undo()

    stream = build_text_dataset(corpus, cfg.seq_len).iter_batches(
        batch_size=7, batch_format="numpy"
    )
    expected = [np.stack(list(batch["input_ids"])) for batch in stream]
    assert len(packed.files) == len(expected) > 10
    assert packed.num_samples == sum(len(rows) for rows in expected)
    for index, (name, rows) in enumerate(zip(packed.files, expected, strict=True)):
        chunk = pq.ParquetFile(os.path.join(packed.path, name))
        table = chunk.read()
        first = 7 * index
        assert table.column("sample_id").to_pylist() == list(range(first, first + len(rows)))
        written = table.column("input_ids").to_numpy(zero_copy_only=False)
        assert np.array_equal(np.stack(written), rows)
        assert chunk.metadata.num_row_groups == len(rows)  # a row group per row (ROW_GROUP_ROWS)

    # A damaged byte that keeps the file's size passes the size check but not the page CRCs:
    # one sentence naming the file, where old caches decoded other token ids without a word.
    path = os.path.join(packed.path, packed.files[1])
    column = pq.ParquetFile(path).metadata.row_group(0).column(1)  # sample 7's input_ids
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(Path(path).read_bytes())
    data[start + column.total_compressed_size - 3] ^= 0x5A
    Path(path).write_bytes(data)
    check_packed(packed)  # same size: only the pages can tell
    with pytest.raises(ConfigError, match=r"cached packed shard .*chunk-000001.parquet.* checksum"):
        read_chunk(path, [7])
    assert read_chunk(path, [8]).num_rows == 1  # the rows around it are intact


def test_a_split_pattern_packs_only_that_splits_rows(ray_local, corpus, tmp_path):
    """tp2d's full profile reads Wikitext's train-*.parquet beside validation-* and test-*."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    splits = tmp_path / "splits"
    splits.mkdir()
    shutil.copy(corpus.dataset, splits / "train-00000-of-00001.parquet")
    other = pa.table({"text": ["held out text that must not be packed"] * 400})
    pq.write_table(other, splits / "validation-00000-of-00001.parquet")
    cfg = DataSettings(str(tmp_path / "runs"))
    alone = packed_dataset(corpus, cfg, log=lambda line: None)
    split = TextSource(dataset=str(splits / "train-*.parquet"), tokenizer=corpus.tokenizer)
    packed = packed_dataset(split, cfg, log=lambda line: None)
    assert packed.path != alone.path and packed.num_samples == alone.num_samples


def footer_reader_actors(cluster) -> set[str]:
    """Ids of every FooterReader actor the cluster has started (alive or dead)."""
    from ray.util.state import list_actors

    url = cluster.dashboard_url
    actors = list_actors(
        address=url if "://" in url else f"http://{url}",
        filters=[("class_name", "=", "FooterReader")],
        limit=10_000,
        raise_on_missing_output=False,
    )
    return {actor.actor_id for actor in actors}


def test_reading_a_one_file_corpus_starts_one_footer_reader(ray_local, corpus, monkeypatch):
    """Ray Data 2.60 starts a pool of 32 FooterReader processes per parquet read whatever the
    file count (~13 CPU-s of process starts at every run's first data pass): the pool is sized
    to the files, and a size the user set is kept."""
    from shared.data.source import FOOTER_READER_ENV, build_text_dataset, footer_readers

    assert [footer_readers(n) for n in (1, 10, 11, 95, 10_000)] == [1, 1, 2, 10, 32]
    monkeypatch.delenv(FOOTER_READER_ENV, raising=False)
    before = footer_reader_actors(ray_local)
    assert build_text_dataset(corpus, seq_len=32).take(1)
    started = footer_reader_actors(ray_local) - before
    assert len(started) == 1
    assert FOOTER_READER_ENV not in os.environ  # nothing left behind for the next read

    monkeypatch.setenv(FOOTER_READER_ENV, "2")
    before |= started
    assert build_text_dataset(corpus, seq_len=32).take(1)
    assert len(footer_reader_actors(ray_local) - before) == 2
    assert os.environ[FOOTER_READER_ENV] == "2"


def test_a_corpus_on_object_storage_reads_the_same_rows_as_on_local_disk(
    ray_local, corpus, s3_prefix
):
    """The read lists the files itself (to size the footer-reader pool) and hands Ray Data the
    filesystem: a corpus directory on S3 gives the packed rows the local file gives."""
    from shared.data.source import build_text_dataset

    remote = storage.join(s3_prefix, "corpus")
    storage.write_bytes(storage.join(remote, "part-0.parquet"), Path(corpus.dataset).read_bytes())
    on_s3 = TextSource(dataset=remote, tokenizer=corpus.tokenizer)

    def rows(source):
        batches = build_text_dataset(source, seq_len=32).iter_batches(batch_format="numpy")
        return sorted(tuple(row) for b in batches for row in b["input_ids"])  # any block order

    local = rows(corpus)
    assert len(local) > 100 and rows(on_s3) == local


def test_a_driver_killed_while_packing_leaves_nothing_the_next_run_uses(tmp_path):
    """SIGKILL the ddp driver (and the local cluster it started) while its Ray Data pass is
    writing chunk files: the rerun packs again from scratch and trains."""
    # Enough generated text that the pass writes for seconds, in many small chunk files.
    data = ("smoke_rows=4000", "pack_chunk_rows=8", "max_steps=2", "warmup_steps=0",
            "eval_every=0", "run_name=k")  # fmt: skip
    cmd = [sys.executable, str(REPO / "jobs/ddp/main.py"), f"storage_path={tmp_path}", *data]
    packed_root = Path(tmp_path, "_data", "packed")
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.time() + 300
        while len(list(packed_root.glob(".*.tmp-*/chunk-*.parquet"))) < 20:
            assert proc.poll() is None and time.time() < deadline, "the pass never started"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not list(packed_root.glob("*/_MANIFEST.json"))  # nothing was published
    result = run_job("ddp", *data, storage=tmp_path)
    assert result.returncode == 0, result.output[-3000:]
    assert "data: tokenised and packed" in result.stdout  # rebuilt, not reused
    (manifest,) = packed_root.glob("*/_MANIFEST.json")
    chunks = sorted(p.name for p in manifest.parent.glob("chunk-*.parquet"))
    assert chunks == [f"chunk-{i:06d}.parquet" for i in range(len(chunks))]
    assert result.summary["data_read_amplification"] <= 1.05
