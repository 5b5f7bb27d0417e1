"""shared.planner: published worked examples, the model inventory and the CLI contract.

The planner against the bytes the real strategies hold: tests/dist/test_state_bytes.py
(3 gloo ranks, so the padding shows), tests/dist/test_strategies.py (ddp, fsdp, zero 1/2/3,
offload through the shared loop) and tests/e2e/test_tp2d.py (TP x FSDP).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO

from shared import planner
from shared.planner import (
    PRECISIONS,
    Settings,
    estimate_all,
    from_preset,
    layer_activation_bytes,
    measure,
    zero_paper_bytes_per_gpu,
)

GB = 1e9  # the ZeRO paper's GB


# ------------------------------------------------------------------------------------------
# Rajbhandari et al. 2020 (ZeRO), table 1: per-device model-state memory, mixed-precision
# Adam (K = 12), for the 7.5B, 128B and 1T models. Printed to 3 significant digits.


@pytest.mark.parametrize(
    "psi, n_d, printed",
    [
        # The worked example of section 5.4 / figure 1: 7.5B parameters on 64 GPUs.
        (7.5e9, 64, (120, 31.4, 16.6, 1.88)),
        (7.5e9, 1, (120, 120, 120, 120)),
        (7.5e9, 4, (120, 52.5, 41.3, 30)),
        (7.5e9, 16, (120, 35.6, 21.6, 7.5)),
        (128e9, 64, (2048, 536, 284, 32)),
        (1e12, 16, (16000, 4750, 2875, 1000)),
    ],
)
def test_zero_paper_table_1(psi, n_d, printed):
    for stage, expected in enumerate(printed):
        got = zero_paper_bytes_per_gpu(psi, n_d, stage) / GB
        digits = len(str(expected).replace(".", "").lstrip("0"))  # what the paper printed
        assert got == pytest.approx(expected, rel=0.5 * 10 ** (1 - max(digits, 3))), stage


def test_zero_paper_gpt2_1_5b_needs_24_gb_of_model_states():
    """Section 3.1: 'a model with 1.5 Billion parameters ... at least 24 GB'."""
    assert zero_paper_bytes_per_gpu(1.5e9, 1, 0) == 24 * GB


@pytest.mark.parametrize("preset, n_d", [("gpt2-xl", 64), ("llama-7b", 8), ("llama-70b", 512)])
def test_per_tensor_layout_agrees_with_the_paper_arithmetic(preset, n_d):
    """The planner lays out every tensor as the frameworks do; in bf16 its ZeRO numbers differ
    from 16 * Psi / N_d only by padding and the step counters (< 1e-4 here)."""
    model = from_preset(preset)
    rows = estimate_all(model, Settings(gpus=n_d, precision=PRECISIONS["bf16"]))
    by_key = {r.key: r for r in rows}
    for key, stage in (("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3), ("fsdp2", 3)):
        state = sum(by_key[key].state.values())
        paper = zero_paper_bytes_per_gpu(model.n_params, n_d, stage)
        assert state == pytest.approx(paper, rel=1e-4), key


# ------------------------------------------------------------------------------------------
# Korthikanti et al. 2022: table 2's per-layer formulas and the paper's own numbers.

# Table 3 of the paper: (heads, hidden, layers) at s = 2048, t = 8.
PAPER_MODELS = {"22B": (64, 6144), "175B": (96, 12288), "530B": (128, 20480), "1T": (160, 25600)}


def test_korthikanti_table_2_formulas():
    s, b, t = 2048, 1, 8
    a, h = PAPER_MODELS["175B"]
    sbh, x = s * b * h, 5 * a * s / h

    def layer(**kw):
        return layer_activation_bytes(s, b, h, a, **kw)

    assert layer() == pytest.approx(sbh * (34 + x))
    assert layer(t=t) == pytest.approx(sbh * (10 + 24 / t + x / t))
    assert layer(t=t, sp=True) == pytest.approx(sbh * (34 / t + x / t))
    assert layer(t=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert layer(t=t, sp=True, recompute="selective") == pytest.approx(sbh * 34 / t)
    assert layer(recompute="full") == pytest.approx(sbh * 2)
    # Tensor parallelism of size 1 is no parallelism: 10 + 24 = 34.
    assert layer(t=1) == pytest.approx(layer())


def test_korthikanti_selective_recompute_saves_70_percent_for_gpt3_and_65_for_mt_nlg():
    """Section 5: 5as/h = 80 for GPT-3 175B, so dropping it saves 80 / 114 = 70%; 65% for
    MT-NLG 530B."""
    for name, saving in (("175B", 0.70), ("530B", 0.65)):
        a, h = PAPER_MODELS[name]
        full = layer_activation_bytes(2048, 1, h, a)
        selective = layer_activation_bytes(2048, 1, h, a, recompute="selective")
        assert 1 - selective / full == pytest.approx(saving, abs=0.005), name
    a, h = PAPER_MODELS["175B"]
    assert 5 * a * 2048 / h == 80


def test_korthikanti_sequence_parallel_plus_selective_is_5x_below_tensor_parallel():
    """The abstract: together they reduce activation memory by 5x (per layer, t = 8)."""
    for name, (a, h) in PAPER_MODELS.items():
        baseline = layer_activation_bytes(2048, 1, h, a, t=8)
        both = layer_activation_bytes(2048, 1, h, a, t=8, sp=True, recompute="selective")
        assert 4.9 < baseline / both < 6.3, name


# ------------------------------------------------------------------------------------------
# the model inventory is the real models' parameter list


@pytest.mark.parametrize("preset", ["gpt2-tiny", "gpt2", "gpt2-xl", "llama-tiny", "llama-500m"])
def test_inventory_matches_the_models_the_jobs_build(preset):
    from shared.models.gpt2 import build_gpt2
    from shared.models.llama import LLAMA_PRESETS, build_llama

    with torch.device("meta"):  # shapes only: even gpt2-xl builds instantly
        if preset in LLAMA_PRESETS:
            model = build_llama(preset, 50257)
        else:
            model = build_gpt2(preset, 50257, 1024)
    real = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    assert [(t.name, t.shape) for t in from_preset(preset, seq_len=1024).tensors] == real


def test_gpt2_124m_has_124m_parameters():
    assert from_preset("gpt2").n_params == 124_439_808


def test_hf_config_json_sizes_the_model_transformers_builds(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig

    for config in (
        LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=3,
                    num_attention_heads=8, num_key_value_heads=2, vocab_size=1000),
        MixtralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=500,
                      num_local_experts=4),
    ):  # fmt: skip
        path = tmp_path / type(config).__name__ / "config.json"
        path.parent.mkdir()
        path.write_text(config.to_json_string())
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        expected = sum(p.numel() for p in model.parameters())
        assert planner.from_hf_config(str(path)).n_params == expected, type(config).__name__


# ------------------------------------------------------------------------------------------
# the command line

ACCEPTANCE = ["--preset", "gpt2-xl", "--gpus", "8", "--gpu-mem", "16GiB"]


def cli(*args: str) -> subprocess.CompletedProcess:
    """What `make plan ARGS="..."` runs."""
    return subprocess.run(
        [sys.executable, "-m", "shared.planner", *args], capture_output=True, text=True,
        timeout=60, cwd=REPO,
    )  # fmt: skip


def run_main(capsys, *args: str) -> tuple[int, str, str]:
    try:
        code = planner.main(args)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_acceptance_command_prints_the_table_and_a_recommendation():
    result = cli(*ACCEPTANCE)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in ("DDP", "ZeRO-1", "ZeRO-2", "FSDP2", "ZeRO-3", "ZeRO-3 + CPU offload", "TP + SP",
                 "TP x DP (FSDP on dp)"):  # fmt: skip
        assert f"\n{name} " in out, name
    assert "params" in out and "activations" in out and "fits" in out
    # 16 bytes/param x 1.56B = 23 GiB of model states: DDP cannot fit 16 GiB; ZeRO can.
    recommended = next(line for line in out.splitlines() if line.startswith("recommended: "))
    assert recommended.startswith("recommended: ZeRO-1 with micro-batch 1, recompute none - ")
    assert "model-state-bound" in recommended


def test_json_gives_the_same_numbers_as_the_table(capsys):
    code, table, _ = run_main(capsys, *ACCEPTANCE, "--tp", "1")
    assert code == 0
    code, text, _ = run_main(capsys, *ACCEPTANCE, "--tp", "1", "--json")
    assert code == 0
    plan = json.loads(text)
    lines = {line.split("  ")[0]: line for line in table.splitlines()}
    for row in plan["strategies"]:
        line = lines[row["name"]]
        if not row["applicable"]:
            assert line.rstrip().endswith("n/a")
            continue
        cells = [planner.format_size(row["bytes_per_gpu"][c]) for c in planner.COLUMNS]
        assert " ".join(line.split()).count(" ".join(cells)) == 1, row["name"]
        assert line.rstrip().endswith("yes" if row["fits"] else "no")
    rec = plan["recommendation"]
    assert rec["settings"] == {"micro_batch": 1, "recompute": "none"}
    assert f"recommended: ZeRO-1 with micro-batch 1, recompute none - {rec['reason']}" in table


def test_smoke_sized_plan_recommends_ddp(capsys):
    args = "--preset gpt2-tiny --vocab 512 --seq-len 64 --gpus 2 --gpu-mem 1GiB --precision fp32"
    code, out, _ = run_main(capsys, *args.split())
    assert code == 0 and "recommended: DDP with micro-batch 8, recompute none - the whole" in out


def test_a_layer_too_wide_recommends_tensor_parallelism(capsys):
    args = "--preset llama-70b --gpus 16 --gpu-mem 80GiB"
    code, text, _ = run_main(capsys, *args.split(), "--json")
    assert code == 0
    rec = json.loads(text)["recommendation"]
    assert rec["strategy"] == "tp_fsdp" and "a layer is too wide" in rec["reason"]
    assert "at micro-batch 1 with full recomputation" in rec["reason"]


def test_moe_and_long_sequences_are_advised(capsys, tmp_path):
    from transformers import MixtralConfig

    path = tmp_path / "config.json"
    path.write_text(MixtralConfig(num_local_experts=8).to_json_string())
    code, text, _ = run_main(capsys, "--config", str(path), "--seq-len", "65536", "--gpu", "h100",
                             "--json")  # fmt: skip
    assert code == 0
    advice = " ".join(json.loads(text)["recommendation"]["advice"])
    assert "expert parallelism (EP)" in advice and "context parallelism" in advice


def test_params_only_input_uses_the_zero_arithmetic(capsys):
    args = "--params 7.5e9 --layers 32 --hidden 4096 --heads 32 --vocab 50000 --gpus 64 --gpu h100"
    code, text, _ = run_main(capsys, *args.split(), "--gpus-per-node", "8", "--json")
    assert code == 0
    rows = {r["key"]: r for r in json.loads(text)["strategies"]}
    state = sum(rows["zero1"]["model_state_bytes_per_rank"].values())
    assert state == pytest.approx(31.4 * GB, rel=2e-3)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--preset", "gpt2", "--gpus", "0"], "error: --gpus must be >= 1 (got 0)."),
        (["--preset", "gpt2", "--gpu", "h100", "--tp", "5"],
         "error: --tp (5) must divide the 12 attention heads of gpt2."),
        (["--preset", "gpt2-huge"], "error: unknown preset 'gpt2-huge'; valid presets: "),
        (["--preset", "gpt2", "--gpu", "h100", "--gpus", "6", "--tp", "4"],
         "error: --gpus (6) must be divisible by --tp (4)."),
        (["--preset", "gpt2", "--gpu-mem", "lots"], "error: cannot parse --gpu-mem 'lots'"),
        (["--preset", "gpt2", "--gpu-mem", "16XB"], "error: cannot parse --gpu-mem '16XB'"),
        (["--params", "1e9", "--layers", "24"],
         "error: --params with shape flags needs --hidden, --heads, --vocab too"),
        (["--preset", "gpt2"], "error: give the GPU: --gpu (t4, l4, a10g, a100-40g"),
        (["--preset", "gpt2", "--gpu-mem", "16"],
         "error: --gpu-mem '16' is 16 bytes: give a unit, such as 16GiB or 16GB."),
        (["--preset", "gpt2", "--gpu", "t4", "--precision", "bf16"],
         "error: the T4 has no native bf16 (it is emulated, slowly): use --precision fp16"),
        (["--preset", "gpt2", "--gpu", "v100"], "error: argument --gpu: invalid choice"),
        (["--preset", "gpt2", "--gpus", "many"], "error: argument --gpus: invalid int value"),
        (["--gpus", "8"], "error: one of the arguments --preset --config --params is required"),
    ],
)  # fmt: skip
def test_bad_input_gives_one_line_and_exit_2(capsys, args, message):
    code, out, err = run_main(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(message), err


def test_bad_input_from_the_real_command_line():
    result = cli("--preset", "gpt2", "--gpus", "0")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == "error: --gpus must be >= 1 (got 0).\n"


@pytest.mark.parametrize(
    "text, size",
    [("16GiB", 16 * 1024**3), ("80GB", 80 * 10**9), ("80 GB", 80 * 10**9),
     ("17179869184", 17179869184), ("1.5e9", 1_500_000_000), ("512MiB", 512 * 1024**2)],
)  # fmt: skip
def test_memory_sizes_parse(text, size):
    assert planner.parse_size(text, "--gpu-mem") == size


# ------------------------------------------------------------------------------------------
# advice without hidden defaults, and model states from the parameter count alone


def plan_json(capsys, args: str) -> dict:
    code, text, err = run_main(capsys, *args.split(), "--json")
    assert code == 0, err
    return json.loads(text)


def test_1b_on_8_t4s_gets_a_sharded_data_parallel_strategy_in_fp16_not_tp(capsys):
    """The issue's acceptance line: it used to say 'TP + SP' (tp=8 over PCIe for 1B)."""
    args = "--params 1e9 --layers 24 --hidden 2048 --heads 16 --vocab 50257 --gpus 8 --gpu t4"
    plan = plan_json(capsys, args)
    assert plan["settings"]["precision"] == "fp16"  # a T4 has no native bf16
    assert plan["settings"]["intra_node_link"] == "pcie"
    assert plan["settings"]["gpu_mem_bytes"] == 15360 * 1024**2
    rec = plan["recommendation"]
    assert rec["strategy"] in ("zero1", "zero2", "fsdp2", "zero3")
    # 1e9 x (2 + 2 + 12/8) = 5.5 GB of ZeRO-1 states + 3.6 GiB of activations at 1 x 2048.
    assert rec == {**rec, "strategy": "zero1", "settings": {"micro_batch": 1, "recompute": "none"}}
    code, out, _ = run_main(capsys, *args.split())
    recommended = next(line for line in out.splitlines() if line.startswith("recommended: "))
    assert recommended.startswith("recommended: ZeRO-1 with micro-batch 1, recompute none - ")
    assert "assumed: precision fp16 (the T4 lacks native bf16" in out


