"""tp2d's full profile reads Wikitext-103's train split only: the hub directory also holds the
validation and test parquet files, and a directory read takes all three."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ci import jobspec
from shared import storage
from shared.config import ConfigError
from shared.data import TextSource, check_text_dataset, matching_files, parquet_files

SPLIT_FILES = [
    "train-00000-of-00002.parquet",
    "train-00001-of-00002.parquet",
    "validation-00000-of-00001.parquet",
    "test-00000-of-00001.parquet",
]


def write_splits(directory: str) -> None:
    for name in SPLIT_FILES:
        buffer = pa.BufferOutputStream()
        pq.write_table(pa.table({"text": [name]}), buffer)
        storage.write_bytes(storage.join(directory, name), buffer.getvalue().to_pybytes())


def test_a_split_pattern_selects_only_that_splits_files(tmp_path):
    write_splits(str(tmp_path))
    fs, train = matching_files(str(tmp_path / "train-*.parquet"))
    assert [p.rsplit("/", 1)[1] for p in train] == SPLIT_FILES[:2]
    rows = pq.read_table(train, filesystem=fs)["text"].to_pylist()
    assert rows == SPLIT_FILES[:2]  # no validation or test rows
    with pytest.raises(ConfigError, match="matches no files"):
        matching_files(str(tmp_path / "dev-*.parquet"))


def assert_the_dataset_check_accepts_a_split_pattern(directory: str) -> None:
    """tp2d's full profile names a pattern; the check before the cluster once looked the
    pattern up as a literal path and refused every run ("does not exist")."""
    write_splits(directory)
    check_text_dataset(TextSource(dataset=f"{directory}/train-*.parquet", tokenizer=""))
    _, files = parquet_files(f"{directory}/validation-*.parquet")
    assert [f.rsplit("/", 1)[1] for f in files] == SPLIT_FILES[2:3]
    with pytest.raises(ConfigError, match="matches no files"):
        check_text_dataset(TextSource(dataset=f"{directory}/dev-*.parquet", tokenizer=""))


def test_the_dataset_check_accepts_a_split_pattern(tmp_path):
    assert_the_dataset_check_accepts_a_split_pattern(str(tmp_path))  # s3://: e2e/test_storage_s3


def test_a_pattern_goes_through_the_given_filesystem():
    """The hub path: HfFileSystem is an fsspec filesystem like this in-memory one, and the
    pyarrow wrapper around it is what hf:// datasets are listed and read through."""
    import pyarrow.fs as pafs
    from fsspec.implementations.memory import MemoryFileSystem

    memory = MemoryFileSystem()
    for name in SPLIT_FILES:
        memory.pipe(f"/datasets/wikitext/wikitext-103-raw-v1/{name}", b"")
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(memory))
    _, files = matching_files("/datasets/wikitext/wikitext-103-raw-v1/train-*.parquet", fs)
    assert [f.rsplit("/", 1)[1] for f in files] == SPLIT_FILES[:2]


def test_tp2d_full_profile_reads_the_train_split():
    dataset = jobspec.load("tp2d").settings()["dataset"]
    assert dataset == "hf://datasets/Salesforce/wikitext/wikitext-103-raw-v1/train-*.parquet"
