"""Resume state on disk: what a run needs to continue exactly where it stopped.

A checkpoint directory holds
  train_state.json         step, epoch, data position in samples (rank 0 writes it)
  rng/rank<R>.pt           every rank's torch / python / numpy RNG state
  + the strategy's files   ``model.pt`` (DDP, rank 0), DCP shards, DeepSpeed engine files ...

Each rank writes its part into a local staging directory that is renamed only once complete,
then hands it to the session (Ray Train merges the ranks' directories into one checkpoint in
storage and registers it only after every rank has reported, so a crash mid-write never
becomes the "latest" checkpoint).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import tempfile
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

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


def staging_root(run_name: str, rank: int) -> str:
    """Worker-local scratch for checkpoints before they are handed to storage."""
    path = os.path.join(tempfile.gettempdir(), "ray-train-templates", run_name, f"rank{rank}")
    os.makedirs(path, exist_ok=True)
    return path


def stage_checkpoint(root: str, name: str, write) -> str:
    """Run ``write(tmp_dir)`` and promote ``tmp_dir`` to ``root/name`` only if it finished."""
    final = os.path.join(root, name)
    with atomic_directory(final) as tmp:
        write(tmp)
    return final
