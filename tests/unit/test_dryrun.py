"""make dry-run: every job's full profile at its job.yaml world size on one CPU (fake process
group, meta parameters, one real block), with the planner's and the traced bytes side by side.
No cluster, no GPU; each run takes seconds (tens on a loaded 2-core machine)."""

from __future__ import annotations

import re

import pytest
import torch

from shared.planner import dryrun


def run(capsys, job: str, *overrides: str, profile: str = "full") -> tuple[int, str, str]:
    try:
        code = dryrun.main(["--job", job, "--profile", profile, *overrides])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def table(out: str) -> dict[str, tuple[str, str]]:
    rows = {}
    for line in out.splitlines():
        match = re.fullmatch(r"  (\w+)\s+(\S+ \w+|\(planner\))\s+(\S+ \w+|\(planner\))", line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3))
    return rows


def to_bytes(cell: str) -> float:
    value, unit = cell.split()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


DDP_JOBS = ("ddp", "fault_tolerance")


@pytest.mark.parametrize("job, world", [("ddp", 4), ("fault_tolerance", 4), ("fsdp", 4),
                                        ("zero", 4), ("tp2d", 8)])  # fmt: skip
def test_every_full_profile_dry_runs_at_its_job_yaml_world_size(capsys, job, world):
    compute = dryrun.compute_config(job)
    assert compute.gpus == world  # the job.yaml's GPUs are the profile's workers
    code, out, err = run(capsys, job)
    assert code == 0, err
    assert f"world: {world} ranks" in out and "fits: " in out
    rows = table(out)
    assert set(rows) == {"params", "grads", "optimizer", "activations", "buffers", "total"}
    if job == "zero":
        assert "not traced" in out and "estimate_zero3_model_states_mem_needs" in out
        return
    # Model states: the planner's layout equals the shards and the optimizer step exactly;
    # DDP's buffers (one gradient-sized set of buckets) equal its reducer's buckets.
    exact = ("params", "grads", "optimizer") + (("buffers",) if job in DDP_JOBS else ())
    for name in exact:
        assert rows[name][0] == rows[name][1], name
    planned, traced = (to_bytes(c) for c in rows["activations"])
    assert traced == pytest.approx(planned, rel=0.05)


def test_fsdp_shards_are_a_quarter_of_ddps(capsys):
    _, ddp, _ = run(capsys, "ddp")
    _, fsdp, _ = run(capsys, "fsdp")
    ddp_params = to_bytes(table(ddp)["params"][1])
    fsdp_params = to_bytes(table(fsdp)["params"][1])
    assert fsdp_params == pytest.approx(ddp_params / 4, rel=0.01)  # padding: rank 0 a bit more


def test_a_tp_size_that_does_not_divide_the_heads_is_one_sentence_and_exit_2(capsys):
    code, out, err = run(capsys, "tp2d", "tp=8", "dp=1", "num_workers=8")
    assert code == 2 and out == ""
    assert err == "error: tp (8) must divide the attention heads of llama-500m (12).\n"


def test_a_model_that_cannot_fit_the_gpu_exits_1_saying_so(capsys):
    code, out, err = run(capsys, "fsdp", "model=gpt2-xl")
    assert code == 1
    assert err.startswith("error: gpt2-xl with dp=4 does not fit the T4: ")
    assert err.count("\n") == 1


def test_a_job_without_a_model_is_refused(capsys):
    code, _, err = run(capsys, "env_check")
    assert code == 2 and err.startswith("error: job 'env_check' cannot be dry-run")


def test_a_7b_llama_at_64_ranks_dry_runs_on_a_node_that_holds_its_tp_group(capsys):
    """tp=8 cannot run on the job.yaml's 4-GPU L4 nodes (a TP group stays inside a node): the
    dry run moves to the project's 8-GPU node and says so, instead of judging an impossible
    layout against the L4 (where it once failed to 'fit')."""
    code, out, err = run(capsys, "tp2d", "model=llama-7b", "dp=8", "tp=8", "num_workers=64")
    assert code == 0, err
    assert "world: 64 ranks (dp=8 x tp=8)" in out
    assert ("note: jobs/tp2d/job.yaml's nodes have 4 GPUs, too few for a TP group of 8; "
            "dry-running on compute_configs/8xH100.yaml's node instead") in out  # fmt: skip
    assert "compute config (compute_configs/8xH100.yaml): 1 x 8 H100" in out
    assert "note: 64 workers need 64 GPUs" in out  # 8 such nodes: max_nodes must grow
    rows = table(out)
    for name in ("params", "grads", "optimizer", "activations"):
        assert rows[name][0] == rows[name][1], name
    assert "fits: " in out


