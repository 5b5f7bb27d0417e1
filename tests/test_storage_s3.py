"""The storage layer's additions for object storage, on a real S3 server (SeaweedFS)."""

from __future__ import annotations

import os

from shared import storage
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
