"""Write-then-promote helpers: nothing half-written ever appears under its final name."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def atomic_directory(final: str) -> Iterator[str]:
    """Yield a temp dir beside ``final``; rename it to ``final`` only if the block succeeds.

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


def write_json_atomic(path: str, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file + rename."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(os.path.abspath(path)))
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