def test_compute_picks_a_compute_config_and_bad_names_are_one_sentence(capsys):
    code, out, _ = run(capsys, "fsdp", "--compute", "8xH100")
    assert code == 0 and "compute config (compute_configs/8xH100.yaml): 1 x 8 H100" in out
    code, out, err = run(capsys, "tp2d", "--compute", "2x4xL4", "tp=8", "dp=1",
                         "num_workers=8", "model=llama-7b")  # fmt: skip
    assert code == 2 and out == ""
    assert err == ("error: tp=8 needs a TP group inside one node; compute_configs/2x4xL4.yaml "
                   "has 4 GPUs per node.\n")  # fmt: skip
    code, _, err = run(capsys, "ddp", "--compute", "16xB200")
    assert code == 2 and err.startswith("error: no compute config '16xB200' in compute_configs/")


def kept_bytes_both_ways(forward, shape, dtype, params: set[int]) -> list[dict[str, int]]:
    """The bytes ``forward`` keeps for its backward (parameters excluded), with the matmuls
    computed and with their outputs only allocated, in that order."""
    from shared.planner.measure import LiveStorageTracker

    kept = []
    for skip in (False, True):
        x = torch.randn(*shape, dtype=dtype, requires_grad=True)
        tracker = LiveStorageTracker(skip_matmuls=skip)
        with tracker:
            y = forward(x)
        kept.append(tracker.alive_bytes(exclude=params))
        assert (tracker.allocated_matmuls > 0) == skip  # the shortcut was (not) taken
        del y
    return kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allocating_the_matmul_outputs_keeps_exactly_the_bytes_of_computing_them(dtype):
    """The dry run's activation trace allocates each matmul's output instead of computing it
    (a bf16 GPT-2 124M block took ~100 s here computed): a GPT-2 block and a Llama block keep
    the same storages, byte for byte, either way."""
    from transformers import GPT2Config
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from shared.models.llama import Block, LlamaPreset
    from shared.planner.dryrun.trace import _call

    config = GPT2Config(n_embd=64, n_head=4, n_layer=1, n_positions=32, resid_pdrop=0.0,
                        attn_pdrop=0.0, embd_pdrop=0.0)  # fmt: skip
    config._attn_implementation = "sdpa"
    llama = LlamaPreset(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=32)
    for block in (GPT2Block(config, layer_idx=0), Block(llama)):
        block = block.to(dtype).train()
        params = {p.untyped_storage()._cdata for p in block.parameters()}
        computed, allocated = kept_bytes_both_ways(_call(block), (2, 32, 64), dtype, params)
        assert computed == allocated and computed["other"] > 0, type(block).__name__


def test_allocating_the_matmul_outputs_of_a_tp_sharded_block_keeps_the_same_bytes():
    """Under TP the matmuls take DTensors: their outputs are allocated with the placements the
    real op would give (a 2-rank fake process group), the same storages either way."""
    from torch.distributed.tensor.parallel import parallelize_module

    from shared.models.llama import Block, LlamaPreset
    from shared.parallel.tp import BLOCK_PLAN
    from shared.planner.measure import _local, _tp_group

    preset = LlamaPreset(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=160, max_seq_len=32)
    with _tp_group(2) as mesh:
        block = parallelize_module(Block(preset).to(torch.bfloat16), mesh, BLOCK_PLAN).train()
        params = {_local(p).untyped_storage()._cdata for p in block.parameters()}
        # 16 tokens: the sequence-sharded input of 32 tokens at tp=2.
        computed, allocated = kept_bytes_both_ways(block, (2, 16, 64), torch.bfloat16, params)
    assert computed == allocated and computed["other"] > 0
