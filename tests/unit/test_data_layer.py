"""The data layer without Ray: epoch order, rank slices, position encoding, exact resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shared.data import (
    EpochReader,
    decode_consumed,
    encode_consumed,
    epoch_order,
    memory_rows,
    to_ranges,
    usable_samples,
)

N, CHUNK, SEQ = 203, 16, 4
BLOCKS = torch.arange(N * SEQ).reshape(N, SEQ)  # row i's tokens start at 4 * i


def reader(rank, world, micro, global_batch, seed=7):
    return EpochReader(memory_rows(BLOCKS, CHUNK), N, CHUNK, seed, reader=rank, readers=world,
                       batch=micro, global_batch=global_batch)  # fmt: skip


def trained_ids(readers, epoch, start=0, steps=None):
    """Sample ids per micro-step (all ranks together, rank order), up to ``steps`` micro-steps."""
    streams = [list(r.micro_batches(epoch, start)) for r in readers]
    out = []
    for t, parts in enumerate(zip(*streams, strict=True)):
        if steps is not None and t >= steps:
            break
        for _, ids, batch in parts:
            assert torch.equal(batch[:, 0] // SEQ, torch.from_numpy(ids))  # rows match ids
            out.append(ids)
    return np.concatenate(out)


def test_order_is_a_permutation_that_depends_on_seed_and_epoch_only():
    a = epoch_order(1, 0, N, CHUNK)
    assert sorted(a.tolist()) == list(range(N))
    assert np.array_equal(a, epoch_order(1, 0, N, CHUNK))
    assert not np.array_equal(a, epoch_order(1, 1, N, CHUNK))  # two epochs differ
    assert not np.array_equal(a, epoch_order(2, 0, N, CHUNK))
    # granularity: each chunk's samples are one contiguous run of the order, shuffled inside
    position = np.argsort(a)
    for chunk in range(-(-N // CHUNK)):
        where = position[chunk * CHUNK : (chunk + 1) * CHUNK]
        assert where.max() - where.min() == len(where) - 1


def test_same_seed_gives_the_same_global_batches_at_world_size_1_and_2():
    g = 16
    one = trained_ids([reader(0, 1, 8, g)], epoch=0)
    two = trained_ids([reader(r, 2, 4, g) for r in range(2)], epoch=0)
    four = trained_ids([reader(r, 4, 2, g) for r in range(4)], epoch=0)
    assert len(one) == usable_samples(N, g) == 192
    for other in (two, four):  # same samples in every global batch (order inside may differ)
        assert [sorted(one[i : i + g]) for i in range(0, 192, g)] == [
            sorted(other[i : i + g]) for i in range(0, 192, g)
        ]
    assert np.array_equal(one, epoch_order(7, 0, N, CHUNK)[:192])


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 4)])
def test_resume_at_another_world_size_trains_each_sample_exactly_once(before, after):
    g = 16
    start = 5 * g  # 5 global batches trained at `before` ranks
    first = [reader(r, before, g // before, g) for r in range(before)]
    done = trained_ids(first, epoch=0, steps=5)
    second = [reader(r, after, g // after, g) for r in range(after)]
    rest = trained_ids(second, epoch=0, start=start)
    both = np.concatenate([done, rest])
    assert len(both) == len(set(both.tolist())) == 192  # each once, the whole usable epoch
    assert set(both.tolist()) == set(epoch_order(7, 0, N, CHUNK)[:192].tolist())
    # every row read was trained: nothing read twice, nothing read and discarded
    read = sum(r.rows_read for r in second)
    assert read == sum(r.rows_trained for r in second) == 192 - start


def test_consumed_ranges_for_a_million_samples_stay_under_1_mb():
    n = 1_000_000
    rng = np.random.default_rng(0)
    worst = np.arange(0, n, 2)  # every other sample: 500,000 ranges
    arbitrary = epoch_order(3, 0, n, 4096)[: n // 2]  # half an epoch of a shuffled order
    cuts = np.sort(rng.choice(n, 2000, replace=False))
    ranges = np.concatenate([np.arange(a, b) for a, b in zip(cuts[::2], cuts[1::2], strict=True)])
    for ids in (worst, arbitrary, ranges, np.arange(n), np.zeros(0, dtype=np.int64)):
        record = encode_consumed(ids, n)
        size = len(json.dumps(record))
        assert size < 1_000_000, size
        assert np.array_equal(decode_consumed(record), np.unique(ids))
    assert len(json.dumps(encode_consumed(ranges, n))) < 20_000  # 1,000 ranges: a few kB


def test_to_ranges_merges_consecutive_ids():
    assert to_ranges(np.array([5, 1, 2, 3, 9, 10])).tolist() == [[1, 4], [5, 6], [9, 11]]


def test_a_read_that_stops_early_is_finished_before_its_last_batch():
    """The loop never asks past its last step, so the row source must be exhausted (Ray Data
    records its stats only then) by the time the last planned batch is handed out."""
    finished = []

    def rows(ids):
        yield from memory_rows(BLOCKS, CHUNK)(ids)
        finished.append(True)

    r = EpochReader(rows, N, CHUNK, 7, reader=0, readers=1, batch=4, global_batch=4)
    batches = r.micro_batches(0, 8, stop=40)
    positions = [next(batches)[0] for _ in range(8)]  # exactly the planned 8, no 9th next()
    assert positions == list(range(8, 40, 4))
    assert finished == [True]
    assert r.rows_read == r.rows_trained == 32


def test_a_ranks_read_is_a_few_large_tasks_not_one_per_chunk_file():
    """One read task per tiny chunk file made each epoch's first batch wait 30 s and more."""
    from shared.data import PackedDataset
    from shared.data.reader import READ_TASK_BYTES, read_tasks

    def packed(files: int, size: int) -> PackedDataset:
        names = tuple(f"chunk-{i:06d}.parquet" for i in range(files))
        return PackedDataset("/d", "k", files * 32, 64, 32, names, (size,) * files)

    assert read_tasks(packed(20, 8 << 10), list(range(0, 20, 2))) == 1  # a smoke slice
    big = packed(1000, 4 << 20)  # 4 GB of 4 MB chunk files: ~64 MB per task
    assert read_tasks(big, list(range(1000))) == -(-1000 * (4 << 20) // READ_TASK_BYTES) == 63
    assert read_tasks(big, [5]) == 1


def test_the_next_epochs_read_starts_during_this_epoch_and_trains_the_same_rows():
    """Each epoch's read used to start only when the loop asked for the epoch, so every epoch
    boundary stalled a rank for as long as a Ray Data read takes to start (3-9 s here)."""
    reads = []

    def rows(ids):
        reads.append(len(ids))
        yield from memory_rows(BLOCKS, CHUNK)(ids)

    g, usable = 16, usable_samples(N, 16)
    r = EpochReader(rows, N, CHUNK, 7, reader=1, readers=2, batch=8, global_batch=g)
    fresh = EpochReader(memory_rows(BLOCKS, CHUNK), N, CHUNK, 7, reader=1, readers=2, batch=8,
                        global_batch=g)  # fmt: skip
    stop = usable + 3 * g  # the loop's stop: the whole of epoch 0 and 3 steps of epoch 1
    want = list(fresh.micro_batches(1, 0, stop - usable))
    epoch0 = r.micro_batches(0, 0, stop)
    next(epoch0)
    # epoch 1's read is under way from epoch 0's first batch on, for exactly its rows
    assert r._read_ahead is not None
    assert r._read_ahead.ids.tolist() == np.concatenate([i for _, i, _ in want]).tolist()
    assert len(list(epoch0)) == usable // g - 1
    r._read_ahead._thread.join(timeout=10)
    assert reads == [usable // 2, 24]  # read ahead while no one waited on it
    second = list(r.micro_batches(1, 0, stop - usable))
    assert reads == [usable // 2, 24] and r.reads_started_early == 1  # not read again
    # the early read handed over exactly what a fresh read gives, rows matching ids
    assert [(p, i.tolist(), b.tolist()) for p, i, b in second] == [
        (p, i.tolist(), b.tolist()) for p, i, b in want
    ]
    assert r.rows_read == r.rows_trained == usable // 2 + 24


def test_an_early_read_nobody_asks_for_is_stopped():
    """A different call (another batch size, an abandoned epoch) cancels the early read, and
    its rows are never counted as read."""
    g, usable = 16, usable_samples(N, 16)
    r = reader(0, 1, 16, g)
    epoch = r.micro_batches(0, 0, usable + g)
    next(epoch)
    early = r._read_ahead
    assert early is not None
    epoch.close()  # abandoned mid-epoch (e.g. preemption)
    assert r._read_ahead is None
    early._thread.join(timeout=10)
    assert not early._thread.is_alive()
    assert r.rows_read == 16 and r.reads_started_early == 0


def test_ray_data_read_tasks_import_no_torch():
    """Ray Data's read tasks unpickle the reader's functions in fresh task processes: importing
    torch there (1.7 s) delayed every run's first batch by as much."""
    probe = "import sys, shared.data.reader; print('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.stdout.strip() == "False"
