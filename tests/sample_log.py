"""Reading the per-sample log (``log_samples=true``) back: what a run committed per epoch."""

from __future__ import annotations

import json
from collections import Counter

from shared import storage


def committed_samples(run_dir: str) -> dict[int, Counter]:
    """Sample ids per epoch that ended up in the trained model.

    Each attempt (worker-group start) logs every micro-batch it trained on: its first position
    in the epoch's order and its sample ids. Whatever an attempt trained on at or after the
    position the next attempt resumed from was rolled back by that resume.
    """
    by_attempt: dict[int, list[tuple[int, int, list[int]]]] = {}
    logs = storage.join(str(run_dir), "samples")  # local or s3://
    for name in [n for n in storage.listdir(logs) if n.endswith(".jsonl")]:
        for line in storage.read_text(storage.join(logs, name)).splitlines():
            r = json.loads(line)
            by_attempt.setdefault(r["attempt"], []).append((r["epoch"], r["position"], r["ids"]))
    attempts = [by_attempt[a] for a in sorted(by_attempt)]
    committed: dict[int, Counter] = {}
    for i, records in enumerate(attempts):
        nxt = attempts[i + 1] if i + 1 < len(attempts) else []
        resumed_at = min((e, p) for e, p, _ in nxt) if nxt else (1 << 30, 0)
        for epoch, position, ids in records:
            if (epoch, position) < resumed_at:
                committed.setdefault(epoch, Counter()).update(ids)
    return committed
