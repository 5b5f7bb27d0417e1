"""Compute configs parse with the Anyscale SDK's own model and keep the head free of training."""

import pytest
from anyscale.compute_config.models import ComputeConfig, compute_config_type_from_yaml
from conftest import REPO

CONFIGS = sorted((REPO / "compute_configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_compute_config_is_valid_and_head_runs_no_training(path):
    config = compute_config_type_from_yaml(str(path))
    assert isinstance(config, ComputeConfig)
    assert config.head_node.resources == {"CPU": 0}
    assert config.worker_nodes and all(g.max_nodes >= g.min_nodes >= 0 for g in config.worker_nodes)


def test_there_is_a_cpu_smoke_config():
    assert "cpu-smoke.yaml" in [p.name for p in CONFIGS]
