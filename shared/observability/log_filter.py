"""Keep the driver's output about what matters.

Ray forwards every worker's and actor's stdout/stderr to the driver (``log_to_driver``),
which prints them through ``sys.stdout``/``sys.stderr``. Some of those lines are known to be
benign yet look like failures on every healthy run; an injected failure prints ~150 lines of
the same tracebacks. This module wraps the driver's two streams while the cluster is up:

* ``BENIGN``: single lines hidden everywhere. Each entry names the upstream message and
  why it is harmless, so it is easy to drop when Ray or torch fixes it.
* tracebacks and Ray Train's error dumps from workers and the controller are collapsed to
  one line pointing at the Ray log files, which keep the full text. Ray Train's decision
  (``[FailurePolicy] RETRY``, the error count, the new worker group) stays visible.

``verbose=true`` turns the filter off. Nothing is hidden from the log files.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Benign:
    pattern: str
    upstream: str  # the message it hides, where it comes from, and why it is harmless


BENIGN = (
    Benign(
        r"core_worker\.cc:\d+: Actor with class name: 'PreemptionWatcher'.*max_restarts > 0",
        "Ray 2.60 core_worker, logged at ERROR level on every Ray Train V2 run: the Train "
        "controller's PreemptionWatcher actor has max_restarts and constructor arguments in "
        "the object store (ray-project/ray#53727); nothing fails.",
    ),
    Benign(
        r"socket\.cpp:\d+\] \[c10d\] The hostname of the client socket cannot be retrieved",
        "torch c10d TCPStore warning when the peer address (127.0.0.1) has no reverse-DNS "
        "name, as on loopback-only hosts; the connection itself works.",
    ),
    Benign(
        r"RayDeprecationWarning: `ExecutionOptions\.exclude_resources` is deprecated",
        "Ray Data 2.60 deprecation warning triggered by Ray Train 2.60's own DatasetManager, "
        "not by the templates.",
    ),
    Benign(
        r"^\s*self\.exclude_resources = exclude_resources$",
        "the source line Python prints under the deprecation warning above.",
    ),
    Benign(
        r"WARNING: \d+ PYTHON worker processes have been started on node",
        "raylet notice that more Python workers started than CPUs: expected with fractional "
        "CPUs per training worker and Ray Data tasks on a small machine.",
    ),
    Benign(
        r"^ERROR: External init callback must run in same thread as registerClient",
        "Kineto (torch.profiler) on CPU, with profile_steps=a-b: Ray Train runs the training "
        "function in a thread, not the one that registered the profiler; the trace is complete.",
    ),
    Benign(
        r"^generated new fontManager$",
        "matplotlib builds its font cache on first use (drawing loss_curve.png).",
    ),
)
_BENIGN = re.compile("|".join(f"(?:{b.pattern})" for b in BENIGN))

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PREFIX = re.compile(r"^\((?P<source>[^)]*)\) ?(?P<message>.*)$")
_REPEATED = re.compile(r" \[repeated \d+x across cluster\].*$")
# The first line of a traceback or of Ray Train's multi-line error report.
_BLOCK_START = re.compile(
    r"^(Error in training function:|Error: Training failed due to worker errors:"
    r"|Graceful shutdown of backend failed|Traceback \(most recent call last\):"
    r"|Exception in thread |ray\.train\.WorkerGroupError:)"
)
# Lines that end a block: what Ray Train decided and did next.
_BLOCK_END = re.compile(
    r"^(\[FailurePolicy\]|  Source:|  Error count:|Started training worker group"
    r"|Attempting to start training worker group|- \(ip=)"
)


class OutputFilter:
    """Decides line by line what the driver prints (shared by stdout and stderr)."""

    def __init__(self) -> None:
        self.blocks: dict[str, str] = {}  # source -> the line that opened its hidden block
        self.hidden = 0

    def keep(self, line: str) -> bool:
        plain = _REPEATED.sub("", _ANSI.sub("", line))
        match = _PREFIX.match(plain)
        if _BENIGN.search(match["message"] if match else plain):
            self.hidden += 1
            return False
        if match is None:
            return True  # the driver's own lines
        source, message = match["source"], match["message"]
        opened = self.blocks.get(source)
        if opened is not None:
            if _BLOCK_END.match(message):
                del self.blocks[source]
                return True
            # A worker's "Error in training function:" traceback ends with an empty line.
            if opened.startswith("Error in training function") and not message.strip():
                del self.blocks[source]
            self.hidden += 1
            return False
        if _BLOCK_START.match(message):
            self.blocks[source] = message
            self.hidden += 1
            return False
        return True


class FilteredStream:
    """A text stream that passes whole lines through ``OutputFilter`` and replaces each
    hidden block with one pointer line."""

    def __init__(self, stream, output_filter: OutputFilter, pointer: str):
        self.stream = stream
        self.filter = output_filter
        self.pointer = pointer
        self.pending = ""
        self.lock = threading.RLock()  # re-entrant: a signal handler may print mid-write
        self.pointed: set[str] = set()  # sources whose hidden text was already pointed at

    def write(self, text: str) -> int:
        with self.lock:
            self.pending += text
            *lines, self.pending = self.pending.split("\n")
            for line in lines:
                blocks_before = len(self.filter.blocks)
                if self.filter.keep(line):
                    self.stream.write(line + "\n")
                elif len(self.filter.blocks) > blocks_before:
                    match = _PREFIX.match(_ANSI.sub("", line))
                    source = match["source"] if match else ""
                    if source not in self.pointed:  # one pointer per process is enough
                        self.pointed.add(source)
                        self.stream.write(f"({source}) {self.pointer}\n")
        return len(text)

    def flush(self) -> None:
        with self.lock:
            if self.pending:
                if self.filter.keep(self.pending):
                    self.stream.write(self.pending)
                self.pending = ""
            self.stream.flush()

    def __getattr__(self, name: str):  # isatty, fileno, encoding ...
        return getattr(self.stream, name)


@contextlib.contextmanager
def filtered_output(logs_dir: str, enabled: bool = True) -> Iterator[OutputFilter | None]:
    """Filter the driver's stdout and stderr inside the block (see module docstring)."""
    if not enabled:
        yield None
        return
    output_filter = OutputFilter()
    pointer = f"[traceback hidden; full text in {logs_dir}]"
    saved = sys.stdout, sys.stderr
    sys.stdout = FilteredStream(saved[0], output_filter, pointer)
    sys.stderr = FilteredStream(saved[1], output_filter, pointer)
    try:
        yield output_filter
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved
