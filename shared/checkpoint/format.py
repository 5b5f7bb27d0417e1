"""Resume state on storage: what a run needs to continue exactly where it stopped.

A checkpoint directory holds
  train_state.json         step, epoch, data position in samples (rank 0 writes it)
  rng/rank<R>.pt           every rank's torch / python / numpy RNG state
  + the strategy's files   ``model.pt`` (DDP, rank 0), DCP shards, DeepSpeed engine files ...
  manifest/rank<R>.json    written last by each rank: its files, sizes and SHA-256 checksums

Each rank writes its part into a local staging directory keyed by run, attempt and rank
(never reused, removed after the report), then hands it to the session: Ray Train merges the
ranks' directories into one checkpoint in storage and registers it only after every rank has
reported. Resume trusts neither the registration nor the newest name alone: it verifies the
manifests (every rank's, every file's size and checksum) and falls back to the newest
checkpoint that passes (shared/checkpoint/resume.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow.fs as pafs
import torch
from torch import nn

from shared import storage
from shared.storage import atomic_directory

TRAIN_STATE_FILE = "train_state.json"
MODEL_FILE = "model.pt"


@dataclass
class TrainState:
    """Counters that locate a run in its schedule and its data."""

    step: int = 0  # optimizer steps completed
    epoch: int = 0  # current epoch
    samples_in_epoch: int = 0  # sequences of `epoch` consumed by all ranks (data position)
    tokens_seen: int = 0  # global
    world_size: int = 1  # of the run that wrote it
    global_batch_size: int = 0  # sequences per optimizer step when it was written
    samples_per_epoch: dict[str, int] = dataclasses.field(default_factory=dict)  # finished epochs
    initial_loss: float | None = None  # the run's first step ever (survives resumes)
    # The epoch's consumed samples as compact id ranges (shared/data/position.py).
    data_position: dict | None = None

    def samples_seen(self) -> dict[str, int]:
        """Sequences trained on per epoch, all ranks together (the current epoch so far)."""
        return {**self.samples_per_epoch, str(self.epoch): self.samples_in_epoch}


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_train_state(directory: str, state: TrainState, rank: int) -> None:
    """The parts every strategy shares: counters (rank 0) and this rank's RNG."""
    if rank == 0:
        with open(os.path.join(directory, TRAIN_STATE_FILE), "w") as f:
            json.dump(dataclasses.asdict(state), f, indent=2)
    os.makedirs(os.path.join(directory, "rng"), exist_ok=True)
    torch.save(rng_state(), os.path.join(directory, "rng", f"rank{rank}.pt"))


def load_train_state(directory: str, rank: int) -> TrainState:
    """Counters, and this rank's RNG (rank 0's if the world grew since the save)."""
    with open(os.path.join(directory, TRAIN_STATE_FILE)) as f:
        state = TrainState(**json.load(f))
    rng_file = os.path.join(directory, "rng", f"rank{rank}.pt")
    if not os.path.exists(rng_file):
        rng_file = os.path.join(directory, "rng", "rank0.pt")
    set_rng_state(torch.load(rng_file, weights_only=False))
    return state


def save_model_optimizer(directory: str, model: nn.Module, optimizer, scheduler) -> None:
    """Full (unsharded) state in one file: the replicated-model strategies' format."""
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
        },
        os.path.join(directory, MODEL_FILE),
    )


def load_model_optimizer(directory: str, model: nn.Module, optimizer, scheduler) -> None:
    state = torch.load(os.path.join(directory, MODEL_FILE), map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])


MANIFEST_DIR = "manifest"
_CHUNK = 8 << 20


def manifest_name(rank: int) -> str:
    return f"{MANIFEST_DIR}/rank{rank}.json"


def file_sha256(path: str) -> str:
    """SHA-256 of a file on local disk or object storage, read in chunks."""
    fs, inner = storage.filesystem(path)
    digest = hashlib.sha256()
    with fs.open_input_stream(inner) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: str, rank: int, world_size: int, step: int) -> None:
    """List this rank's files (relative path, size, checksum) in ``manifest/rank<R>.json``.

    Called after every other file of the rank's part is written, so a manifest exists only
    for a finished part. Ray Train uploads the ranks' directories into one checkpoint; the
    checkpoint is complete when all ``world_size`` manifests are there and match."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in sorted(names):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, directory).replace(os.sep, "/")
            files[rel] = {"size": os.path.getsize(full), "sha256": file_sha256(full)}
    manifest = {"rank": rank, "world_size": world_size, "step": step, "files": files}
    path = os.path.join(directory, manifest_name(rank))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)


class CheckpointInvalid(Exception):
    """A checkpoint that must not be resumed from; the message names the bad file."""


def verify_checkpoint(directory: str) -> int:
    """Check every rank's manifest and every listed file; return the checkpoint's step.

    Raises CheckpointInvalid naming the first bad file: a missing manifest (that rank never
    finished its part), a missing file, a size or a checksum that differs."""
    rank0 = storage.join(directory, manifest_name(0))
    if not storage.exists(rank0):
        raise CheckpointInvalid(f"{manifest_name(0)} is missing (rank 0 did not finish)")
    world_size = json.loads(storage.read_text(rank0))["world_size"]
    step = None
    for rank in range(world_size):
        path = storage.join(directory, manifest_name(rank))
        if not storage.exists(path):
            raise CheckpointInvalid(f"{manifest_name(rank)} is missing (rank {rank} of "
                                    f"{world_size} did not finish)")  # fmt: skip
        try:
            manifest = json.loads(storage.read_text(path))
        except ValueError as err:
            raise CheckpointInvalid(f"{manifest_name(rank)} is unreadable ({err})") from None
        step = manifest["step"] if step is None else step
        for rel, expected in manifest["files"].items():
            _verify_file(storage.join(directory, *rel.split("/")), rel, expected)
    return step


def _verify_file(path: str, rel: str, expected: dict) -> None:
    fs, inner = storage.filesystem(path)
    info = fs.get_file_info(inner)
    if info.type == pafs.FileType.NotFound:
        raise CheckpointInvalid(f"{rel} is missing")
    if info.size != expected["size"]:
        raise CheckpointInvalid(f"{rel} has {info.size} bytes, the manifest says "
                                f"{expected['size']}")  # fmt: skip
    if file_sha256(path) != expected["sha256"]:
        raise CheckpointInvalid(f"{rel} does not match its SHA-256 checksum in the manifest")


def run_key(run_dir: str) -> str:
    """A local directory name for one run: its name plus a hash of its full storage path, so
    two jobs (or storage paths) that reuse a run name never share scratch space."""
    name = run_dir.rstrip("/").rsplit("/", 1)[-1]
    return f"{name}-{hashlib.sha1(run_dir.encode()).hexdigest()[:10]}"


def staging_root(run_dir: str, attempt: int, rank: int) -> str:
    """Worker-local scratch for checkpoints before they are handed to storage, keyed by run,
    attempt (one per worker-group start) and rank: nothing staged by an earlier attempt, or
    by another job with the same run name, can ever be picked up.

    Scratch left by earlier attempts of this run on this node (a worker killed before its
    report could clean up) is removed here: a run has one worker group at a time."""
    run_root = os.path.join(tempfile.gettempdir(), "ray-train-templates", run_key(run_dir))
    mine = f"attempt-{attempt}"
    if os.path.isdir(run_root):
        for name in os.listdir(run_root):
            if name != mine:
                shutil.rmtree(os.path.join(run_root, name), ignore_errors=True)
    path = os.path.join(run_root, mine, f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    return path


@contextlib.contextmanager
def staged_checkpoint(root: str, name: str, write) -> Iterator[str]:
    """Run ``write(tmp_dir)`` and promote ``tmp_dir`` to ``root/name`` only if it finished;
    yield the promoted directory (to report it) and remove it afterwards, whether or not the
    session uploaded it."""
    final = os.path.join(root, name)
    if os.path.exists(final):  # the root is per attempt: only a repeated name gets here
        raise FileExistsError(f"staging directory {final} already exists")
    with atomic_directory(final) as tmp:
        write(tmp)
    try:
        yield final
    finally:
        shutil.rmtree(final, ignore_errors=True)
