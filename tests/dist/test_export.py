"""Hugging Face export from every strategy's checkpoint: the exported model's logits equal the
training model's on the same batch, for DDP, FSDP2, ZeRO 1/2/3 and TP x FSDP.

Each case trains 2 steps with the shared loop on real gloo ranks (no Ray: TorchrunSession
writes the same checkpoints with manifests), records the training model's logits on a fixed
batch (collectively, as the strategy needs), then exports in this process without any
process group and loads the result with ``AutoModelForCausalLM.from_pretrained``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tiny_corpus_blocks

from shared import config as config_module
from shared.config.run_settings import SETTINGS_FILE, settings_record
from shared.loop import train
from shared.models.gpt2 import build_gpt2
from shared.models.structure import unwrap
from shared.runtime.torchrun import TorchrunSession, rank_batches
from shared.runtime.worker import seed_everything

SEQ = 32
STEPS = 2
# fp32 both sides, same weights, same math up to kernel order: 1e-5 absolute (the issue's
# bound). A wrong RoPE permutation or a missing tie gives differences of order 0.1-1.
ATOL = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("data"))
    blocks, spec = tiny_corpus_blocks(directory, 400, SEQ)
    from shared.data import generate_news_corpus

    return blocks, spec, generate_news_corpus(directory, num_rows=400, seed=0).tokenizer


CASES = {
    "ddp": dict(cls="TrainConfig", world=2, kw={}),
    "fsdp": dict(cls="FSDPConfig", world=2, kw={}),
    "zero1": dict(cls="ZeroConfig", world=2, kw={"zero_stage": 1}),
    "zero2": dict(cls="ZeroConfig", world=2, kw={"zero_stage": 2}),
    "zero3": dict(cls="ZeroConfig", world=2, kw={"zero_stage": 3}),
    "tp2d": dict(cls="TP2DConfig", world=4,
                 kw={"model": "llama-tiny", "dp": 2, "tp": 2, "micro_batch_size": 4}),
}  # fmt: skip


def make_cfg(case: str, storage_path: str, tokenizer: str):
    spec = CASES[case]
    base = dict(model="gpt2-tiny", seq_len=SEQ, micro_batch_size=4, grad_accum=1,
                max_steps=STEPS, warmup_steps=1, checkpoint_every=STEPS, log_every=100,
                num_workers=spec["world"], lr=3e-3, storage_path=storage_path, run_name="r",
                job=case, tokenizer=tokenizer, tensorboard=False)  # fmt: skip
    return getattr(config_module, spec["cls"])(**{**base, **spec["kw"]})


def _strategy(case: str, cfg, spec: dict):
    cpu = torch.device("cpu")
    seed_everything(cfg.seed)
    if case == "tp2d":
        from shared.models.llama import build_llama
        from shared.parallel.fsdp import apply_fsdp
        from shared.parallel.tp import TP2DStrategy, apply_tp, device_mesh_2d

        mesh = device_mesh_2d(cpu, cfg.dp, cfg.tp)
        model = apply_fsdp(apply_tp(build_llama(cfg.model, spec["vocab_size"]), mesh["tp"]),
                           mesh["dp"])  # fmt: skip
        return TP2DStrategy(model, cfg, cpu, torch.float32), mesh["dp"].get_local_rank(), cfg.dp
    model = build_gpt2(cfg.model, spec["vocab_size"], SEQ, eos_token_id=spec["eos_token_id"])
    rank, world = dist.get_rank(), dist.get_world_size()
    if case == "ddp":
        from shared.parallel.ddp import DDPStrategy, apply_ddp

        return DDPStrategy(apply_ddp(model, cpu), cfg, cpu, torch.float32), rank, world
    if case == "fsdp":
        from shared.parallel.fsdp import FSDPStrategy, apply_fsdp, data_parallel_mesh

        model = apply_fsdp(model, data_parallel_mesh(cpu))
        return FSDPStrategy(model, cfg, cpu, torch.float32), rank, world
    from shared.parallel.zero import ZeroStrategy

    return ZeroStrategy(model, cfg, cpu, torch.float32), rank, world


def training_logits(case: str, strategy, batch: torch.Tensor) -> torch.Tensor:
    """The training model's logits, computed as the strategy needs (all ranks take part)."""
    model = strategy.model
    model.eval()
    with torch.no_grad():
        if case == "tp2d":
            return model(batch).full_tensor()  # vocab-sharded DTensor -> full logits
        if case == "ddp":
            model = unwrap(model)
        return model(input_ids=batch).logits


