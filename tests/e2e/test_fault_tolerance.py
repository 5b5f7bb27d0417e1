"""jobs/fault_tolerance on a real local Ray cluster, training with FSDP2 (DCP checkpoints, every
rank writing its shards): a worker SIGKILLed while writing one, a killed driver and exhausted
retries, each checked against an uninterrupted run. The other failure modes: an exception right
after a checkpoint (tests/e2e/test_s3.py), os._exit mid-epoch (the default run,
tests/e2e/test_docs.py).
A resize at the same global batch: tests/dist/test_strategies.py (the data and checkpoint
side) and tests/e2e/test_elastic.py (Ray Train's lose/regain)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, job_env, run_job
from observability_checks import assert_held_out_loss_fell
from sample_log import committed_samples
from weights import assert_bitwise_equal, final_weights

from shared.checkpoint.resume import registered_checkpoints

# Jobs join one Ray cluster shared by this module (conftest.py: `job_cluster`).
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("job_cluster")]

# ~20 steps per epoch: 12 steps stay inside epoch 0, so every failure is mid-epoch.
COMMON = ("strategy=fsdp", "max_steps=12", "checkpoint_every=4", "log_samples=true")


def ok(result) -> dict:
    assert result.returncode == 0, result.output[-4000:]
    assert result.summary["status"] == "succeeded"
    return result.summary


def assert_exactly_once(run_dir: str, steps: int = 12) -> None:
    committed = committed_samples(run_dir)
    total = 0
    for epoch, counts in committed.items():
        assert set(counts.values()) == {1}, f"epoch {epoch}: a sample was trained on twice"
        total += len(counts)
    assert total == steps * 32  # steps x the global batch of 32 sequences


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("ft")


@pytest.fixture(scope="module")
def reference(storage) -> dict:
    summary = ok(
        run_job(
            "fault_tolerance",
            *COMMON,
            "fail_at_step=0",
            "run_name=ref",
            "export_at_end=true",
            storage=storage,
        )  # fmt: skip
    )
    assert summary["failures_recovered"] == 0
    assert_held_out_loss_fell(summary)  # evaluations at steps 10 and 12
    return summary


def test_export_at_end_writes_a_model_transformers_loads_with_the_final_weights(reference):
    """export_at_end (the full profiles' default): SUMMARY names the Hugging Face export of
    the last checkpoint, and its weights are the run's final weights."""
    from transformers import AutoModelForCausalLM

    export = Path(reference["export"])
    assert export == Path(reference["run_dir"], "export", "step_000012")
    assert json.loads((export / "export_info.json").read_text())["step"] == 12
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    exported = model.state_dict()
    for name, tensor in final_weights(reference).items():
        assert torch.equal(exported[name.removeprefix("module.")], tensor), name


def test_a_worker_killed_while_writing_its_dcp_shard_recovers_to_the_identical_model(
    reference, storage
):
    """Rank 1 is SIGKILLed after its DCP shard is written, before its manifest: step 8 is on
    storage incomplete, the group restarts (max_failures=1) and redoes the steps."""
    from shared import checkpoint

    result = run_job("fault_tolerance", *COMMON, "fail_at_step=8", "fail_mode=sigkill",
                     "fail_during_checkpoint=true", "max_failures=1", "run_name=during",
                     storage=storage)  # fmt: skip
    s = assert_recovered_to_the_reference(result, reference)
    assert "rank 1 dies at step 8 while writing its checkpoint" in result.stdout
    # Every checkpoint the run kept verifies; nothing staged is left on the node.
    assert checkpoint.verify_checkpoint(s["checkpoint"]) == 12
    staging = Path(tempfile.gettempdir(), "ray-train-templates", checkpoint.run_key(s["run_dir"]))
    assert not list(staging.glob("attempt-*/rank*/step_*"))


def assert_recovered_to_the_reference(result, reference: dict) -> dict:
    s = ok(result)
    assert s["failures_recovered"] == 1 and s["steps"] == 12
    assert "FAULT INJECTION 1/1: rank 1 dies at step" in result.stdout
    assert "worker group restarted by Ray Train after 1 injected failure(s)" in result.stdout
    assert "resumed from checkpoint at step " in result.stdout
    assert s["samples_per_epoch"] == reference["samples_per_epoch"]
    # Same world size, deterministic data order, model/optimizer/schedule/RNG/data position
    # restored: the CPU float ops repeat exactly, so the weights are bitwise equal (the DCP
    # shards gathered into one process).
    assert_bitwise_equal(final_weights(s), final_weights(reference))
    assert_exactly_once(s["run_dir"])
    return s


def registered(run_dir: Path) -> list[str]:
    try:
        return registered_checkpoints(str(run_dir)) or []
    except ValueError:  # the snapshot is being rewritten
        return []


def test_killed_driver_resumes_when_the_command_is_rerun(reference, storage):
    cmd = [sys.executable, str(REPO / "jobs/fault_tolerance/main.py"), f"storage_path={storage}",
           *COMMON, "fail_at_step=0", "run_name=driver", "sleep_per_step=0.5"]  # fmt: skip
    run_dir = Path(storage, "fault_tolerance", "driver")
    proc = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        # Kill once Ray Train has registered a checkpoint (its run snapshot lists it): files
        # in storage alone are never resumed from. A fixed wait after the files appeared was
        # too short when the machine was busy.
        deadline = time.time() + 300
        while not registered(run_dir):
            assert proc.poll() is None and time.time() < deadline, "no registered checkpoint"
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the local cluster it started
        proc.wait()
    result = run_job("fault_tolerance", *cmd[2:], storage=storage)
    s = ok(result)
    assert s["resumed_from_step"] >= 4 and s["steps"] == 12
    assert_bitwise_equal(final_weights(s), final_weights(reference))
    assert_exactly_once(s["run_dir"])


def test_exhausted_max_failures_fails_clearly_and_keeps_the_last_checkpoint(storage):
    result = run_job("fault_tolerance", *COMMON, "fail_at_step=7", "fail_times=2", "max_failures=1",
                     "run_name=exhausted", storage=storage)  # fmt: skip
    assert result.returncode == 1
    s = result.summary
    assert s["status"] == "failed" and s["attempts"] == 2
    assert "max_failures=1" in s["error"]
    state = json.loads(Path(s["checkpoint"], "train_state.json").read_text())
    assert state["step"] == 4 and Path(s["checkpoint"], "dcp", ".metadata").exists()
