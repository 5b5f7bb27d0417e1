"""Run configuration: one flat dataclass per job, two profiles, `key=value` overrides.

Every knob a user can type on the command line is a field of a dataclass. A job picks its
dataclass (``TrainConfig`` or a subclass with extra fields), a ``smoke`` and a ``full``
profile (dicts of field values), and calls :func:`parse_args`. Everything is parsed and
validated *before* Ray starts, and every problem is reported as one sentence.

Flat rather than nested on purpose: ``num_workers=4 lr=3e-4`` is what people type, and one
flat namespace makes a clash between two knobs impossible to miss.
"""

from shared.config.base import (
    PROFILES,
    BaseConfig,
    ConfigError,
    TrainConfig,
    first_line,
    setting,
)
from shared.config.cli import (
    apply_overrides,
    build_config,
    default_run_name,
    describe,
    parse_args,
    resolved_settings,
    split_overrides,
    user_fields,
)
from shared.config.jobs import FaultToleranceConfig, FSDPConfig, TP2DConfig, ZeroConfig

__all__ = [
    "PROFILES", "BaseConfig", "ConfigError", "FSDPConfig", "FaultToleranceConfig", "TP2DConfig",
    "TrainConfig", "ZeroConfig", "apply_overrides", "build_config", "default_run_name",
    "describe", "first_line", "parse_args", "resolved_settings", "setting", "split_overrides",
    "user_fields",
]  # fmt: skip
