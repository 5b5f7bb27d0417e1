"""Checkpoints: what one holds and how it is verified (format), which one a run resumes from
(resume), and where a new run's weights may start from (init_from).

``from shared import checkpoint`` gives the format's API directly (``checkpoint.save_train_state``).
"""

from shared.checkpoint.format import (
    MANIFEST_DIR,
    MODEL_FILE,
    TRAIN_STATE_FILE,
    CheckpointInvalid,
    TrainState,
    file_sha256,
    load_model_optimizer,
    load_train_state,
    manifest_name,
    rng_state,
    run_key,
    save_model_optimizer,
    save_train_state,
    set_rng_state,
    staged_checkpoint,
    staging_root,
    verify_checkpoint,
    write_manifest,
)

__all__ = [
    "MANIFEST_DIR", "MODEL_FILE", "TRAIN_STATE_FILE", "CheckpointInvalid", "TrainState",
    "file_sha256", "load_model_optimizer", "load_train_state", "manifest_name", "rng_state",
    "run_key", "save_model_optimizer", "save_train_state", "set_rng_state", "staged_checkpoint",
    "staging_root", "verify_checkpoint", "write_manifest",
]  # fmt: skip
