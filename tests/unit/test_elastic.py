"""Elastic batch sizes: every world size in [min_workers, num_workers]
keeps the global batch, or the config is refused before any cluster starts."""

from __future__ import annotations

import pytest
from conftest import run_job

from jobs.fault_tolerance.main import PROFILES, for_this_world
from shared.config import ConfigError, FaultToleranceConfig, build_config
from shared.runtime.elastic import BatchShape, batch_table, refusal


@pytest.mark.parametrize(
    ("global_batch", "max_micro", "expected"),
    [
        # 96 = 8 x 3 x 4: the configured micro-batch fits every size, grad_accum absorbs it.
        (96, 8, {1: (8, 12), 2: (8, 6), 3: (8, 4), 4: (8, 3)}),
        # 48 = 6 x 2 x 4: at 3 workers 16 per rank, so the micro-batch drops to 4 (x 4).
        (48, 6, {1: (6, 8), 2: (6, 4), 3: (4, 4), 4: (6, 2)}),
        # 64 = 8 x 2 x 4 cannot be split over 3 workers.
        (64, 8, {1: (8, 8), 2: (8, 4), 3: None, 4: (8, 2)}),
    ],
)
def test_batch_table_keeps_the_global_batch_at_every_world_size(global_batch, max_micro, expected):
    table = batch_table(global_batch, 1, 4, max_micro)
    assert table == {w: BatchShape(*s) if s else None for w, s in expected.items()}
    for world, shape in table.items():
        if shape is not None:
            assert shape.micro_batch_size * shape.grad_accum * world == global_batch
            assert shape.micro_batch_size <= max_micro


def test_the_readme_elastic_example_is_refused_naming_the_size_that_cannot():
    assert refusal(96, 1, 4, 8) is None
    message = refusal(64, 1, 4, 8)
    assert message.startswith("elastic world size 3 (min_workers=1..num_workers=4) cannot keep "
                              "the global batch of 64 sequences")  # fmt: skip
    assert "for example 72 = micro_batch_size=6 x grad_accum=3 x num_workers=4" in message
    assert message.count(". ") == 0 and message.endswith(".")  # one sentence
    with pytest.raises(ConfigError, match="^elastic world size 3 "):
        build_config(FaultToleranceConfig, PROFILES, "smoke",
                     {"min_workers": "1", "num_workers": "4"})  # fmt: skip
    # The suggested batch is accepted; so is the same range without keeping the batch.
    build_config(FaultToleranceConfig, PROFILES, "smoke", {"min_workers": "1", "num_workers": "4",
                 "micro_batch_size": "6", "grad_accum": "3"})  # fmt: skip
    build_config(FaultToleranceConfig, PROFILES, "smoke", {"min_workers": "1", "num_workers": "4",
                 "keep_global_batch": "false"})  # fmt: skip


def test_each_world_size_gets_its_own_micro_batch_and_accumulation():
    cfg = build_config(FaultToleranceConfig, PROFILES, "smoke",
                       {"min_workers": "1", "num_workers": "4", "micro_batch_size": "6",
                        "grad_accum": "2"})  # fmt: skip
    for world in range(1, 5):
        sized = for_this_world(cfg, world, cfg.global_batch_size)
        assert sized.num_workers == world
        assert sized.global_batch_size == cfg.global_batch_size == 48
    three = for_this_world(cfg, 3, 48)
    assert (three.micro_batch_size, three.grad_accum) == (4, 4)


def test_a_resume_on_fewer_workers_says_how_it_keeps_the_global_batch(capsys):
    """fault_tolerance resumed on 1 of its 2 workers (e2e: the elastic lose/regain test):
    the batch of 32 is kept by accumulating 4 micro-batches of 8, and the log says so."""
    cfg = build_config(FaultToleranceConfig, PROFILES, "smoke", {})
    assert (cfg.num_workers, cfg.micro_batch_size, cfg.grad_accum) == (2, 8, 2)
    one = for_this_world(cfg, 1, cfg.global_batch_size)
    assert (one.num_workers, one.micro_batch_size, one.grad_accum) == (1, 8, 4)
    assert capsys.readouterr().out == (
        "world size 1 (configured 2): keeping the global batch at 32 sequences with grad_accum=4\n"
    )
    assert for_this_world(cfg, 2, 32) == cfg  # as configured: nothing to say
    assert capsys.readouterr().out == ""


def test_refused_before_any_cluster_starts(tmp_path):
    result = run_job("fault_tolerance", "min_workers=1", "num_workers=4", "run_name=refused",
                     storage=tmp_path, timeout=120)  # fmt: skip
    assert result.returncode == 2 and result.summary is None
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: elastic world size 3 ")
    assert not (tmp_path / "fault_tolerance" / "refused" / "ray-auth-token").exists()