def test_7b_on_8x80gb_shards_the_data_parallel_states_and_never_uses_tp(capsys):
    plan = plan_json(capsys, "--preset llama-7b --gpus 8 --gpu a100-80g")
    rec = plan["recommendation"]
    assert rec["strategy"] in ("zero1", "zero2", "fsdp2", "zero3")
    # At a fixed micro-batch of 8 sequences x 4096 tokens the activations need recomputation.
    plan = plan_json(capsys, "--preset llama-7b --gpus 8 --gpu a100-80g --micro-batch 8")
    rec = plan["recommendation"]
    assert rec["strategy"] == "zero1" and rec["settings"] == {"micro_batch": 8, "recompute": "full"}


def test_7b_on_8_l4s_is_fsdp_with_activation_checkpointing(capsys):
    """24 GB GPUs: ZeRO-1/2 keep the full 2-byte parameters (13.5 GB) and cannot fit; FSDP2
    shards everything and needs full recomputation for the activations."""
    rec = plan_json(capsys, "--preset llama-7b --gpus 8 --gpu l4")["recommendation"]
    assert rec["strategy"] == "fsdp2"
    assert rec["settings"]["recompute"] == "full"


def test_the_gpu_count_and_link_are_never_assumed_silently(capsys):
    code, out, _ = run_main(capsys, "--preset", "gpt2", "--gpu-mem", "16GiB")
    assert code == 0
    assert "assumed: 8 GPUs (--gpus to change)" in out
    assert "assumed: 8 GPUs per node (--gpus-per-node to change)" in out
    assert "assumed: NVLink between a node's GPUs, for TP (no --gpu given; --link pcie" in out
    given = plan_json(capsys, "--preset gpt2 --gpu-mem 16GiB --gpus 16 --gpus-per-node 8 "
                              "--link pcie")  # fmt: skip
    assert given["settings"]["intra_node_link"] == "pcie"
    assert not [note for note in given["settings"]["assumed"] if "GPUs" in note]


