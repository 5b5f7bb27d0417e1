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
# dtype=auto picks the dtype on the worker: fp32 on CPUs, bf16 on GPUs that have it.
AUTO_DTYPE = {"use_gpu": "dtype=auto would train in another dtype than the checkpoint's"}
# The global batch is micro_batch_size x grad_accum x num_workers (x dp for tp2d): any of them
# may change as long as the product stays (checked in check_global_batch).
PER_WORKER_BATCH = ("micro_batch_size", "grad_accum")
# Who a run is, not how it trains: never compared.
IDENTITY = ("run_name", "storage_path")


def contract(cfg) -> dict[str, tuple[Any, str]]:
    """{setting: (value, why a change is refused)} for this config."""
    terms = {name: (getattr(cfg, name), why) for name, why in INVALIDATING.items()
             if hasattr(cfg, name)}  # fmt: skip
    if not getattr(cfg, "dataset", "x"):
        terms |= {name: (getattr(cfg, name), why) for name, why in GENERATED_DATA.items()}
    if getattr(cfg, "dtype", None) == "auto":
        terms |= {name: (getattr(cfg, name), why) for name, why in AUTO_DTYPE.items()}
    return terms


def _batch(settings: dict, size: int) -> str:
    """'16 sequences (micro_batch_size=8 x grad_accum=1 x num_workers=2)'; tp2d's data-parallel
    degree is dp (a TP group shares its micro-batch)."""
    names = [*PER_WORKER_BATCH, "dp" if "dp" in settings else "num_workers"]
    terms = " x ".join(f"{name}={settings.get(name)}" for name in names)
    return f"{size} sequences ({terms})"


def check_global_batch(cfg, old_settings: dict, old_batch: int | None) -> str | None:
    """Refuse a resume with another global batch: a step and the data position count that
    many sequences. An elastic job that keeps the checkpoint's batch (keep_global_batch,
    jobs/fault_tolerance) trains with it at any num_workers (grad_accum adapts), which the
    returned note says; a change to micro_batch_size or grad_accum that asks for another
    batch is refused there too, since the checkpoint's batch would silently win over it."""
    new_batch = getattr(cfg, "global_batch_size", None)
    if old_batch is None or new_batch is None or new_batch == old_batch:
        return None
    new_settings = resolved_settings(cfg)
    per_worker_kept = all(old_settings.get(n) == new_settings.get(n) for n in PER_WORKER_BATCH)
    if getattr(cfg, "keep_global_batch", False) and per_worker_kept:
        return f"global batch kept at {old_batch} sequences (keep_global_batch; grad_accum adapts)"
    raise ConfigError(
        f"run {cfg.job}/{cfg.run_name} was trained with a global batch of "
        f"{_batch(old_settings, old_batch)} and this start has {_batch(new_settings, new_batch)}, "
        f"but a step and the data position count that many sequences: keep the product at "
        f"{old_batch} to resume it, or start a new run with another run_name."
    )


def settings_record(cfg, global_batch: int | None) -> dict:
    """This start's settings and the global batch it trains with (for keep_global_batch
    resumes the checkpoint's, not micro_batch_size x grad_accum x num_workers)."""
    return {
        "job": cfg.job,
        "profile": cfg.profile,
        "settings": resolved_settings(cfg),
        "global_batch_size": global_batch,
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
    global_batch = getattr(cfg, "global_batch_size", None)
    if has_checkpoints(cfg.run_dir) and storage.exists(path):
        saved = json.loads(storage.read_text(path))
        old_settings = saved["settings"]
        terms = contract(cfg)
        for name, (new, why) in terms.items():
            if name in old_settings and old_settings[name] != new:
                old = old_settings[name]
                raise ConfigError(
                    f"run {cfg.job}/{cfg.run_name} was trained with {name}={old} and this start "
                    f"has {name}={new}, but {why}: keep {name}={old} to resume it, or start a "
                    "new run with another run_name."
                )
        batch_note = check_global_batch(cfg, old_settings, saved.get("global_batch_size"))
        for name, new in resolved_settings(cfg).items():
            if name in IDENTITY or name in terms or name not in old_settings:
                continue
            if old_settings[name] != new:
                changes.append(f"{name} {_shown(old_settings[name])} -> {_shown(new)}")
        if batch_note:
            changes.append(batch_note)
            global_batch = saved["global_batch_size"]
    record = settings_record(cfg, global_batch)
    storage.write_text(path, json.dumps(record, indent=2, default=str))
    return changes
