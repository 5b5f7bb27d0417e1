"""The resume contract: a run directory remembers the settings it was trained with.

The first start writes every resolved setting to ``<run_dir>/settings.json``. A later start
with the same run name resumes from its checkpoints, so before any cluster starts the driver
compares: a change that would make the checkpoint or its data position mean something else
is refused with one sentence naming the setting and both values; any other change is applied
and listed in one line. Works for local and ``s3://`` run directories (shared/storage.py).
"""

from __future__ import annotations

import json
from typing import Any

from shared import storage
from shared.config import ConfigError, resolved_settings

SETTINGS_FILE = "settings.json"

# Settings a checkpoint (weights, optimizer, scheduler) or its data position depends on,
# with the reason a change is refused.
INVALIDATING = {
    "model": "the checkpoint holds that model's weights",
    "pretrained": "the checkpoint's weights started from it",
    "tokenizer": "the weights and the data position are in its token ids",
    "dataset": "the data position counts samples of that dataset",
    "text_column": "the data position counts samples of that column",
    "max_samples": "the data position counts samples of that subset",
    "seq_len": "the data position counts sequences of that length",
    "pack_chunk_rows": "the epoch's sample order (the data position) depends on it",
    "dtype": "the checkpoint's weights and optimizer state were trained in it",
    "zero_stage": "DeepSpeed's checkpoint layout depends on it",
    "lr": "the checkpoint's scheduler keeps the old peak learning rate, so it would not apply",
    "weight_decay": "the checkpoint's optimizer keeps the old value, so it would not apply",
    "warmup_steps": "the learning-rate schedule would jump",
    "min_lr_ratio": "the learning-rate schedule would jump",
}
# With no dataset given the corpus is generated from these: another value is other data.
GENERATED_DATA = {
    "seed": "the generated dataset (dataset is empty) depends on it",
    "smoke_rows": "the generated dataset (dataset is empty) depends on it",
}
# A different world size is fine as long as the global batch stays (grad_accum adapts).
BATCH = {"global_batch_size": "a step and the data position mean that many sequences"}
# Who a run is, not how it trains: never compared.
IDENTITY = ("run_name", "storage_path")


def contract(cfg) -> dict[str, tuple[Any, str]]:
    """{setting: (value, why a change is refused)} for this config."""
    terms = {name: (getattr(cfg, name), why) for name, why in INVALIDATING.items()
             if hasattr(cfg, name)}  # fmt: skip
    if not getattr(cfg, "dataset", "x"):
        terms |= {name: (getattr(cfg, name), why) for name, why in GENERATED_DATA.items()}
    # An elastic job that keeps the checkpoint's global batch (jobs/fault_tolerance) adapts
    # grad_accum to any world size by itself.
    if hasattr(cfg, "global_batch_size") and not getattr(cfg, "keep_global_batch", False):
        terms |= {name: (getattr(cfg, name), why) for name, why in BATCH.items()}
    return terms


def settings_record(cfg) -> dict:
    return {
        "job": cfg.job,
        "profile": cfg.profile,
        "settings": resolved_settings(cfg),
        "global_batch_size": getattr(cfg, "global_batch_size", None),
    }


def _shown(value: Any) -> str:
    """Strings quoted, so that an emptied setting reads ``profile_steps '3-5' -> ''``."""
    return repr(value) if isinstance(value, str) else str(value)


def has_checkpoints(run_dir: str) -> bool:
    """Ray Train names checkpoint folders after ``checkpoint_dir_name`` (``step_NNNNNN``)."""
    return any(n.startswith(("step_", "checkpoint_")) for n in storage.listdir(run_dir))


def check_resume(cfg) -> list[str]:
    """Refuse (ConfigError) a resume that changes an invalidating setting; record this
    start's settings; return the harmless changes as ``name old -> new`` strings."""
    path = storage.join(cfg.run_dir, SETTINGS_FILE)
    changes: list[str] = []
    if has_checkpoints(cfg.run_dir) and storage.exists(path):
        saved = json.loads(storage.read_text(path))
        old_settings = {**saved["settings"], "global_batch_size": saved.get("global_batch_size")}
        terms = contract(cfg)
        for name, (new, why) in terms.items():
            if name in old_settings and old_settings[name] != new:
                old = old_settings[name]
                raise ConfigError(
                    f"run {cfg.job}/{cfg.run_name} was trained with {name}={old} and this start "
                    f"has {name}={new}, but {why}: keep {name}={old} to resume it, or start a "
                    "new run with another run_name."
                )
        for name, new in resolved_settings(cfg).items():
            if name in IDENTITY or name in terms or name not in old_settings:
                continue
            if old_settings[name] != new:
                changes.append(f"{name} {_shown(old_settings[name])} -> {_shown(new)}")
    storage.write_text(path, json.dumps(settings_record(cfg), indent=2, default=str))
    return changes