def test_tp_forced_by_a_given_micro_batch_says_so_truthfully(capsys):
    """With --micro-batch 8 FSDP2 cannot fit 8 L4s, so TP it is; the reason once claimed
    FSDP2 had been tried "at micro-batch 1 with full recomputation", which it had not."""
    rec = plan_json(capsys, "--preset llama-7b --gpus 8 --gpu l4 --micro-batch 8")["recommendation"]
    assert rec["strategy"] == "tp_sp"
    assert "at the --micro-batch given (leave it out to search)" in rec["reason"]
    assert "FSDP2 at micro-batch 8 (given) with full recomputation needs" in rec["reason"]
    assert "micro-batch 1" not in rec["reason"]


def test_llama_70b_on_64x80gb_gets_a_layout_that_fits_with_its_settings(capsys):
    plan = plan_json(capsys, "--preset llama-70b --gpus 64 --gpu h100")
    rec = plan["recommendation"]
    assert rec["strategy"] == "fsdp2"
    assert rec["settings"] == {"micro_batch": 4, "recompute": "full"}
    fitting = [r for r in plan["strategies"] if r["fits"]]
    assert {r["key"] for r in fitting} >= {"fsdp2", "zero3", "tp_fsdp"}
    # 32 sequences per step cannot spread over 64 data-parallel ranks: TP takes the rest.
    plan = plan_json(capsys, "--preset llama-70b --gpus 64 --gpu h100 --global-batch 32")
    rec = plan["recommendation"]
    assert rec["strategy"] == "tp_fsdp" and rec["settings"]["tp"] == 8
    assert rec["settings"]["grad_accum"] * rec["settings"]["micro_batch"] * 64 // 8 == 32


