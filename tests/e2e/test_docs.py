"""The fault_tolerance README quotes what its default run prints: checked against a real run
(default smoke profile: rank 1 dies after step 13, Ray Train restarts the group)."""

from __future__ import annotations

import re

import pytest
from conftest import REPO, run_job
from unit.test_docs import FENCE, as_pattern

pytestmark = pytest.mark.e2e

ANSI = re.compile(r"\x1b\[[0-9;]*m")
PREFIX = re.compile(r"^\([^)]*\) ")


def test_the_fault_tolerance_readme_shows_what_the_default_run_prints(tmp_path):
    result = run_job("fault_tolerance", storage=tmp_path, timeout=1200, interleaved=True)
    assert result.returncode == 0, result.output[-3000:]
    assert result.summary["failures_recovered"] == 1
    printed = [PREFIX.sub("", ANSI.sub("", line)) for line in result.output.splitlines()]
    readme = (REPO / "jobs" / "fault_tolerance" / "README.md").read_text()
    block = next(b for b in FENCE.findall(readme) if "FAULT INJECTION" in b)
    position = 0
    for quoted in block.splitlines():
        pattern = as_pattern(quoted)
        hits = [i for i, line in enumerate(printed) if i >= position and pattern.fullmatch(line)]
        assert hits, (quoted, printed)
        position = hits[0] + 1
    # One short block: no traceback on screen, and the whole run stays short.
    assert not [line for line in printed if "Traceback" in line or "ActorDiedError" in line]
    assert len(printed) < 100, "\n".join(printed)  # ~230 before the output filter
    assert printed[-1].startswith("SUMMARY {")
