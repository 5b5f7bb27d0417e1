import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from shared import checkpoint
from shared.checkpoint import TrainState, resume
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


# --- manifests, verification and fallback -------------------------------------------------


def write_checkpoint(run_dir: Path, step: int, world_size: int = 2, name: str | None = None):
    """A checkpoint as Ray Train leaves it: every rank's staged part merged into one dir."""
    final = run_dir / (name or f"step_{step:06d}")
    for rank in range(world_size):
        part = run_dir / f".staging-rank{rank}-{step}"
        part.mkdir(parents=True)
        if rank == 0:
            torch.save({"w": torch.full((64,), float(step))}, part / "model.pt")
        checkpoint.save_train_state(str(part), TrainState(step=step), rank)
        checkpoint.write_manifest(str(part), rank, world_size, step)
        shutil.copytree(part, final, dirs_exist_ok=True)
        shutil.rmtree(part)
    return final


def register(run_dir: Path, *names: str) -> None:
    """Ray Train V2's run snapshot listing ``names`` as registered checkpoints."""
    results = [{"checkpoint_dir_name": n, "metrics": {}} for n in names]
    snapshot = {"checkpoint_results": results, "latest_checkpoint_result": results[-1]}
    (run_dir / resume.RAY_SNAPSHOT_FILE).write_text(json.dumps(snapshot))


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_manifest_verifies_every_rank_and_names_the_bad_file(tmp_path):
    ckpt = write_checkpoint(tmp_path, 8)
    assert checkpoint.verify_checkpoint(str(ckpt)) == 8
    manifest = json.loads((ckpt / "manifest" / "rank0.json").read_text())
    assert set(manifest["files"]) == {"model.pt", "train_state.json", "rng/rank0.pt"}
    assert manifest["files"]["model.pt"]["size"] == (ckpt / "model.pt").stat().st_size

    truncate(ckpt / "model.pt")
    with pytest.raises(checkpoint.CheckpointInvalid, match=r"^model\.pt has \d+ bytes"):
        checkpoint.verify_checkpoint(str(ckpt))

    same_size = write_checkpoint(tmp_path, 12)
    data = bytearray((same_size / "rng" / "rank1.pt").read_bytes())
    data[-1] ^= 0xFF
    (same_size / "rng" / "rank1.pt").write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointInvalid, match=r"^rng/rank1\.pt does not match"):
        checkpoint.verify_checkpoint(str(same_size))


def test_a_checkpoint_whose_ranks_did_not_all_finish_fails_verification(tmp_path):
    ckpt = write_checkpoint(tmp_path, 4)
    (ckpt / "manifest" / "rank1.json").unlink()  # rank 1 died before its manifest
    with pytest.raises(checkpoint.CheckpointInvalid, match="rank 1 of 2 did not finish"):
        checkpoint.verify_checkpoint(str(ckpt))
    shutil.rmtree(ckpt / "manifest")
    with pytest.raises(checkpoint.CheckpointInvalid, match="rank 0 did not finish"):
        checkpoint.verify_checkpoint(str(ckpt))


def test_resume_falls_back_to_the_previous_good_checkpoint_with_one_warning(tmp_path, capsys):
    for step in (4, 8, 12):
        write_checkpoint(tmp_path, step)
    write_checkpoint(tmp_path, 16)  # on storage, complete, but never registered by Ray
    register(tmp_path, "step_000004", "step_000008", "step_000012")
    truncate(tmp_path / "step_000012" / "model.pt")

    plan = resume.plan_resume(str(tmp_path), "step_000012", rank=0)
    assert plan.checkpoint == str(tmp_path / "step_000008")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("warning: checkpoint step_000012 fails")
    assert "model.pt has" in err[0] and "resuming from step_000008" in err[0]
    # The redone steps get new names: the corrupt step_000012 is never written into.
    assert plan.checkpoint_name(12) == f"step_000012.a{plan.attempt}"
    assert plan.checkpoint_name(20) == "step_000020"
    assert resume.checkpoint_order(plan.checkpoint_name(12)) > resume.checkpoint_order(
        "step_000012"
    )
    # What the failure summary calls the last complete checkpoint is the same one.
    assert resume.last_good_checkpoint(str(tmp_path)) == str(tmp_path / "step_000008")


def test_no_good_checkpoint_is_refused_rather_than_restarting_from_scratch(tmp_path):
    write_checkpoint(tmp_path, 4)
    register(tmp_path, "step_000004")
    truncate(tmp_path / "step_000004" / "train_state.json")
    with pytest.raises(RuntimeError, match="no checkpoint of .* passes verification"):
        resume.plan_resume(str(tmp_path), "step_000004", rank=0)
    assert resume.plan_resume(str(tmp_path / "fresh"), None, rank=0).checkpoint is None


def test_staging_is_per_run_attempt_and_rank_and_removed_after_the_report(tmp_path):
    run_a, run_b = str(tmp_path / "a" / "job" / "r"), str(tmp_path / "b" / "job" / "r")
    roots = {
        checkpoint.staging_root(run_a, 1, 0),
        checkpoint.staging_root(run_a, 1, 1),
        checkpoint.staging_root(run_b, 1, 0),  # another job reusing the run name
    }
    assert len(roots) == 3
    old = checkpoint.staging_root(run_a, 1, 0)
    Path(old, "step_000008").mkdir()  # left by an attempt whose peer died mid-checkpoint
    new = checkpoint.staging_root(run_a, 2, 0)
    assert new != old and not Path(old).exists()  # the dead attempt's scratch is gone

    def write(directory):
        Path(directory, "model.pt").write_text("attempt 2")

    with checkpoint.staged_checkpoint(new, "step_000008", write) as staged:
        assert Path(staged, "model.pt").read_text() == "attempt 2"
    assert not Path(staged).exists()
    with pytest.raises(RuntimeError), checkpoint.staged_checkpoint(new, "step_000012", write):
        raise RuntimeError("report failed")
    assert not Path(new, "step_000012").exists()
