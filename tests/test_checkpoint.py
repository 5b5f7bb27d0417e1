import random
from pathlib import Path

import pytest
import torch

from shared import checkpoint
from shared.checkpoint import TrainState
from shared.storage import atomic_directory


def test_atomic_directory_promotes_only_complete_writes(tmp_path):
    final = tmp_path / "ckpt"
    with pytest.raises(RuntimeError), atomic_directory(str(final)) as tmp:
        (tmp_path / "x").write_text("")
        Path(tmp, "half.pt").write_text("partial")
        raise RuntimeError("crash mid-write")
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["x"]  # no temp dir left behind
    with atomic_directory(str(final)) as tmp:
        Path(tmp, "model.pt").write_text("done")
    assert (final / "model.pt").read_text() == "done"


def test_train_state_and_rng_round_trip(tmp_path):
    torch.manual_seed(1)
    random.seed(1)
    state = TrainState(step=7, epoch=1, samples_in_epoch=48, tokens_seen=4096, world_size=2)
    checkpoint.save_train_state(str(tmp_path), state, rank=0)
    checkpoint.save_train_state(str(tmp_path), state, rank=1)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(99)
    random.seed(99)
    restored = checkpoint.load_train_state(str(tmp_path), rank=1)
    assert restored == state
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


def test_rank_without_its_own_rng_file_falls_back_to_rank0(tmp_path):
    checkpoint.save_train_state(str(tmp_path), TrainState(step=1), rank=0)
    assert checkpoint.load_train_state(str(tmp_path), rank=3).step == 1
