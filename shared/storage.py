"""One storage layer for every file a run writes or reads: local paths and object stores.

Paths are plain local paths or URIs that ``pyarrow.fs`` resolves (``s3://bucket/key``,
``gs://...``, ``file:///...``). S3 credentials and endpoint come only from the standard AWS
variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
``AWS_REGION``), so the same run works against AWS, GCS's S3 API, MinIO or SeaweedFS.

Write-then-promote lives here. On local disk a file or directory is written under a temp
name and renamed (atomic on POSIX). On object storage a single object PUT is atomic (readers
see the old object or the whole new one), and renames are copies, so a *directory* is
complete only when the marker or manifest its writer puts last is there.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import tempfile
import time
from collections.abc import Iterator
from functools import cache

import pyarrow.fs as pafs


def is_remote(path: str) -> bool:
    """True for ``scheme://`` URIs other than ``file://`` (object stores, remote filesystems)."""
    return "://" in path and not path.startswith("file://")


def local_path(path: str) -> str:
    """A local path or ``file://`` URI as a plain absolute path."""
    return os.path.abspath(path[len("file://") :] if path.startswith("file://") else path)


def join(base: str, *parts: str) -> str:
    """``os.path.join`` for local paths, ``/``-joining for URIs."""
    if is_remote(base):
        return posixpath.join(base, *parts)
    return os.path.join(base, *parts)


@cache
def _filesystem_for(scheme_and_bucket: str) -> pafs.FileSystem:
    fs, _ = pafs.FileSystem.from_uri(scheme_and_bucket)
    return fs


def filesystem(path: str) -> tuple[pafs.FileSystem, str]:
    """The pyarrow filesystem for ``path`` and the path inside it."""
    if not is_remote(path):
        return pafs.LocalFileSystem(), local_path(path)
    scheme, rest = path.split("://", 1)
    bucket = rest.split("/", 1)[0]
    fs = _filesystem_for(f"{scheme}://{bucket}")
    return fs, rest.rstrip("/")


def exists(path: str) -> bool:
    fs, inner = filesystem(path)
    return fs.get_file_info(inner).type != pafs.FileType.NotFound


def is_dir(path: str) -> bool:
    fs, inner = filesystem(path)
    return fs.get_file_info(inner).type == pafs.FileType.Directory


def listdir(path: str) -> list[str]:
    """Names (not paths) directly under ``path``, sorted; [] if it does not exist."""
    fs, inner = filesystem(path)
    if fs.get_file_info(inner).type != pafs.FileType.Directory:
        return []
    infos = fs.get_file_info(pafs.FileSelector(inner, allow_not_found=True))
    return sorted(posixpath.basename(info.path.rstrip("/")) for info in infos)


def makedirs(path: str) -> None:
    fs, inner = filesystem(path)
    fs.create_dir(inner, recursive=True)


def read_bytes(path: str) -> bytes:
    fs, inner = filesystem(path)
    with fs.open_input_stream(inner) as f:
        return f.read()


def read_text(path: str) -> str:
    return read_bytes(path).decode()


def write_bytes(path: str, data: bytes) -> None:
    """Write a whole file so no reader ever sees part of it (temp + rename locally; a single
    PUT on object storage)."""
    if is_remote(path):
        fs, inner = filesystem(path)
        with fs.open_output_stream(inner) as f:
            f.write(data)
        return
    path = local_path(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise


def write_text(path: str, text: str) -> None:
    write_bytes(path, text.encode())


def write_json_atomic(path: str, text: str) -> None:
    """Write JSON ``text`` to ``path`` atomically (see :func:`write_bytes`)."""
    write_text(path, text)


def append_text(path: str, text: str) -> None:
    """Append to a log file. Object stores cannot append: the object is rewritten, so keep
    such logs small (one line per attempt or event, not per step)."""
    if not is_remote(path):
        path = local_path(path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "a") as f:
            f.write(text)
        return
    old = read_text(path) if exists(path) else ""
    write_text(path, old + text)


def remove(path: str) -> None:
    """Delete a file, or a directory tree; no error if it is already gone."""
    fs, inner = filesystem(path)
    kind = fs.get_file_info(inner).type
    if kind == pafs.FileType.Directory:
        fs.delete_dir(inner)
    elif kind != pafs.FileType.NotFound:
        fs.delete_file(inner)


def upload_dir(local_dir: str, dest: str) -> None:
    """Copy a local directory tree to ``dest`` (local or remote)."""
    if not is_remote(dest):
        shutil.copytree(local_dir, local_path(dest), dirs_exist_ok=True)
        return
    fs, inner = filesystem(dest)
    pafs.copy_files(local_dir, inner, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)  # fmt: skip


def download_dir(src: str, local_dir: str) -> None:
    """Copy the tree at ``src`` (local or remote) into a local directory."""
    if not is_remote(src):
        shutil.copytree(local_path(src), local_dir, dirs_exist_ok=True)
        return
    fs, inner = filesystem(src)
    os.makedirs(local_dir, exist_ok=True)
    pafs.copy_files(inner, local_dir, source_filesystem=fs,
                    destination_filesystem=pafs.LocalFileSystem())  # fmt: skip


@contextlib.contextmanager
def atomic_directory(final: str) -> Iterator[str]:
    """Yield a temp dir beside ``final`` (local disk); rename it to ``final`` only if the
    block succeeds.

    The temp dir is a sibling so the rename stays on one filesystem (atomic on POSIX). If the
    block raises, the temp dir is removed and ``final`` is untouched. If another process won
    the race and ``final`` already exists, ours is discarded.
    """
    parent = os.path.dirname(os.path.abspath(final))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.tmp-", dir=parent)
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not os.path.isdir(final):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def node_local_dir(path: str) -> str:
    """A directory on this node's disk for ``path``: ``path`` itself when it is local, else a
    mirror under the temp directory (for what only makes sense per node, such as process
    records, or what is written locally and uploaded later, such as TensorBoard events)."""
    if not is_remote(path):
        return local_path(path)
    scheme, rest = path.split("://", 1)
    return os.path.join(tempfile.gettempdir(), "ray-train-templates", "node-local", scheme, rest)


class AppendLog:
    """A line log (metrics.jsonl, sample logs) on local disk or object storage.

    Local: every ``append`` goes straight to the file. Object stores cannot append, so there
    the log keeps its text in memory (starting from what the object already holds, so a
    resumed run continues it) and rewrites the object on ``flush``: at most every
    ``flush_every_s`` seconds from ``append``, and whenever the caller says (a checkpoint,
    the end of the run). Lines appended since the last flush are lost if the process dies.
    """

    def __init__(self, path: str, flush_every_s: float = 10.0):
        self.path = path
        self.remote = is_remote(path)
        self.flush_every_s = flush_every_s
        self._text: list[str] = []
        self._dirty = False
        self._last_flush = time.monotonic()
        if self.remote and exists(path):
            self._text.append(read_text(path))

    def append(self, text: str) -> None:
        if not self.remote:
            append_text(self.path, text)
            return
        self._text.append(text)
        self._dirty = True
        if time.monotonic() - self._last_flush >= self.flush_every_s:
            self.flush()

    def flush(self) -> None:
        if self.remote and self._dirty:
            self._text = ["".join(self._text)]
            write_text(self.path, self._text[0])
            self._dirty = False
        self._last_flush = time.monotonic()
