"""Ray Data's streaming_split, what Ray Train does with `datasets=`, on a real local cluster."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from shared.data import TextSource, build_text_dataset, generate_news_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> TextSource:
    return generate_news_corpus(str(tmp_path_factory.mktemp("data")), num_rows=400, seed=0)


def test_streaming_split_gives_equal_disjoint_shards_covering_the_data(ray_local, corpus):
    """What Ray Train does with `datasets=`: split the lazy pipeline across 2 workers."""
    seq_len, batch = 32, 4
    ds = build_text_dataset(corpus, seq_len)
    everything = np.concatenate([b["input_ids"] for b in ds.iter_batches(batch_size=None)])
    shards = ds.streaming_split(2, equal=True)

    got: dict[int, list[np.ndarray]] = {}

    def consume(i):  # streaming_split shards must be read concurrently
        got[i] = [b["input_ids"] for b in shards[i].iter_batches(batch_size=batch, drop_last=True)]

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert len(got[0]) == len(got[1]) > 0  # equal: DDP ranks take the same number of steps
    assert all(b.shape == (batch, seq_len) and b.dtype == np.int64 for i in got for b in got[i])
    rows = {tuple(r) for i in got for b in got[i] for r in b}
    everything_rows = [tuple(r) for r in everything]
    assert rows <= set(everything_rows)
    # disjoint: no block is served to both workers, and at most batch-1 per shard are dropped
    assert sum(len(b) for i in got for b in got[i]) == len(rows)
    assert len(rows) >= len(everything_rows) - 2 * batch