def _worker(rank, case, world, init_file, cfg, data, spec, batch, out):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # What torchrun (or Ray Train) sets and DeepSpeed reads; one node, so local rank = rank.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        strategy, data_rank, data_world = _strategy(case, cfg, spec)
        session = TorchrunSession(rank_batches(data, cfg.micro_batch_size, data_rank, data_world),
                                  cfg.run_dir, cfg.micro_batch_size, rank, world)  # fmt: skip
        train(cfg, strategy, session)
        logits = training_logits(case, strategy, batch)
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()


def train_case(case: str, tmp_path, corpus, **overrides):
    data, spec, tokenizer = corpus
    cfg = make_cfg(case, str(tmp_path / "runs"), tokenizer)
    for name, value in overrides.items():
        setattr(cfg, name, value)
    os.makedirs(cfg.run_dir, exist_ok=True)
    with open(os.path.join(cfg.run_dir, SETTINGS_FILE), "w") as f:
        json.dump(settings_record(cfg, cfg.global_batch_size), f, default=str)
    batch = data[-2:].clone()  # two sequences the 2 training steps did not use
    out = str(tmp_path / "logits.pt")
    world = CASES[case]["world"]
    mp.spawn(_worker, args=(case, world, str(tmp_path / "init"), cfg, data, spec, batch, out),
             nprocs=world)  # fmt: skip
    return cfg, batch, torch.load(out)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, corpus):
    """``trained(case)``: one 2-step run per case without evaluation, shared by the tests."""
    runs = {}

    def get(case: str):
        if case not in runs:
            runs[case] = train_case(case, tmp_path_factory.mktemp(case), corpus)
        return runs[case]

    return get


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, corpus):
    """A ddp run with checkpoints at steps 1 and 2 (shared by the tests of bad input)."""
    return train_case("ddp", tmp_path_factory.mktemp("ddp"), corpus, checkpoint_every=1)


