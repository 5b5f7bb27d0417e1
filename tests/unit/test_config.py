import importlib
import json
import os

import pytest
from conftest import REPO

from shared.config import (
    ConfigError,
    FaultToleranceConfig,
    FSDPConfig,
    TP2DConfig,
    TrainConfig,
    ZeroConfig,
    apply_overrides,
    build_config,
    parse_args,
)
from shared.runtime.cluster import check_local_resources

PROFILES = {"smoke": {}, "full": {"num_workers": 8}}


def build(**overrides):
    return build_config(TrainConfig, PROFILES, "smoke", {k: str(v) for k, v in overrides.items()})


def error_of(**overrides) -> str:
    with pytest.raises(ConfigError) as err:
        build(**overrides)
    return str(err.value)


def test_defaults_are_valid_and_paths_absolute():
    cfg = build()
    assert os.path.isabs(cfg.storage_path)
    assert cfg.run_name.startswith("smoke-")
    assert cfg.run_dir == os.path.join(cfg.storage_path, cfg.job, cfg.run_name)


def test_overrides_are_parsed_to_the_field_types():
    cfg = build(num_workers=4, lr="1e-4", use_gpu="true", model="gpt2")
    assert (cfg.num_workers, cfg.lr, cfg.use_gpu, cfg.model) == (4, 1e-4, True, "gpt2")
    assert cfg.global_batch_size == cfg.micro_batch_size * cfg.grad_accum * 4


def test_profile_then_overrides_precedence():
    cfg = build_config(TrainConfig, PROFILES, "full", {})
    assert cfg.num_workers == 8 and cfg.profile == "full"
    cfg = build_config(TrainConfig, PROFILES, "full", {"num_workers": "3"})
    assert cfg.num_workers == 3


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_workers": -1}, "num_workers must be >= 1 (got -1)."),
        ({"num_workers": "two"}, "num_workers must be an integer (got 'two')."),
        ({"use_gpu": "maybe"}, "use_gpu must be true or false (got 'maybe')."),
        ({"lr": 0}, "lr must be > 0 (got 0.0)."),
        (
            {"warmup_steps": 30, "max_steps": 30},
            "warmup_steps (30) must be smaller than max_steps (30).",
        ),
        ({"dtype": "fp8"}, "dtype must be one of auto, fp32, bf16 (got 'fp8')."),
        ({"dtype": "fp16"}, "dtype must be one of auto, fp32, bf16 (got 'fp16')."),
        ({"model": "gpt5"}, "unknown model 'gpt5'; valid presets: "),
        (
            {"dataset": "/nonexistent/x.parquet"},
            "dataset path '/nonexistent/x.parquet' does not exist.",
        ),
        ({"run_name": "a/b"}, "run_name must be a plain name, not a path (got 'a/b')."),
        ({"cpus_per_worker": 0}, "cpus_per_worker must be > 0 (got 0.0)."),
        (
            {"placement_strategy": "RANDOM"},
            "placement_strategy must be one of PACK, SPREAD, STRICT_PACK, STRICT_SPREAD",
        ),
    ],
)
def test_bad_settings_fail_with_one_sentence(overrides, message):
    text = error_of(**overrides)
    assert text.startswith(message)
    assert "\n" not in text


def test_unknown_setting_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown setting 'nope'; valid settings: .*num_workers"):
        apply_overrides(TrainConfig(), {"nope": "1"})


def test_unknown_profile():
    with pytest.raises(ConfigError, match="unknown profile 'big'; valid profiles: smoke, full"):
        build_config(TrainConfig, PROFILES, "big", {})