def test_precision_follows_the_gpu_and_fp16_holds_the_bf16_bytes(capsys):
    common = "--preset gpt2 --gpus 8"
    assert plan_json(capsys, f"{common} --gpu a10g")["settings"]["precision"] == "bf16"
    fp16 = plan_json(capsys, f"{common} --gpu a10g --precision fp16")["strategies"]
    bf16 = plan_json(capsys, f"{common} --gpu a10g --precision bf16")["strategies"]
    assert [r["model_state_bytes_per_rank"] for r in fp16] == [
        r["model_state_bytes_per_rank"] for r in bf16
    ]


def test_searched_rows_are_the_best_settings_that_fit(capsys):
    """Each row is its strategy at the least recomputation, then largest micro-batch, that fits;
    one step more memory (a doubled micro-batch) would not fit."""
    plan = plan_json(capsys, "--preset llama-7b --gpus 8 --gpu l4")
    budget = plan["settings"]["budget_bytes"]
    fsdp = next(r for r in plan["strategies"] if r["key"] == "fsdp2")
    assert fsdp["fits"] and fsdp["bytes_per_gpu"]["total"] <= budget
    bigger = plan_json(capsys, f"--preset llama-7b --gpus 8 --gpu l4 --micro-batch "
                               f"{2 * fsdp['micro_batch']} --recompute full")  # fmt: skip
    row = next(r for r in bigger["strategies"] if r["key"] == "fsdp2")
    assert not row["fits"]


