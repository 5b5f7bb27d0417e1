"""Docs that cannot drift: every `make <target>` the docs name exists, and the commands the
README quotes with their output (`$ command` then output lines in a code block) print that
output now. `…` in a quoted line stands for any text."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "jobs").glob("*/README.md"))]  # fmt: skip
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")


def code_of(text: str) -> list[str]:
    """Fenced blocks and inline code spans: where commands are, unlike prose ("make it")."""
    blocks = FENCE.findall(text)
    prose = FENCE.sub("", text)
    return blocks + INLINE.findall(prose)


def makefile_targets() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z0-9-]*):", text, re.M))


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_make_target_the_docs_name_exists(doc: Path):
    named = {
        m
        for code in code_of(doc.read_text())
        for m in re.findall(r"\bmake ([a-z][a-z0-9-]*)", code)
    }  # noqa: E501
    assert named - makefile_targets() == set()


def test_the_docs_name_no_internal_tracker_references():
    for doc in DOCS:
        found = re.search(r"\b(issue|task) #?\d+", doc.read_text(), re.I)
        assert not found, f"{doc}: {found and found.group(0)}"


def quoted_commands() -> list[tuple[str, list[str]]]:
    """(command, expected output lines) for each `$ command` in README.md's code blocks."""
    found = []
    for block in FENCE.findall((REPO / "README.md").read_text()):
        lines = block.splitlines()
        for i, line in enumerate(lines):
            if line.startswith("$ "):
                output = []
                for following in lines[i + 1 :]:
                    if following.startswith("$ "):
                        break
                    output.append(following)
                found.append((line[2:], output))
    return found


def as_pattern(quoted: str) -> re.Pattern:
    return re.compile(".*".join(re.escape(part) for part in quoted.split("…")))


@pytest.mark.parametrize("command, expected", quoted_commands(), ids=lambda v: str(v)[:40])
def test_quoted_output_is_what_the_command_prints(command, expected):
    """These commands fail before any cluster starts, so they are quick."""
    assert expected, command
    proc = subprocess.run(command, shell=True, cwd=REPO, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    printed = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode != 0
    for line in expected:
        assert any(as_pattern(line).fullmatch(p) for p in printed), (line, printed)
