"""Docs that cannot drift: every `make <target>` the docs name exists, the commands the
README quotes with their output (`$ command` then output lines in a code block) print that
output now, and every `error:`/`warning:` line the docs quote is one the code can print.
`…` in a quoted line stands for any text."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
        *sorted((REPO / "jobs").glob("*/README.md"))]  # fmt: skip
# Also a block indented under a list item.
FENCE = re.compile(r"^ *```[^\n]*\n(.*?)^ *```", re.S | re.M)
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
        found = re.search(r"\b(issues?|tasks?) #?\d+|(?<![\w/])#\d+\b", doc.read_text(), re.I)
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


# ------------------------------------------------------------------------------------------
# Quoted error lines come from the code. A quote and a message in the code are both patterns
# (`…` in the quote, an f-string's fields in the code stand for any text); a quote passes when
# it can be split into pieces each of which some message can print.

WILDCARD = None
MESSAGE_CODE = ["shared/**/*.py", "jobs/*/main.py", "ci/*.py", "benchmarks/*.py"]


def pattern_tokens(text: str, wildcards: re.Pattern) -> tuple:
    """Characters, with each wildcard (and a run of them) as one WILDCARD token."""
    tokens: list = []
    for i, part in enumerate(wildcards.split(text)):
        if i and tokens[-1:] != [WILDCARD]:
            tokens.append(WILDCARD)
        tokens.extend(part)
    return tuple(tokens)


def code_messages() -> list[tuple]:
    """Every string literal of the code as a pattern: an f-string's fields are wildcards."""
    found = set()
    for glob in MESSAGE_CODE:
        for path in REPO.glob(glob):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.JoinedStr):
                    text = "".join(v.value if isinstance(v, ast.Constant) else "\0"
                                   for v in node.values)  # fmt: skip
                elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                    text = node.value
                else:
                    continue
                text = re.sub(r"^(error|warning): ", "", text)  # as in printable()
                found.add(pattern_tokens(text, re.compile("\0+")))
    return sorted(found, key=len)


def literal_chunks(tokens: tuple) -> list[str]:
    text = "".join("\0" if t is WILDCARD else t for t in tokens)
    return [chunk for chunk in text.split("\0") if chunk]


def piece_ends(quote: tuple, start: int, message: tuple) -> set[int]:
    """Where a piece of ``quote`` starting at ``start`` can end if ``message`` printed it:
    the two patterns must be able to stand for the same text."""
    ends, seen, todo = set(), set(), [(start, 0)]
    while todo:
        a, b = todo.pop()
        if (a, b) in seen:
            continue
        seen.add((a, b))
        q = quote[a] if a < len(quote) else ""
        m = message[b] if b < len(message) else ""
        if b == len(message):
            ends.add(a)
        if q is WILDCARD:
            todo += [(a + 1, b)] + ([(a, b + 1)] if b < len(message) else [])
        if m is WILDCARD:
            todo += [(a, b + 1)] + ([(a + 1, b)] if a < len(quote) else [])
        if q and m and q is not WILDCARD and m is not WILDCARD and q == m:
            todo.append((a + 1, b + 1))
    return ends


def printable(quote: str, messages: list[tuple]) -> bool:
    # "error: " and an exception's class name are added by the driver around the message.
    quote = re.sub(r"^(error|warning): ([A-Z][A-Za-z]+: )?", "", quote)
    tokens = pattern_tokens(quote, re.compile(r"…|\.\.\."))
    text = "".join(literal_chunks(tokens))
    # Candidates: messages with a distinctive literal part (8+ characters) that the quote has.
    candidates = [m for m in messages
                  if any(len(c) >= 8 and c in text for c in literal_chunks(m))]  # fmt: skip
    reached, todo = {0}, [0]
    while todo:
        start = todo.pop()
        for message in candidates:
            # A later piece (the hint after a message) starts with text both spell out, between
            # two spelled-out characters of the quote: a quote's `…` cannot hide a missing part.
            if start and not (message and tokens[start : start + 1] == message[:1] != (WILDCARD,)):
                continue
            ends = {e for e in piece_ends(tokens, start, message)
                    if e == len(tokens) or WILDCARD not in tokens[e - 1 : e + 1]}  # fmt: skip
            for end in ends - reached:
                reached.add(end)
                todo.append(end)
    return len(tokens) in reached


