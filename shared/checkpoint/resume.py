"""Which checkpoint a run resumes from: the newest one every rank finished that verifies.

Ray Train 2.60 hands a worker only the latest *registered* checkpoint
(``ray.train.get_checkpoint()``). Registered means every rank reported, not that the files in
storage are intact: a truncated ``model.pt`` would end the run. So rank 0 lists the
checkpoints Ray registered (its run snapshot, ``checkpoint_manager_snapshot.json`` in the run
directory), verifies their manifests newest first (format.py), skips a bad one with one
warning line naming the bad file, and tells every rank which one to load. Unregistered
``step_*`` directories (a peer died before the report) are never resumed from.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from shared import storage
from shared.checkpoint import CheckpointInvalid, verify_checkpoint

RAY_SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  # Ray Train V2's registered checkpoints
# step_000012, or step_000012.a<attempt> when an attempt re-saves a step already in storage
CHECKPOINT_DIR = re.compile(r"^step_(\d+)(?:\.a(\d+))?$")


def checkpoint_order(name: str) -> tuple[int, int]:
    """(step, attempt): later steps first, and a re-save of a step after the original."""
    match = CHECKPOINT_DIR.match(name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else (-1, -1)


def checkpoint_dirs(run_dir: str) -> list[str]:
    """Every ``step_*`` directory in the run directory, oldest first."""
    return sorted((n for n in storage.listdir(run_dir) if CHECKPOINT_DIR.match(n)),
                  key=checkpoint_order)  # fmt: skip


def registered_checkpoints(run_dir: str) -> list[str] | None:
    """Names of the checkpoints Ray Train registered (all ranks reported), oldest first;
    None when the run has no Ray snapshot (a torchrun run, or one that never reported)."""
    path = storage.join(run_dir, RAY_SNAPSHOT_FILE)
    if not storage.exists(path):
        return None
    state = json.loads(storage.read_text(path))
    results = list(state.get("checkpoint_results") or [])
    if state.get("latest_checkpoint_result"):
        results.append(state["latest_checkpoint_result"])
    names = {r["checkpoint_dir_name"] for r in results}
    return sorted(names, key=checkpoint_order)


def newest_verified(
    run_dir: str, candidates: list[str]
) -> tuple[str | None, list[tuple[str, str]]]:
    """The newest candidate whose manifests verify, and the (name, problem) pairs skipped."""
    skipped = []
    for name in sorted(candidates, key=checkpoint_order, reverse=True):
        try:
            verify_checkpoint(storage.join(run_dir, name))
        except CheckpointInvalid as err:
            skipped.append((name, str(err)))
            continue
        return name, skipped
    return None, skipped


def last_good_checkpoint(run_dir: str) -> str | None:
    """The checkpoint a rerun would resume from (for the failure summary), or None."""
    if not storage.exists(run_dir):
        return None
    registered = registered_checkpoints(run_dir)
    name, _ = newest_verified(run_dir, checkpoint_dirs(run_dir) if registered is None
                              else registered)  # fmt: skip
    return storage.join(run_dir, name) if name else None


@dataclass
class ResumePlan:
    """What every rank of one worker-group start agrees on (rank 0 decides)."""

    attempt: int  # unique per worker-group start: keys this attempt's staging directories
    checkpoint: str | None = None  # storage path to resume from; None = from scratch
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, why) newest first
    taken: frozenset[str] = frozenset()  # checkpoint names already in storage

    def checkpoint_name(self, step: int) -> str:
        """``step_<N>``, unless storage already has that name (this attempt redoes steps of
        an earlier one): then a new name, so the earlier files are never overwritten in
        place and Ray Train never deletes a checkpoint another entry still points to."""
        name = f"step_{step:06d}"
        return name if name not in self.taken else f"{name}.a{self.attempt}"


def decide(run_dir: str, latest_name: str | None) -> ResumePlan:
    """Rank 0's decision. ``latest_name``: the session's latest registered checkpoint."""
    plan = ResumePlan(attempt=time.time_ns())
    if not storage.exists(run_dir):
        return plan
    existing = checkpoint_dirs(run_dir)
    plan.taken = frozenset(existing)
    if latest_name is None:
        return plan
    registered = registered_checkpoints(run_dir)
    candidates = set(registered if registered is not None else existing) | {latest_name}
    # Never newer than what the session calls latest: anything after it was not registered.
    candidates = [n for n in candidates if checkpoint_order(n) <= checkpoint_order(latest_name)]
    name, plan.skipped = newest_verified(run_dir, candidates)
    if name is None:
        problems = "; ".join(f"{n}: {why}" for n, why in plan.skipped)
        raise RuntimeError(f"no checkpoint of {run_dir} passes verification ({problems}); "
                           "move the run directory away to start over")  # fmt: skip
    plan.checkpoint = storage.join(run_dir, name)
    return plan


def agree(plan_on_rank0, rank: int):
    """Rank 0's object on every rank (one broadcast; a no-op without a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return plan_on_rank0
    box = [plan_on_rank0 if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def plan_resume(run_dir: str, latest_name: str | None, rank: int) -> ResumePlan:
    """Collective: every rank calls it once per worker-group start, at the same point."""
    plan, error = None, None
    if rank == 0:
        try:
            plan = decide(run_dir, latest_name)
        except Exception as err:  # noqa: BLE001 - re-raised on every rank after the broadcast
            error = f"{type(err).__name__}: {err}"
    plan, error = agree((plan, error), rank)
    if error:
        raise RuntimeError(error)
    if rank == 0:
        for name, why in plan.skipped:
            target = os.path.basename(plan.checkpoint) if plan.checkpoint else "scratch"
            print(f"warning: checkpoint {name} fails verification: {why}; resuming from "
                  f"{target} instead", file=sys.stderr, flush=True)  # fmt: skip
    return plan


@contextlib.contextmanager
def open_checkpoint(path: str | None) -> Iterator[str | None]:
    """A local directory with the checkpoint's files: the directory itself on local disk, a
    temporary download from object storage (removed afterwards)."""
    if path is None or not storage.is_remote(path):
        yield None if path is None else storage.local_path(path)
        return
    local = tempfile.mkdtemp(prefix="resume-")
    try:
        storage.download_dir(path, local)
        yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)


def plan_for(session) -> ResumePlan:
    """The session's plan (Ray sessions decide it when they resume); sessions without one
    get a per-process attempt id, enough to key their staging directories."""
    plan = getattr(session, "resume_plan", None)
    if callable(plan):
        return plan()
    if getattr(session, "_fallback_plan", None) is None:
        session._fallback_plan = ResumePlan(attempt=time.time_ns())
    return session._fallback_plan
