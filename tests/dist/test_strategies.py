"""DDP vs FSDP2 vs ZeRO-1/2/3 (+ offload) on 2 real gloo ranks, each built by its job's worker
lines and trained by the shared loop (tests/dist/gloo.py, no Ray): the same losses and
samples, the expected per-rank model state, bitwise-exact resume, resuming on another world
size both ways (DDP, FSDP's DCP, ZeRO-3's universal format), a falling held-out loss, each
phase named in the traces, and switching strategy mid-training (init_from).

These questions are about torch and DeepSpeed; what Ray Train adds (registration, restarts,
Ray Data reads) is tested in tests/e2e/, where every job also runs through Ray at least once.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
from conftest import REPO
from observability_checks import assert_held_out_loss_fell, assert_trace_has_step_ranges
from sample_log import committed_samples
from weights import assert_bitwise_equal, assert_close_weights, final_weights

from dist.gloo import Corpus, GlooGroup, train_job
from shared.checkpoint import init_from
from shared.config.cli import build_config

STEPS = {"max_steps": "16", "checkpoint_every": "8"}
VARIANTS = {
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "zero1": ("zero", {"zero_stage": "1"}),
    "zero2": ("zero", {"zero_stage": "2"}),
    "zero3": ("zero", {"zero_stage": "3"}),
    # Offload moves state to CPU memory; it may not change the math.
    "zero3_offload": ("zero", {"zero_stage": "3", "offload_optimizer": "true",
                               "offload_params": "true"}),
}  # fmt: skip


def job_config(job: str, storage: Path, corpus_source, **overrides: str):
    """The job's smoke settings, as its main.py resolves them, with ``overrides``."""
    path = REPO / "jobs" / job / "main.py"
    spec = importlib.util.spec_from_file_location(f"jobs_{job}_main", path)
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    cfg_class = {"ddp": "TrainConfig", "fsdp": "FSDPConfig", "zero": "ZeroConfig",
                 "tp2d": "TP2DConfig"}[job]  # fmt: skip
    from shared import config

    settings = {"storage_path": str(storage), "dataset": corpus_source.dataset,
                "tokenizer": corpus_source.tokenizer, **overrides}  # fmt: skip
    cfg = build_config(getattr(config, cfg_class), main.PROFILES, "smoke", settings)
    cfg.job = job
    return cfg


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from shared.data import generate_news_corpus, tokenizer_spec
    from shared.runtime.torchrun import packed_blocks

    source = generate_news_corpus(str(tmp_path_factory.mktemp("data")), num_rows=1000, seed=0)
    blocks = packed_blocks(source.dataset, source.tokenizer, "text", 64)
    return source, Corpus(blocks, tokenizer_spec(source.tokenizer))


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """One gloo group per world size, started on first use and kept for the module."""
    started: dict[int, GlooGroup] = {}
    directory = str(tmp_path_factory.mktemp("gloo"))

    def get(world: int) -> GlooGroup:
        if world not in started or not started[world]._procs:
            started[world] = GlooGroup(world, directory)
        return started[world]

    yield get
    for group in started.values():
        group.close()


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("strategies")


@pytest.fixture(scope="module")
def attempt(groups, corpus, storage):
    """``attempt(job, world, **settings) -> (rank 0's summary, rank 0's stdout)``."""
    source, blocks = corpus

    def run(job: str, world: int = 2, **settings: str):
        cfg = job_config(job, storage, source, num_workers=str(world), **settings)
        if cfg.init_from:
            init_from.check(cfg, blocks.spec["vocab_size"], blocks.spec["eos_token_id"])
        group = groups(world)
        summaries = group.run(train_job, job, cfg, blocks)
        assert summaries[0]["status"] == "succeeded", summaries[0]
        return summaries[0], group.output[0]

    return run


def losses(summary: dict) -> dict[int, float]:
    rows = Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, rows)}


