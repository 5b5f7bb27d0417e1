"""tp2d's full profile reads Wikitext-103's train split only: the hub directory also holds the
validation and test parquet files, and a directory read takes all three."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ci import jobspec
from shared.data import expand_pattern

SPLIT_FILES = [
    "train-00000-of-00002.parquet",
    "train-00001-of-00002.parquet",
    "validation-00000-of-00001.parquet",
    "test-00000-of-00001.parquet",
]


def test_a_split_pattern_selects_only_that_splits_files(tmp_path):
    for name in SPLIT_FILES:
        pq.write_table(pa.table({"text": [name]}), tmp_path / name)
    train = expand_pattern(str(tmp_path / "train-*.parquet"))
    assert [p.rsplit("/", 1)[1] for p in train] == SPLIT_FILES[:2]
    rows = pq.read_table(train)["text"].to_pylist()
    assert rows == SPLIT_FILES[:2]  # no validation or test rows
    assert expand_pattern(str(tmp_path)) == str(tmp_path)  # a plain path is left alone
    with pytest.raises(FileNotFoundError, match="no files match"):
        expand_pattern(str(tmp_path / "dev-*.parquet"))


def test_a_pattern_goes_through_the_given_filesystem():
    """The hub path: HfFileSystem is an fsspec filesystem like this in-memory one."""
    from fsspec.implementations.memory import MemoryFileSystem

    fs = MemoryFileSystem()
    for name in SPLIT_FILES:
        fs.pipe(f"/datasets/wikitext/wikitext-103-raw-v1/{name}", b"")
    files = expand_pattern("/datasets/wikitext/wikitext-103-raw-v1/train-*.parquet", fs)
    assert [f.rsplit("/", 1)[1] for f in files] == SPLIT_FILES[:2]


def test_tp2d_full_profile_reads_the_train_split():
    dataset = jobspec.load("tp2d").settings()["dataset"]
    assert dataset == "hf://datasets/Salesforce/wikitext/wikitext-103-raw-v1/train-*.parquet"