def test_parse_args_prints_one_line_and_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args("ddp", TrainConfig, PROFILES, ["num_workers=-1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: num_workers must be >= 1 (got -1).\n"


def test_print_config_shows_the_resolved_settings_and_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args("ddp", TrainConfig, PROFILES, ["--profile", "full", "--print-config", "lr=0.01"])
    assert exit_info.value.code == 0
    settings = json.loads(capsys.readouterr().out)
    assert settings["job"] == "ddp" and settings["profile"] == "full"
    assert settings["num_workers"] == 8 and settings["lr"] == 0.01
    assert "driver_start_time" not in settings  # internal fields are not settings


def test_default_run_name_is_the_anyscale_job_id_so_a_retry_resumes(monkeypatch):
    monkeypatch.setenv("ANYSCALE_PRODJOB_ID", "prodjob_abc123")
    assert build().run_name == "smoke-prodjob_abc123"
    monkeypatch.delenv("ANYSCALE_PRODJOB_ID")
    assert build().run_name.startswith("smoke-2")  # a timestamp: a fresh run each time


def test_a_uri_storage_path_keeps_its_scheme_and_loses_empty_segments():
    # e.g. "$ANYSCALE_ARTIFACT_STORAGE/runs": that URI ends in "/".
    assert build(storage_path="s3://bucket/org/artifact_storage//runs/").storage_path == (
        "s3://bucket/org/artifact_storage/runs"
    )
    assert build(storage_path="file:///mnt//runs/").storage_path == "file:///mnt/runs"


def test_not_key_value(capsys):
    with pytest.raises(SystemExit):
        parse_args("ddp", TrainConfig, PROFILES, ["num_workers"])
    assert "expected key=value, got 'num_workers'" in capsys.readouterr().err


def test_local_cluster_must_leave_a_cpu_for_ray_data(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cpus = os.cpu_count()
    cfg = build(num_workers=cpus, cpus_per_worker=1)
    with pytest.raises(ConfigError, match="leave less than 1 for Ray Data; use cpus_per_worker="):
        check_local_resources(cfg)
    check_local_resources(build(num_workers=1, cpus_per_worker=0.5))


JOB_CONFIGS = {
    "ddp": TrainConfig,
    "env_check": None,  # its own class, in the job
    "fsdp": FSDPConfig,
    "zero": ZeroConfig,
    "tp2d": TP2DConfig,
    "fault_tolerance": FaultToleranceConfig,
}


def test_every_job_is_covered():
    assert sorted(p.parent.name for p in (REPO / "jobs").glob("*/main.py")) == sorted(JOB_CONFIGS)


@pytest.mark.parametrize("job", sorted(JOB_CONFIGS))
@pytest.mark.parametrize("profile", ["smoke", "full"])
def test_every_job_profile_is_valid(job, profile):
    module = importlib.import_module(f"jobs.{job}.main")
    cls = JOB_CONFIGS[job] or module.EnvCheckConfig
    if profile == "full" and job != "env_check":
        # The full profile names a hub dataset; validation must accept URIs without touching them.
        assert module.PROFILES["full"]["dataset"].startswith("hf://")
    cfg = build_config(cls, module.PROFILES, profile, {})
    assert cfg.num_workers >= 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"zero_stage": 4}, "zero_stage must be 0, 1, 2 or 3 (got 4)."),
        (
            {"zero_stage": 2, "offload_params": "true"},
            "offload_params needs zero_stage=3 (got zero_stage=2).",
        ),
        (
            {"zero_stage": 0, "offload_optimizer": "true"},
            "offload_optimizer needs zero_stage 1, 2 or 3 (got 0).",
        ),
        (
            {"stop_at_step": 30, "max_steps": 30},
            "stop_at_step (30) must be smaller than max_steps (30)",
        ),
    ],
)
def test_zero_settings(overrides, message):
    with pytest.raises(ConfigError) as err:
        build_config(ZeroConfig, PROFILES, "smoke", {k: str(v) for k, v in overrides.items()})
    assert str(err.value).startswith(message)


def test_fsdp_settings():
    with pytest.raises(ConfigError, match=r"reduce_dtype must be fp32 or bf16 \(got 'fp16'\)."):
        build_config(FSDPConfig, PROFILES, "smoke", {"reduce_dtype": "fp16"})
    with pytest.raises(ConfigError, match=r"blocks_per_group must be >= 1 \(got 0\)."):
        build_config(FSDPConfig, PROFILES, "smoke", {"blocks_per_group": "0"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_workers": 3}, "num_workers (3) must equal dp x tp = 2 x 2 = 4."),
        (
            {"tp": 3, "dp": 1, "num_workers": 3},
            "tp (3) must divide the attention heads of llama-tiny (4).",
        ),
        (
            {"tp": 4, "dp": 1, "num_workers": 4},
            "tp (4) must divide the KV heads of llama-tiny (2).",
        ),
        ({"micro_batch_size": 3}, "tp (2) must divide micro_batch_size (3)"),
        ({"seq_len": 63}, "tp (2) must divide seq_len (63)"),
        (
            {"model": "gpt2"},
            "unknown model 'gpt2'; valid presets: llama-500m, llama-7b, llama-tiny.",
        ),
    ],
)
def test_tp2d_mesh_validation(overrides, message):
    import jobs.tp2d.main as tp2d

    with pytest.raises(ConfigError) as err:
        build_config(TP2DConfig, tp2d.PROFILES, "smoke", {k: str(v) for k, v in overrides.items()})
    assert str(err.value).startswith(message)


def test_fp16_falls_back_to_fp32_where_unsupported(capsys):
    import torch

    from shared.precision import resolve_dtype

    assert resolve_dtype("fp16", torch.device("cpu")) == torch.float32
    assert "dtype=fp16 is not supported on cpu; training in fp32 instead" in capsys.readouterr().out
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"fail_mode": "segfault"}, "fail_mode must be exit, sigkill or raise (got 'segfault')."),
        ({"fail_rank": 2}, "fail_rank (2) must be below num_workers (2)."),
        ({"fail_at_step": 31}, "fail_at_step (31) is after max_steps (30)."),
        (
            {"fail_during_checkpoint": "true", "fail_at_step": 13},
            "fail_during_checkpoint needs fail_at_step (13) to be a checkpoint step",
        ),
        ({"min_workers": 3}, "min_workers (3) must not exceed num_workers (2)."),
    ],
)
def test_fault_tolerance_settings(overrides, message):
    import jobs.fault_tolerance.main as ft

    with pytest.raises(ConfigError) as err:
        build_config(
            FaultToleranceConfig, ft.PROFILES, "smoke", {k: str(v) for k, v in overrides.items()}
        )
    assert str(err.value).startswith(message)


def test_min_workers_makes_the_scaling_config_elastic():
    from shared.runtime.driver import scaling_config

    elastic = build_config(FaultToleranceConfig, PROFILES, "smoke", {"min_workers": "1"})
    assert scaling_config(elastic).num_workers == (1, 2)
    assert scaling_config(elastic).elasticity_enabled
    assert scaling_config(build(num_workers=2)).num_workers == 2