@pytest.fixture(scope="module")
def runs(attempt) -> dict[str, dict]:
    """One uninterrupted 16-step run per strategy, same seed, model and data; steps 3-5
    profiled (the profiler only observes: the losses must still match)."""
    return {
        name: attempt(job, **extra, **STEPS, run_name=name, profile_steps="3-5")[0]
        for name, (job, extra) in VARIANTS.items()
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
    strategy, each row read from the packed blocks once."""
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
def test_stop_and_resume_continues_the_same_trajectory(name, runs, attempt):
    """Stopped at step 8 and resumed on as many ranks: model, optimizer, LR schedule, data
    position and RNG all restored, so the CPU float ops repeat exactly: the same losses and
    bitwise the same weights as the uninterrupted run (model.pt, DCP shards, DeepSpeed)."""
    job, extra = VARIANTS[name]
    run = f"resume-{name}"
    first, _ = attempt(job, **extra, **STEPS, run_name=run, stop_at_step="8")
    assert first["steps"] == 8
    second, _ = attempt(job, **extra, **STEPS, run_name=run)
    assert second["resumed_from_step"] == 8 and second["steps"] == 16
    resumed, uninterrupted = losses(second), losses(runs[name])
    assert sorted(resumed) == list(range(1, 17))
    assert [resumed[s] for s in range(9, 17)] == [uninterrupted[s] for s in range(9, 17)]
    assert_bitwise_equal(final_weights(second), final_weights(runs[name]))


# A world size's settings with the same global batch of 32 (the resume contract refuses
# another batch): 1 rank accumulates 4 micro-batches of 8, 2 ranks 2 each.
ACCUMULATION = {1: "4", 2: "2"}


@pytest.mark.parametrize("job, sizes", [("fsdp", (2, 1, 2)), ("ddp", (1, 2, 1))])
def test_a_checkpoint_resumes_on_another_world_size_both_ways(job, sizes, runs, attempt):
    """Steps 1-8, 9-12 and 13-16 on the world sizes given, each attempt stopping mid-epoch and
    the next resuming at the other size: DCP stores each tensor's global shape and every
    shard's offset, so 1 rank loads what 2 wrote and back; the data position is in samples of
    the epoch's order, so every size finishes exactly the global batches left."""
    run, reference = f"resize-{job}", runs[job]
    attempts = []
    for size, stop in zip(sizes, ("8", "12", "0"), strict=True):
        summary, _ = attempt(job, size, **STEPS, run_name=run, stop_at_step=stop,
                             grad_accum=ACCUMULATION[size])  # fmt: skip
        attempts.append(summary)
    uninterrupted = losses(reference)
    for size, start, summary in zip(sizes, (0, 8, 12), attempts, strict=True):
        assert summary["world_size"] == size and summary["resumed_from_step"] == (start or None)
        # The same samples in the same steps, summed in another order: fp32 rounding only.
        initial = summary["attempt_initial_loss"]
        assert initial == pytest.approx(uninterrupted[start + 1], rel=1e-4)
        # FSDP: one rank holds all of the model, twice the 2-rank shard; DDP: all on each.
        params = reference["model_state_bytes_per_rank"]["params"]
        expected = 2 * params if job == "fsdp" and size == 1 else params  # 2-rank shards pad
        assert summary["model_state_bytes_per_rank"]["params"] == pytest.approx(expected, rel=0.01)
    last = attempts[-1]
    assert last["steps"] == 16 and losses(last)[16] == pytest.approx(uninterrupted[16], rel=1e-4)
    assert_trained_the_uninterrupted_samples(last, reference, attempt_steps=4)
    assert_close_weights(final_weights(last), final_weights(reference))


def test_zero3_resumes_on_one_rank_then_on_two_through_the_universal_format(runs, attempt):
    """DeepSpeed loads its own checkpoint only on as many ranks as wrote it; a ZeRO-3 run
    that changes its world size goes through the universal format, both ways: 2 ranks to
    step 6, 1 rank (4 micro-batches) to step 11, 2 ranks to step 16."""
    common = dict(zero_stage="3", **STEPS, run_name="zero3-resize")
    attempt("zero", 2, **common, stop_at_step="6")
    one, shrink_output = attempt("zero", 1, **common, stop_at_step="11", grad_accum="4")
    assert "ZeRO checkpoint of world size 2 loaded at world size 1" in shrink_output
    two, grow_output = attempt("zero", 2, **common)
    assert "ZeRO checkpoint of world size 1 loaded at world size 2" in grow_output
    assert (one["resumed_from_step"], one["steps"]) == (6, 11)
    assert (two["world_size"], two["resumed_from_step"], two["steps"]) == (2, 11, 16)
    assert_trained_the_uninterrupted_samples(two, runs["zero3"], attempt_steps=5)
    # Model, optimizer moments and schedule carried across both resizes: the uninterrupted
    # run's losses up to fp32 summation order.
    uninterrupted, resized = losses(runs["zero3"]), losses(two)
    assert one["attempt_initial_loss"] == pytest.approx(uninterrupted[7], rel=1e-4)
    assert [resized[s] for s in range(12, 17)] == pytest.approx(
        [uninterrupted[s] for s in range(12, 17)], rel=1e-4
    )


def assert_trained_the_uninterrupted_samples(resized: dict, reference: dict, attempt_steps: int):
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
    "fsdp-to-zero2": ("fsdp", ("zero", {"zero_stage": "2"}), "weights loaded, optimizer state "
                      "fresh (fsdp -> zero)"),
    "ddp-to-fsdp": ("ddp", ("fsdp", {}), "weights loaded, optimizer state fresh (ddp -> fsdp)"),
    "fsdp-to-fsdp": ("fsdp", ("fsdp", {}), "weights and optimizer state loaded (fsdp -> fsdp)"),
}  # fmt: skip


def switched_run(name: str, runs, attempt, stop_at_step: int) -> tuple[dict, str]:
    source, (job, extra), _ = SWITCHES[name]
    path = Path(runs[source]["run_dir"], "step_000008")
    return attempt(job, **extra, **STEPS, run_name=name, init_from=str(path),
                   stop_at_step=str(stop_at_step))  # fmt: skip


def metrics_rows(summary: dict) -> dict[int, dict]:
    rows = Path(summary["run_dir"], "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, rows)}


@pytest.mark.parametrize("name", ["fsdp-to-zero2", "ddp-to-fsdp"])
def test_init_from_another_strategy_continues_at_the_source_runs_loss(name, runs, attempt):
    source, _, verdict = SWITCHES[name]
    summary, stdout = switched_run(name, runs, attempt, stop_at_step=9)
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


def test_init_from_the_same_strategy_also_carries_the_optimizer_state(runs, attempt):
    """fsdp -> fsdp reads the DCP optimizer shards too: the trajectory stays the source's
    after the first step (with a fresh AdamW, step 10 differs by ~1e-2)."""
    summary, stdout = switched_run("fsdp-to-fsdp", runs, attempt, stop_at_step=10)
    assert SWITCHES["fsdp-to-fsdp"][2] in stdout
    switched, uninterrupted = metrics_rows(summary), metrics_rows(runs["fsdp"])
    assert sorted(switched) == [9, 10]
    for step in (9, 10):
        assert switched[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], rel=1e-6)


def test_the_harness_reports_a_failing_rank_instead_of_hanging(groups):
    """A rank that raises ends the call with its traceback; the next call gets a new group."""
    with pytest.raises(RuntimeError, match="(?s)rank 0:.*ZeroDivisionError"):
        groups(2).run(divmod, 1, 0)
    assert groups(2).run(os.getpid) != []