@pytest.mark.parametrize("case", list(CASES))
def test_export_gives_the_training_models_logits(case, tmp_path, trained, request):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.export.__main__ import main as export_main

    if case == "ddp":
        cfg, batch, expected = request.getfixturevalue("ddp_run")
    else:
        cfg, batch, expected = trained(case)
    dest = str(tmp_path / "hf")
    argv = ["--job", case, "--run", "r", "--storage-path", cfg.storage_path, "--dest", dest]
    assert export_main(argv) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(dest))
    info = json.loads(Path(dest, "export_info.json").read_text())
    assert info["step"] == STEPS
    assert info["format"] == {"ddp": "ddp", "fsdp": "dcp", "tp2d": "dcp"}.get(case, "deepspeed")

    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32).eval()
    expected_class = "LlamaForCausalLM" if case == "tp2d" else "GPT2LMHeadModel"
    assert type(model).__name__ == expected_class
    with torch.no_grad():
        logits = model(input_ids=batch).logits
    assert logits.shape == expected.shape
    assert (logits - expected).abs().max().item() <= ATOL

    tokenizer = AutoTokenizer.from_pretrained(dest)
    prompt = tokenizer("the market", return_tensors="pt").input_ids
    generated = model.generate(prompt, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == prompt.shape[1] + 5


def test_rope_permutation_matters():
    """Without the rotary reordering the Llama export's logits are wrong (the check above
    would catch a wrong permutation): compare our model with a plain name mapping."""
    from shared.export import hf
    from shared.models.llama import LLAMA_PRESETS, build_llama

    seed_everything(0)
    ours = build_llama("llama-tiny", 64).eval()
    batch = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        expected = ours(batch)
        exported = hf.llama_hf_model(ours.state_dict(), LLAMA_PRESETS["llama-tiny"], None)
        good = exported(input_ids=batch).logits
        unpermuted = hf.llama_hf_model(ours.state_dict(), LLAMA_PRESETS["llama-tiny"], None)
        plain = {hf.LLAMA_NAMES.get(k, k): v for k, v in ours.state_dict().items()}
        for k, v in ours.state_dict().items():
            if k.startswith("layers."):
                layer, suffix = k.split(".", 2)[1:]
                plain[f"model.layers.{layer}.{hf.LLAMA_LAYER_NAMES[suffix]}"] = v
        unpermuted.load_state_dict({k: v for k, v in plain.items()
                                    if k in unpermuted.state_dict()})  # fmt: skip
        bad = unpermuted(input_ids=batch).logits
    assert (good - expected).abs().max().item() <= ATOL
    assert (bad - expected).abs().max().item() > 1e-3


def copy_run(cfg, tmp_path) -> str:
    import shutil

    storage_path = str(tmp_path / "copy")
    shutil.copytree(cfg.run_dir, os.path.join(storage_path, cfg.job, cfg.run_name))
    return storage_path


def test_a_damaged_checkpoint_is_refused_and_the_default_falls_back(ddp_run, tmp_path, capsys):
    from shared.export.__main__ import main as export_main

    cfg, _, _ = ddp_run
    storage_path = copy_run(cfg, tmp_path)
    model_pt = os.path.join(storage_path, "ddp", "r", "step_000002", "model.pt")
    with open(model_pt, "r+b") as f:  # half-written: the manifest's size no longer matches
        f.truncate(100)
    args = ["--job", "ddp", "--run", "r", "--storage-path", storage_path]
    assert export_main([*args, "--step", "2", "--dest", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: checkpoint step_000002 is incomplete or damaged")
    assert "model.pt has 100 bytes" in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "bad")
    # No step given: the newest checkpoint that verifies (step 1), as a resume would pick.
    assert export_main([*args, "--dest", str(tmp_path / "ok")]) == 0
    assert json.loads((tmp_path / "ok" / "export_info.json").read_text())["step"] == 1


def test_nothing_to_export_or_another_model_is_one_sentence(ddp_run, tmp_path, capsys):
    from shared.export.__main__ import main as export_main

    cfg, _, _ = ddp_run
    assert export_main(["--job", "ddp", "--run", "nope", "--storage-path", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    storage_path = copy_run(cfg, tmp_path)
    settings_path = os.path.join(storage_path, "ddp", "r", SETTINGS_FILE)
    record = json.loads(Path(settings_path).read_text())
    record["settings"]["model"] = "llama-tiny"
    Path(settings_path).write_text(json.dumps(record))
    dest = tmp_path / "hf"
    argv = ["--job", "ddp", "--run", "r", "--storage-path", storage_path, "--dest", str(dest)]
    assert export_main(argv) == 2
    assert "holds no Llama weights but the run's model is llama-tiny" in capsys.readouterr().err
    assert not dest.exists()


def test_export_to_object_storage_writes_config_last_and_loads(ddp_run, s3_prefix, tmp_path):
    from transformers import AutoModelForCausalLM

    from shared import storage
    from shared.export import export_run

    cfg, batch, expected = ddp_run
    dest = export_run(cfg.run_dir, dest=f"{s3_prefix}/hf")
    assert {"config.json", "model.safetensors", "export_info.json"} <= set(storage.listdir(dest))
    local = str(tmp_path / "down")
    storage.download_dir(dest, local)
    model = AutoModelForCausalLM.from_pretrained(local, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (model(input_ids=batch).logits - expected).abs().max().item() <= ATOL


@pytest.mark.parametrize("case", ["fsdp", "zero3", "tp2d"])
def test_evaluation_leaves_every_sharded_strategys_training_bitwise_unchanged(
    case, tmp_path, corpus, trained
):
    """Held-out evaluation every step (collective forwards through FSDP2's all-gathers,
    ZeRO-3's partitioned parameters, TP's sharded logits) consumes no training RNG or data:
    the trained model's logits equal a run without evaluation, bit for bit."""
    _, _, plain = trained(case)
    cfg, _, evaluated = train_case(case, tmp_path / "eval", corpus, eval_every=1, eval_batches=2)
    rows = [
        json.loads(line) for line in Path(cfg.run_dir, "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows if r.get("eval_loss") is not None] == list(range(1, STEPS + 1))
    assert torch.equal(evaluated, plain)
