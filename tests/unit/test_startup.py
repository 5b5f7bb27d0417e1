"""SUMMARY's startup_s (shared/observability/startup.py): phases between marks, named after
the mark that ends them, adding up to the time to the first step."""

from __future__ import annotations

import pytest

from shared.config import TrainConfig
from shared.observability import startup


def test_a_ray_run_is_broken_down_into_every_phase_in_order():
    marks = {"launch": 100.0, "cluster_ready": 104.0, "data_ready": 104.5, "fit_start": 104.6,
             "worker_start": 109.0, "model_ready": 110.0, "first_batch": 111.0,
             "first_step": 111.25}  # fmt: skip
    phases = startup.breakdown(marks)
    assert phases == {"cluster_start": 4.0, "data_preparation": 0.5, "driver_setup": 0.1,
                      "worker_group_start": 4.4, "model_build": 1.0, "first_batch": 1.0,
                      "first_step": 0.25, "total": 11.25}  # fmt: skip
    assert sum(v for k, v in phases.items() if k != "total") == pytest.approx(phases["total"])


def test_missing_marks_fold_into_the_next_phase_and_order_follows_time():
    """torchrun: no cluster; its processes start before the data is prepared."""
    marks = {"launch": 0.0, "worker_start": 2.0, "data_ready": 3.0, "model_ready": 3.5,
             "first_batch": None, "first_step": 4.0}  # fmt: skip
    expected = {"worker_group_start": 2.0, "data_preparation": 1.0, "model_build": 0.5,
                "first_step": 0.5, "total": 4.0}  # fmt: skip
    assert startup.breakdown(marks) == expected
    assert startup.breakdown({"launch": 1.0}) == {}


def test_driver_marks_travel_in_the_config():
    cfg = TrainConfig()
    startup.mark(cfg, "cluster_ready")
    assert set(cfg.startup_marks) == {"cluster_ready"}
    assert TrainConfig().startup_marks == {}  # not shared between configs
    with pytest.raises(AssertionError):
        startup.mark(cfg, "cluster_up")  # a typo is caught, not reported as a phase
