"""Split the test files into N shards for parallel CI jobs, complete by construction.

    python ci/test_shards.py 4 0     # the test files of shard 0 of 4, space-separated

Every ``tests/<tier>/test_*.py`` (unit, dist, e2e) lands in exactly one shard (round robin
over the sorted names), so
the shards together run what ``make test`` runs - a new test file cannot be left out.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def shards(count: int) -> list[list[str]]:
    files = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").glob("*/test_*.py"))
    return [files[i::count] for i in range(count)]


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not all(a.isdigit() for a in argv) or int(argv[1]) >= int(argv[0]):
        print("usage: python ci/test_shards.py COUNT INDEX (0 <= INDEX < COUNT)", file=sys.stderr)
        return 2
    print(" ".join(shards(int(argv[0]))[int(argv[1])]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