def error_lines_in(text: str) -> list[str]:
    """Each `error: …` / `warning: …` line a doc quotes, in code blocks or spans (a span that
    the paragraph wraps is joined again)."""
    lines = [line.strip() for block in FENCE.findall(text) for line in block.splitlines()]
    spans = re.findall(r"`((?:error|warning): [^`]+)`", FENCE.sub("", text))
    return [line for line in lines + [" ".join(span.split()) for span in spans]
            if re.match(r"(error|warning): ", line)
            and len(re.sub(r"…|\.\.\.", "", line)) > 20]  # fmt: skip


def quoted_error_lines() -> list[tuple[str, str]]:
    """(doc, line) for each error or warning line the docs quote."""
    return [(str(doc.relative_to(REPO)), line) for doc in DOCS
            for line in error_lines_in(doc.read_text())]  # fmt: skip


def test_error_lines_are_read_from_code_blocks_and_spans_not_prose():
    text = "\n".join([
        "A bad value stops it:", "```", '$ make run-local ARGS="num_workers=-1"',
        "error: num_workers must be >= 1 (got -1).", "```",
        "* A block indented under a list item:", "  ```",
        "  warning: checkpoint step_000008 fails verification: …", "  ```",
        "It says `error: dataset '…' does not",
        "exist.` and stops; error: in prose is no quote, and `error: …` alone says nothing.",
    ])  # fmt: skip
    assert error_lines_in(text) == [
        "error: num_workers must be >= 1 (got -1).",
        "warning: checkpoint step_000008 fails verification: …",
        "error: dataset '…' does not exist.",
    ]


def test_a_quote_no_code_prints_is_refused():
    """A reworded message, an invented hint, a negated clause: each fails the check below."""
    messages = code_messages()
    assert printable("error: num_workers must be >= 1 (got -1).", messages)
    made_up = ["error: num_workers must be at least 1 (got -1).",
               "error: tp (3) must divide the attention heads of llama-tiny (4); use tp=2.",
               "error: training diverged at step 2 (loss nan); this step was saved"]  # fmt: skip
    for line in made_up:
        assert not printable(line, messages), line


# The one-line errors a user meets, each quoted where the docs explain it (checked below
# against the code): (doc, how the quoted line starts).
DOCUMENTED_ERRORS = [
    ("README.md", "error: num_workers must be >= 1 (got -1)."),  # a bad setting
    ("README.md", "error: run … is already being trained by another driver"),  # its lease
    ("README.md", "error: run ddp/exp1 was trained with seq_len=64 and this start has"),
    ("README.md", "error: init_from runs/fsdp/a/step_000020 is an incomplete or damaged"),
    ("docs/observability.md", "error: TrainingDiverged: training diverged at step 2 "),
    ("docs/planner.md", "error: gpt2-xl with dp=4 does not fit the T4: "),
    ("jobs/fault_tolerance/README.md", "error: training failed and Ray Train gave up after "),
    ("jobs/fault_tolerance/README.md", "warning: checkpoint step_000008 fails verification: "),
    ("jobs/fault_tolerance/README.md", "error: elastic world size 3 (min_workers=1..num_work"),
    ("jobs/tp2d/README.md", "error: tp (3) must divide the attention heads of llama-tiny (4)."),
]


@pytest.mark.parametrize("doc, start", DOCUMENTED_ERRORS, ids=lambda v: str(v)[:50])
def test_the_docs_quote_the_errors_a_user_meets(doc, start):
    quoted = [line for where, line in quoted_error_lines() if where == doc]
    assert [line for line in quoted if line.startswith(start)], (start, quoted)


@pytest.mark.parametrize("doc, line", quoted_error_lines(), ids=lambda v: str(v)[:50])
def test_a_quoted_error_line_is_one_the_code_prints(doc, line):
    assert printable(line, code_messages()), f"{doc} quotes a line no code prints: {line}"
