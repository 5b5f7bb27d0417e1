"""``init_from`` bad input, checked by the driver before any cluster starts (exit 2, one
sentence), and how a path resolves. The switch itself (losses across strategies) is tested
end to end in tests/dist/test_strategies.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import run_job

from shared import checkpoint
from shared.checkpoint import TrainState, init_from
from shared.config import ConfigError, TrainConfig
from shared.models.gpt2 import build_gpt2
from shared.optim import build_adamw, warmup_cosine

SMOKE_VOCAB = 512  # the generated corpus' tokenizer (shared.data.generate_news_corpus)
EOS = 0


def write_ddp_checkpoint(directory: Path, model: torch.nn.Module, step: int) -> Path:
    """A checkpoint exactly as the ddp job writes it (one rank): model.pt, train state,
    RNG, manifest last."""
    directory.mkdir(parents=True)
    cfg = TrainConfig(max_steps=30)
    optimizer = build_adamw(model, cfg.lr, cfg.weight_decay)
    checkpoint.save_model_optimizer(str(directory), model, optimizer, warmup_cosine(optimizer, cfg))
    checkpoint.save_train_state(str(directory), TrainState(step=step, world_size=1), rank=0)
    checkpoint.write_manifest(str(directory), rank=0, world_size=1, step=step)
    return directory


def write_llama_dcp_checkpoint(directory: Path, step: int) -> Path:
    """tp2d's format: DCP shards of our Llama under dcp/ (written without a process group,
    which DCP reads the same way)."""
    import torch.distributed.checkpoint as dcp

    from shared.models.llama import build_llama

    directory.mkdir(parents=True)
    state = {"model": build_llama("llama-tiny", SMOKE_VOCAB).state_dict()}
    dcp.save(state, checkpoint_id=str(directory / "dcp"), no_dist=True)
    checkpoint.save_train_state(str(directory), TrainState(step=step, world_size=1), rank=0)
    checkpoint.write_manifest(str(directory), rank=0, world_size=1, step=step)
    return directory


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    good = build_gpt2("gpt2-tiny", SMOKE_VOCAB, 64, eos_token_id=EOS)
    run = root / "ddp" / "src"
    write_ddp_checkpoint(run / "step_000004", good, 4)
    write_ddp_checkpoint(run / "step_000008", good, 8)
    no_manifest = root / "half" / "step_000008"
    shutil.copytree(run / "step_000008", no_manifest)
    shutil.rmtree(no_manifest / "manifest")
    truncated = root / "truncated" / "step_000008"
    shutil.copytree(run / "step_000008", truncated)
    data = (truncated / "model.pt").read_bytes()
    (truncated / "model.pt").write_bytes(data[: len(data) // 2])
    unfinished_export = root / "export" / "step_000008"
    unfinished_export.mkdir(parents=True)
    (unfinished_export / "model.safetensors").write_bytes(b"")  # config.json comes last
    return {
        "run": run,
        "other_vocab": write_ddp_checkpoint(
            root / "vocab" / "step_000004", build_gpt2("gpt2-tiny", 600, 64), 4
        ),
        "llama": write_llama_dcp_checkpoint(root / "tp2d" / "step_000006", 6),
        "no_manifest": no_manifest,
        "truncated": truncated,
        "unfinished_export": unfinished_export,
        "nothing": root / "does-not-exist",
        "not_a_checkpoint": root,
    }


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")  # one generated smoke corpus for every run


# (source, job, the sentence's distinctive part)
BAD = [
    ("nothing", "ddp", "does not exist."),
    ("not_a_checkpoint", "fsdp",
     "is neither a checkpoint, a run directory nor an exported model directory."),
    ("llama", "zero", "holds another model's weights (tok_embeddings.weight"),
    ("other_vocab", "fsdp", "has transformer.wte.weight of shape [600, 64] where this run's "
     "gpt2-tiny has [512, 64]"),
    ("no_manifest", "ddp", "is an incomplete or damaged checkpoint (manifest/rank0.json is "
     "missing"),
    ("truncated", "zero", "is an incomplete or damaged checkpoint (model.pt has"),
    ("unfinished_export", "ddp", "is an unfinished export (no config.json)"),
    ("run", "tp2d", "init_from is supported by the GPT-2 jobs ddp, fsdp, zero, not by tp2d."),
]  # fmt: skip


@pytest.mark.parametrize("source,job,sentence", BAD, ids=[f"{s}-{j}" for s, j, _ in BAD])
def test_bad_init_from_is_refused_in_one_sentence(source, job, sentence, sources, tmp_path):
    """The check the driver runs before any cluster (shared/runtime/driver.py preflight)."""
    with pytest.raises(ConfigError) as refused:
        init_from.check(_cfg(tmp_path, sources[source], job), SMOKE_VOCAB, EOS)
    assert sentence in str(refused.value) and "\n" not in str(refused.value)


def test_a_bad_init_from_exits_2_with_that_sentence_before_ray_starts(sources, storage):
    """What the driver makes of the refusal: one error line, exit 2, no cluster, no SUMMARY."""
    source, job, sentence = BAD[3]  # other_vocab, fsdp: needs the run's own tokenizer
    result = run_job(job, f"run_name=bad-{source}", f"init_from={sources[source]}",
                     storage=storage, timeout=300)  # fmt: skip
    assert result.returncode == 2, result.output[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and sentence in errors[0], result.stderr[-2000:]
    assert "Ray dashboard" not in result.output and "SUMMARY" not in result.stdout


def _cfg(tmp_path: Path, path: Path | str, job: str = "ddp") -> TrainConfig:
    cfg = TrainConfig(storage_path=str(tmp_path), run_name="new", init_from=str(path))
    cfg.job = job
    return cfg


def test_a_run_directory_resolves_to_its_newest_verified_checkpoint(sources, tmp_path):
    cfg = _cfg(tmp_path, sources["run"])
    init_from.check(cfg, vocab_size=SMOKE_VOCAB, eos_token_id=EOS)
    assert cfg.init_checkpoint == str(sources["run"] / "step_000008")
    source = init_from.describe(cfg.init_checkpoint)
    assert (source.kind, source.job, source.step, source.world_size) == (
        "checkpoint", "ddp", 8, 1)  # fmt: skip
    # ddp reads its own format back (optimizer too); fsdp and zero start a fresh optimizer.
    assert init_from.carries_optimizer(cfg, source)
    assert not init_from.carries_optimizer(_cfg(tmp_path, sources["run"], "fsdp"), source)


def test_a_run_with_checkpoints_of_its_own_resumes_and_ignores_init_from(sources, tmp_path,
                                                                        capsys):  # fmt: skip
    cfg = _cfg(tmp_path, sources["nothing"])
    write_ddp_checkpoint(Path(cfg.run_dir) / "step_000002", build_gpt2("gpt2-tiny", 512, 64), 2)
    init_from.check(cfg, vocab_size=SMOKE_VOCAB, eos_token_id=EOS)  # no error: not used
    assert cfg.init_checkpoint == ""
    assert "init_from ignored" in capsys.readouterr().out


def test_the_fresh_schedule_is_moved_to_the_source_step():
    cfg = TrainConfig(max_steps=30, warmup_steps=3, lr=3e-3)
    model = build_gpt2("gpt2-tiny", SMOKE_VOCAB, 64)
    reference = warmup_cosine(build_adamw(model, cfg.lr, cfg.weight_decay), cfg)
    for _ in range(12):
        reference.optimizer.step()
        reference.step()
    fresh = warmup_cosine(build_adamw(model, cfg.lr, cfg.weight_decay), cfg)
    init_from.set_schedule_step(fresh, 12)
    assert fresh.get_last_lr() == reference.get_last_lr()
    fresh.optimizer.step()
    fresh.step()
    reference.optimizer.step()
    reference.step()
    assert fresh.get_last_lr() == reference.get_last_lr()


def test_check_refuses_a_job_without_init_from_support(sources, tmp_path):
    with pytest.raises(ConfigError, match="not by fault_tolerance"):
        init_from.check(_cfg(tmp_path, sources["run"], "fault_tolerance"), SMOKE_VOCAB, EOS)


def test_an_exported_hf_directory_gives_its_weights_and_starts_at_step_0(sources, tmp_path):
    """``make export`` output: config.json + model.safetensors (tied LM head left out)."""
    from shared.export.hf import gpt2_hf_model
    from shared.export.sources import full_state_dict

    trained = full_state_dict(str(sources["run"] / "step_000008"))
    export_dir = tmp_path / "export" / "step_000008"
    gpt2_hf_model(trained, n_head=4, eos_token_id=EOS).save_pretrained(export_dir)
    cfg = _cfg(tmp_path, export_dir)
    init_from.check(cfg, vocab_size=SMOKE_VOCAB, eos_token_id=EOS)
    source = init_from.describe(cfg.init_checkpoint)
    assert (source.kind, source.step) == ("export", 0)
    assert not init_from.carries_optimizer(cfg, source)
    with init_from.open_source(source) as local:
        weights = init_from.source_state_dict(source, local)
    model = build_gpt2("gpt2-tiny", SMOKE_VOCAB, 64, eos_token_id=EOS)
    for name, _ in model.named_parameters():
        if name in weights:
            assert torch.equal(weights[name], trained[name]), name
    assert {n for n, _ in model.named_parameters()} - set(weights) <= {"lm_head.weight"}