def test_zero_paper_example_from_the_parameter_count_alone(capsys):
    """Rajbhandari et al. 2020, figure 1: 7.5B parameters on 64 GPUs, K = 12: 120 GB (DDP),
    31.4 GB (P_os), 16.6 GB (P_os+g), 1.88 GB (P_os+g+p) per GPU."""
    plan = plan_json(capsys, "--params 7.5e9 --gpus 64 --precision bf16")
    per_gpu = {r["key"]: r["model_state_bytes_per_gpu"] / GB for r in plan["strategies"]}
    for key, paper in (("ddp", 120), ("zero1", 31.4), ("zero2", 16.6), ("zero3", 1.88),
                       ("fsdp2", 1.88)):  # fmt: skip
        assert per_gpu[key] == pytest.approx(paper, rel=5e-3), key
    assert plan["recommendation"] is None
    assert plan["activations"] == "need --layers, --hidden, --heads, --vocab"
    result = cli("--params", "7.5e9", "--gpus", "64", "--precision", "bf16")
    assert result.returncode == 0, result.stderr
    assert "31.4 GB" in result.stdout and "1.88 GB" in result.stdout
    assert "activations need --layers, --hidden, --heads, --vocab" in result.stdout


def test_sdpa_drops_the_score_term_and_eager_keeps_it(capsys):
    """Issue 16: 7.5B at micro-batch 8 x 2048 printed 231 GiB of DDP activations with the
    5as/h term; without it (SDPA, what the templates run) about 71 GiB."""
    common = ("--params 7.5e9 --layers 32 --hidden 4096 --heads 32 --vocab 50257 --seq-len 2048 "
              "--gpus 8 --gpu h100 --micro-batch 8 --recompute none")  # fmt: skip
    rows = {a: {r["key"]: r for r in plan_json(capsys, f"{common} --attention {a}")["strategies"]}
            for a in ("sdpa", "eager")}  # fmt: skip
    sdpa = rows["sdpa"]["ddp"]["bytes_per_gpu"]["activations"] / 1024**3
    eager = rows["eager"]["ddp"]["bytes_per_gpu"]["activations"] / 1024**3
    assert eager == pytest.approx(231, rel=0.01) and sdpa == pytest.approx(71, rel=0.03)


