"""The storage layer on a real S3 server (SeaweedFS): append logs, the checks a driver makes
before any cluster (a dataset it cannot reach, a split pattern) and init_from from a bucket."""

from __future__ import annotations

import os

import pytest
import torch
from unit.test_data_split import assert_the_dataset_check_accepts_a_split_pattern
from unit.test_init_from import EOS, SMOKE_VOCAB, _cfg, sources  # noqa: F401 (a fixture)
from unit.test_run_contract import dataset_error

from shared import storage
from shared.checkpoint import init_from
from shared.config import ConfigError
from shared.runtime.driver import checkpoint_uri


def test_append_log_on_s3_continues_the_object_and_writes_on_flush(s3_prefix):
    path = storage.join(s3_prefix, "metrics.jsonl")
    storage.write_text(path, "1\n")  # a previous run's rows
    log = storage.AppendLog(path, flush_every_s=float("inf"))
    log.append("2\n")
    log.append("3\n")
    assert storage.read_text(path) == "1\n"  # nothing rewritten before the flush
    log.flush()
    assert storage.read_text(path) == "1\n2\n3\n"
    log.append("4\n")
    log.flush()
    assert storage.read_text(path) == "1\n2\n3\n4\n"


def test_append_log_on_local_disk_appends_at_once(tmp_path):
    path = str(tmp_path / "run" / "metrics.jsonl")
    log = storage.AppendLog(path)
    log.append("1\n")
    assert storage.read_text(path) == "1\n"


def test_node_local_dir_mirrors_a_uri_on_this_node(tmp_path):
    assert storage.node_local_dir(str(tmp_path)) == str(tmp_path)
    mirror = storage.node_local_dir("s3://bucket/runs/ddp/a")
    assert not storage.is_remote(mirror) and mirror.endswith(os.path.join("s3", "bucket", "runs",
                                                                          "ddp", "a"))  # fmt: skip


def test_checkpoint_uri_keeps_the_scheme():
    assert checkpoint_uri("s3://b/runs/ddp/a", "b/runs/ddp/a/step_000008") == (
        "s3://b/runs/ddp/a/step_000008"
    )
    assert checkpoint_uri("/r/ddp/a", "/r/ddp/a/step_000008") == "/r/ddp/a/step_000008"


def test_a_dataset_on_storage_it_cannot_reach_is_one_sentence(s3_server, monkeypatch):
    """pyarrow's OSError (here: a wrong secret key) once escaped as a traceback."""
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-key")
    message = dataset_error("s3://denied/corpus/train.parquet")
    assert message.startswith("dataset 's3://denied/corpus/train.parquet' cannot be listed (")
    assert "ACCESS_DENIED" in message and message.endswith(").")


def test_the_dataset_check_accepts_a_split_pattern_on_s3(s3_prefix):
    assert_the_dataset_check_accepts_a_split_pattern(s3_prefix)


def test_init_from_on_s3_resolves_verifies_and_reads_the_same_weights(
    sources,  # noqa: F811 (the fixture imported above)
    s3_prefix,
    tmp_path,
):
    """A run directory in a bucket: the newest checkpoint verifies on object storage, its
    files come down to a temporary directory, and a half-written copy is refused."""
    from shared import storage

    remote_run = storage.join(s3_prefix, "ddp", "src")
    storage.upload_dir(str(sources["run"]), remote_run)
    cfg = _cfg(tmp_path, remote_run)
    init_from.check(cfg, vocab_size=SMOKE_VOCAB, eos_token_id=EOS)
    assert cfg.init_checkpoint == storage.join(remote_run, "step_000008")
    source = init_from.describe(cfg.init_checkpoint)
    with init_from.open_source(source) as local:
        remote_weights = init_from.source_state_dict(source, local)
    local_source = init_from.describe(str(sources["run"] / "step_000008"))
    with init_from.open_source(local_source) as local:
        local_weights = init_from.source_state_dict(local_source, local)
    assert remote_weights.keys() == local_weights.keys()
    assert all(torch.equal(remote_weights[k], local_weights[k]) for k in local_weights)

    half = storage.join(s3_prefix, "half", "step_000008")
    storage.upload_dir(str(sources["no_manifest"]), half)
    with pytest.raises(ConfigError, match="incomplete or damaged checkpoint .manifest/rank0"):
        init_from.check(_cfg(tmp_path, half), SMOKE_VOCAB, EOS)
