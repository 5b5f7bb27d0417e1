"""DDP vs FSDP2 vs ZeRO-1/2/3 on a real local Ray cluster with 2 CPU workers: same losses,
the expected per-rank memory, bitwise-exact resume, resuming on another world size both ways
(DDP, FSDP's DCP, ZeRO-3's universal format), a falling held-out loss, and switching strategy
mid-training (init_from)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_job
from observability_checks import assert_held_out_loss_fell, assert_trace_has_step_ranges
from sample_log import committed_samples
from weights import assert_bitwise_equal, assert_close_weights, final_weights

# Jobs join one Ray cluster shared by this module (conftest.py: `job_cluster`).
pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("job_cluster")]

STEPS = ("max_steps=16", "checkpoint_every=8")
VARIANTS = {
    "ddp": ("ddp",),
    "fsdp": ("fsdp",),
    "zero1": ("zero", "zero_stage=1"),
    "zero2": ("zero", "zero_stage=2"),
    "zero3": ("zero", "zero_stage=3"),
    # Offload moves state to CPU memory; it may not change the math.
    "zero3_offload": ("zero", "zero_stage=3", "offload_optimizer=true", "offload_params=true"),
}


def losses(summary: dict) -> dict[int, float]:
    rows = Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, rows)}


def ok(result) -> dict:
    assert result.returncode == 0, result.output[-4000:]
    assert result.summary["status"] == "succeeded"
    return result.summary


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sharded")


@pytest.fixture(scope="module")
def runs(storage) -> dict[str, dict]:
    """One uninterrupted 16-step run per strategy, same seed, model and data; steps 3-5
    profiled (the profiler only observes: the losses must still match); every trained sample
    id logged (samples/*.jsonl)."""
    observed = ("profile_steps=3-5", "log_samples=true")
    return {
        name: ok(run_job(job, *extra, *STEPS, f"run_name={name}", *observed, storage=storage))
        for name, (job, *extra) in VARIANTS.items()
    }


def test_every_strategy_follows_the_same_loss_curve(runs):
    reference = losses(runs["ddp"])
    assert sorted(reference) == list(range(1, 17))
    assert reference[16] < 0.85 * reference[1]
    for name, summary in runs.items():
        # fp32, same data order: the only difference is the order in which the sharded
        # reductions add numbers up (~1e-7 relative per step here); 1e-5 over 16 steps leaves
        # room for that to compound, and is far below any real bug (a wrong LR or a missed
        # gradient sync shows up at 1e-2 within a step or two).
        assert losses(summary) == pytest.approx(reference, rel=1e-5), name


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_strategy_trains_the_same_samples_each_read_once(name, runs):
    """One data layer: the epoch's order, cut into the same global batches for every
    strategy, each row read from the packed dataset once."""
    committed = committed_samples(runs[name]["run_dir"])
    assert committed == committed_samples(runs["ddp"]["run_dir"])
    assert sum(len(c) for c in committed.values()) == 16 * 32
    assert all(set(c.values()) == {1} for c in committed.values())
    assert runs[name]["data_rows_trained"] == 16 * 32
    assert runs[name]["data_read_amplification"] <= 1.05


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_strategy_reports_a_falling_held_out_loss(name, runs):
    assert_held_out_loss_fell(runs[name])  # evaluations at steps 10 and 16


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_strategy_names_its_phases_in_the_trace_of_each_rank(name, runs):
    """Including gradient_sync: DDP's comm hook, FSDP2's reduce-scatter, DeepSpeed's
    allreduce_gradients (shared/observability/profiling.py)."""
    for rank in (0, 1):
        path = Path(runs[name]["run_dir"], "profile", f"rank{rank}.json")
        assert_trace_has_step_ranges(path, range(3, 6))


def test_sharded_strategies_hold_the_expected_fraction_of_model_state(runs):
    ddp = runs["ddp"]["model_state_bytes_per_rank"]
    half = {k: v / 2 for k, v in ddp.items()}

    def close(measured: int, expected: float) -> bool:
        # FSDP pads each tensor's first dim to a multiple of the world size and every rank
        # keeps the 4-byte Adam step counter of every tensor; both are < 1% here.
        return measured == pytest.approx(expected, rel=0.01)

    fsdp, z1, z2, z3 = (
        runs[n]["model_state_bytes_per_rank"] for n in ("fsdp", "zero1", "zero2", "zero3")
    )
    assert all(close(fsdp[k], half[k]) for k in ("params", "grads", "optimizer")), fsdp
    # ZeRO-1 partitions only the optimizer states, ZeRO-2 also the gradients, ZeRO-3 all three.
    assert z1["params"] == ddp["params"] and z1["grads"] == ddp["grads"]
    assert close(z1["optimizer"], half["optimizer"])
    assert z2["params"] == ddp["params"]
    assert close(z2["grads"], half["grads"]) and close(z2["optimizer"], half["optimizer"])
    assert all(close(z3[k], half[k]) for k in ("params", "grads", "optimizer")), z3
    # DeepSpeed also keeps an fp32 master copy of each rank's partition, even in fp32 runs.
    for z in (z1, z2, z3):
        assert close(z["master_params"], half["params"])


def test_planner_predicts_each_strategys_measured_model_state_bytes(runs):
    """shared.planner lays the tensors out as each framework does (FSDP2's padded dim-0
    shards, DeepSpeed's 2 x N-aligned flat groups and fp32 master partition, one AdamW step
    counter per tensor or group), so its per-rank bytes equal the measurement exactly."""
    from shared.planner import from_preset, model_state_per_rank

    # The smoke profile: gpt2-tiny with the 512-token tokenizer the corpus generator trains
    # (shared.data.generate_news_corpus) and 64-token sequences, fp32 on 2 ranks.
    model = from_preset("gpt2-tiny", vocab=512, seq_len=64)
    planned = {"ddp": "ddp", "fsdp": "fsdp2", "zero1": "zero1", "zero2": "zero2",
               "zero3": "zero3", "zero3_offload": "zero3_offload"}  # fmt: skip
    for run, strategy in planned.items():
        measured = runs[run]["model_state_bytes_per_rank"]
        assert model_state_per_rank(model, strategy, gpus=2) == measured, run


@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero3"])
def test_stop_and_resume_continues_the_same_trajectory(name, runs, storage):
    """Stopped at step 8 and resumed on as many ranks: model, optimizer, LR schedule, data
    position and RNG all restored, so the CPU float ops repeat exactly: the same losses and
    bitwise the same weights as the uninterrupted run (model.pt, DCP shards, DeepSpeed)."""
    job, *extra = VARIANTS[name]
    run = f"resume-{name}"
    first = ok(run_job(job, *extra, *STEPS, f"run_name={run}", "stop_at_step=8", storage=storage))
    assert first["steps"] == 8
    second = ok(run_job(job, *extra, *STEPS, f"run_name={run}", storage=storage))
    assert second["resumed_from_step"] == 8 and second["steps"] == 16
    resumed, uninterrupted = losses(second), losses(runs[name])
    assert sorted(resumed) == list(range(1, 17))
    assert [resumed[s] for s in range(9, 17)] == [uninterrupted[s] for s in range(9, 17)]
    assert_bitwise_equal(final_weights(second), final_weights(runs[name]))


# A world size's settings with the same global batch of 32 (the resume contract refuses
# another batch): 1 rank accumulates 4 micro-batches of 8, 2 ranks 2 each.
WORLD = {1: ("num_workers=1", "grad_accum=4"), 2: ("num_workers=2", "grad_accum=2")}


@pytest.mark.parametrize("job, sizes", [("fsdp", (2, 1, 2)), ("ddp", (1, 2, 1))])
def test_a_checkpoint_resumes_on_another_world_size_both_ways(job, sizes, runs, storage):
    """Steps 1-8, 9-12 and 13-16 on the world sizes given, each attempt stopping mid-epoch and
    the next resuming at the other size: DCP stores each tensor's global shape and every
    shard's offset, so 1 rank loads what 2 wrote and back; the data position is in samples of
    the epoch's order, so every size finishes exactly the global batches left."""
    run, reference = f"resize-{job}", runs[job]
    attempts = []
    for size, stop in zip(sizes, ("stop_at_step=8", "stop_at_step=12", "stop_at_step=0"),
                          strict=True):  # fmt: skip
        attempts.append(ok(run_job(job, *STEPS, *WORLD[size], f"run_name={run}", stop,
                                   "log_samples=true", storage=storage)))  # fmt: skip
    uninterrupted = losses(reference)
    for size, start, attempt in zip(sizes, (0, 8, 12), attempts, strict=True):
        assert attempt["world_size"] == size and attempt["resumed_from_step"] == (start or None)
        # The same samples in the same steps, summed in another order: fp32 rounding only.
        initial = attempt["attempt_initial_loss"]
        assert initial == pytest.approx(uninterrupted[start + 1], rel=1e-4)
        # FSDP: one rank holds all of the model, twice the 2-rank shard; DDP: all on each.
        params = reference["model_state_bytes_per_rank"]["params"]
        expected = 2 * params if job == "fsdp" and size == 1 else params  # 2-rank shards pad
        assert attempt["model_state_bytes_per_rank"]["params"] == pytest.approx(expected, rel=0.01)
    last = attempts[-1]
    assert last["steps"] == 16 and losses(last)[16] == pytest.approx(uninterrupted[16], rel=1e-4)
    assert_resized_run_trained_the_uninterrupted_samples(last, reference, attempt_steps=4)
    assert_close_weights(final_weights(last), final_weights(reference))


def test_zero3_resumes_on_one_rank_then_on_two_through_the_universal_format(runs, storage):
    """DeepSpeed loads its own checkpoint only on as many ranks as wrote it; a ZeRO-3 run
    that changes its world size goes through the universal format, both ways: 2 ranks to
    step 6, 1 rank (4 micro-batches) to step 11, 2 ranks to step 16."""
    run, common = "zero3-resize", ("zero", "zero_stage=3", *STEPS, "log_samples=true")
    ok(run_job(*common, f"run_name={run}", "stop_at_step=6", storage=storage))
    shrink = run_job(*common, f"run_name={run}", "stop_at_step=11", "num_workers=1",
                     "grad_accum=4", storage=storage)  # fmt: skip
    one = ok(shrink)
    assert "ZeRO checkpoint of world size 2 loaded at world size 1" in shrink.stdout
    grow = run_job(*common, f"run_name={run}", storage=storage)
    two = ok(grow)
    assert "ZeRO checkpoint of world size 1 loaded at world size 2" in grow.stdout
    assert (one["resumed_from_step"], one["steps"]) == (6, 11)
    assert (two["world_size"], two["resumed_from_step"], two["steps"]) == (2, 11, 16)
    # Each sample of the first 16 global batches once, the uninterrupted run's, read once.
    committed = committed_samples(two["run_dir"])
    assert sum(len(c) for c in committed.values()) == 16 * 32
    assert all(set(c.values()) == {1} for c in committed.values())
    assert committed == committed_samples(runs["zero3"]["run_dir"])
    assert two["data_rows_trained"] == 5 * 32 and two["data_read_amplification"] <= 1.05
    # Model, optimizer moments and schedule carried across both resizes: the uninterrupted
    # run's losses up to fp32 summation order.
    uninterrupted, resized = losses(runs["zero3"]), losses(two)
    assert one["attempt_initial_loss"] == pytest.approx(uninterrupted[7], rel=1e-4)
    assert [resized[s] for s in range(12, 17)] == pytest.approx(
        [uninterrupted[s] for s in range(12, 17)], rel=1e-4
    )


def assert_resized_run_trained_the_uninterrupted_samples(
    resized: dict, reference: dict, attempt_steps: int
):
    """Across the resizes: each sample of the epoch's first 16 global batches exactly once,
    the same ones as the uninterrupted run, and the last attempt read each of its rows once."""
    committed = committed_samples(resized["run_dir"])
    assert sum(len(c) for c in committed.values()) == 16 * 32
    assert all(set(c.values()) == {1} for c in committed.values())
    assert committed == committed_samples(reference["run_dir"])
    assert resized["data_rows_trained"] == attempt_steps * 32
    assert resized["data_read_amplification"] <= 1.05


# init_from: switching strategy mid-training from the step-8 checkpoints of the runs above.
# (source run, target job + settings, the start line's verdict)
SWITCHES = {
    "fsdp-to-zero2": ("fsdp", ("zero", "zero_stage=2"), "weights loaded, optimizer state "
                      "fresh (fsdp -> zero)"),
    "ddp-to-fsdp": ("ddp", ("fsdp",), "weights loaded, optimizer state fresh (ddp -> fsdp)"),
    "fsdp-to-fsdp": ("fsdp", ("fsdp",), "weights and optimizer state loaded (fsdp -> fsdp)"),
}  # fmt: skip


def switched_run(name: str, runs, storage, stop_at_step: int) -> tuple[dict, str]:
    source, (job, *extra), _ = SWITCHES[name]
    path = Path(runs[source]["run_dir"], "step_000008")
    result = run_job(job, *extra, *STEPS, f"run_name={name}", f"init_from={path}",
                     f"stop_at_step={stop_at_step}", storage=storage)  # fmt: skip
    return ok(result), result.stdout


def metrics_rows(summary: dict) -> dict[int, dict]:
    rows = Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, rows)}


@pytest.mark.parametrize("name", ["fsdp-to-zero2", "ddp-to-fsdp"])
def test_init_from_another_strategy_continues_at_the_source_runs_loss(name, runs, storage):
    source, _, verdict = SWITCHES[name]
    summary, stdout = switched_run(name, runs, storage, stop_at_step=9)
    assert f"({source} step 8): {verdict}" in stdout
    assert "continuing at step 8" in stdout
    switched, uninterrupted = metrics_rows(summary), metrics_rows(runs[source])
    assert sorted(switched) == [9] and summary["steps"] == 9
    assert summary["resumed_from_step"] is None  # a new run, not a resume
    # Step 9's loss is the forward pass of the step-8 weights on step 9's batch: it does not
    # depend on the optimizer state, so it equals the source run's own step 9 when the weights
    # (fp32, copied exactly), the data position and the LR schedule all carried over. The
    # strategies only differ in how the two ranks' losses are added up (seen bitwise equal);
    # 1e-6 relative is ~2 ulp of a loss of ~4.5 in fp32. A model restarted at step 0 or a
    # batch from the wrong position is off by > 1e-2.
    assert switched[9]["loss"] == pytest.approx(uninterrupted[9]["loss"], rel=1e-6)
    assert switched[9]["lr"] == pytest.approx(uninterrupted[9]["lr"], rel=1e-12)
    assert summary["initial_loss"] == runs[source]["initial_loss"]  # the run's first step ever


def test_init_from_the_same_strategy_also_carries_the_optimizer_state(runs, storage):
    """fsdp -> fsdp reads the DCP optimizer shards too: the trajectory stays the source's
    after the first step (with a fresh AdamW, step 10 differs by ~1e-2)."""
    summary, stdout = switched_run("fsdp-to-fsdp", runs, storage, stop_at_step=10)
    assert SWITCHES["fsdp-to-fsdp"][2] in stdout
    switched, uninterrupted = metrics_rows(summary), metrics_rows(runs["fsdp"])
    assert sorted(switched) == [9, 10]
    for step in (9, 10):
        assert switched[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], rel=1e-6)