# ------------------------------------------------------------------------------------------
# activations: the planner against the bytes autograd really keeps, per layer, on the CPU;
# docs/planner.md shows the same table


@pytest.mark.parametrize("point", measure.POINTS, ids=lambda p: p.label())
def test_planned_activations_match_the_measured_bytes_of_every_layer(point):
    per_layer, _ = measure.measure(point)
    planned = measure.planned_layer_bytes(point)
    assert len(per_layer) == point.layers
    for i, measured in enumerate(per_layer):
        assert measured == pytest.approx(planned, rel=0.05), f"layer {i}"


def test_measured_table_covers_both_models_tp_and_recompute():
    points = measure.POINTS
    assert {p.model for p in points} == {"gpt2", "llama"} and len(points) >= 6
    assert {p.tp for p in points} >= {1, 2, 4} and {p.recompute for p in points} >= {"none", "full"}


def test_eager_attention_keeps_the_score_term_that_sdpa_drops():
    """The measured formulas are for SDPA; --attention eager is Korthikanti et al.'s."""
    s, b, h, a = 2048, 1, 4096, 32
    eager = layer_activation_bytes(s, b, h, a)
    sdpa = layer_activation_bytes(s, b, h, a, attention="sdpa")
    assert eager - sdpa == pytest.approx(s * b * h * 5 * a * s / h)


@pytest.mark.parametrize(
    ("fixed", "says"),
    [
        ((), "not even with full recomputation and micro-batch 1;"),
        (("--micro-batch", "8"), "not even with full recomputation (micro-batch 8, as given);"),
        (("--recompute", "none"), "not even at micro-batch 1 (recompute none, as given);"),
        (("--micro-batch", "8", "--recompute", "none"),
         "at the given micro-batch 8 and recompute none (leave --micro-batch and --recompute out"),
    ],
)  # fmt: skip
def test_nothing_fits_names_only_what_the_search_tried(capsys, fixed, says):
    """A fixed --micro-batch or --recompute is never searched; the line once claimed it was."""
    args = ("--preset", "llama-70b", "--gpus", "1", "--gpu-mem", "2GiB", *fixed)
    _, out, _ = run_main(capsys, *args)
    line = next(x for x in out.splitlines() if x.startswith("recommended: "))
    assert line.startswith("recommended: nothing fits - no strategy fits 1 x "), line
    assert says in line, line
