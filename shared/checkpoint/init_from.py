"""``init_from=<path>``: start a new GPT-2 run (ddp, fsdp, zero) from another run's weights,
to switch strategy mid-training (train with fsdp, continue with zero stage 2).

``<path>`` (local or ``s3://``) is one of
  * a checkpoint directory ``<run_dir>/step_<N>`` of any GPT-2 job: ``model.pt`` (ddp),
    DCP shards (fsdp), DeepSpeed engine files (zero 0-3); its manifests must verify;
  * a run directory: its newest checkpoint that verifies (the one a rerun would resume from);
  * an exported Hugging Face directory (``make export``): ``config.json`` + safetensors.

What carries over:
  * weights, always: read unsharded in one process (shared/export/sources.py, the export's
    readers) and loaded into the plain model before the strategy wraps (and shards) it;
  * optimizer and LR-scheduler state only when the target reads the source's format itself:
    ddp -> ddp (``model.pt``), fsdp -> fsdp (DCP reshards to any world size), zero -> zero
    with the same ``zero_stage`` (another world size through DeepSpeed's universal format,
    shared/parallel/zero.py). Every other pair,
    and an export, starts a fresh AdamW (its moments rebuild within a few steps);
  * step counter, data position and RNG from a checkpoint's train state
    (:func:`source_train_state`); the LR schedule continues at that step. An export has no
    train state: the run starts at step 0, like ``pretrained=``.

``init_from`` applies to a fresh run only: a run directory with checkpoints of its own
resumes from those and ignores it. Bad input (nothing there, another model, a half-written
checkpoint or export) is one sentence and exit 2 on the driver, before any worker starts: the
driver verifies the manifests and reads the weights once to compare names and shapes with
this run's model (built on the meta device), so a GPT-2 124M source costs it ~0.5 GB briefly.

Why a module of its own and not part of shared/export: export writes Hugging Face
directories; this is the training start (driver preflight in shared/runtime/driver.py, weights in
``start_gpt2_worker``, counters in ``shared.loop.restore``). It reuses export's readers.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from shared import checkpoint, optim, storage
from shared.checkpoint import CheckpointInvalid, TrainState, resume
from shared.config import ConfigError

JOBS = ("ddp", "fsdp", "zero")
# checkpoint format (shared/export/sources.py) -> the GPT-2 job that writes it
FORMAT_JOB = {"ddp": "ddp", "dcp": "fsdp", "deepspeed": "zero"}
HF_CONFIG = "config.json"
SETTINGS_FILE = "settings.json"  # shared/config/run_settings.py, in the source's run directory


@dataclass
class Source:
    """What ``init_from`` resolved to; computed the same way on the driver and the workers."""

    path: str  # a verified checkpoint directory, or an export directory
    kind: str  # "checkpoint" or "export"
    job: str  # the job that wrote it (checkpoints: the run's settings, else from the format)
    step: int  # 0 for an export
    settings: dict  # the source run's settings ({} when unknown)
    world_size: int = 0  # ranks that wrote the checkpoint

    def label(self) -> str:
        return f"{self.job} step {self.step}" if self.kind == "checkpoint" else "HF export"


# ------------------------------------------------------------------------------------------
# resolving and checking (driver)


def _is_export(path: str) -> bool:
    return any(storage.exists(storage.join(path, n)) for n in
               (HF_CONFIG, "model.safetensors", "model.safetensors.index.json"))  # fmt: skip


def _looks_like_checkpoint(path: str) -> bool:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return bool(resume.CHECKPOINT_DIR.match(name)) or any(
        storage.exists(storage.join(path, n))
        for n in (checkpoint.TRAIN_STATE_FILE, checkpoint.MODEL_FILE, "dcp", "engine")
    )


def resolve(path: str) -> Source:
    """The checkpoint or export ``path`` names; ConfigError (one sentence) if none."""
    if not storage.exists(path):
        raise ConfigError(f"init_from {path} does not exist.")
    if _is_export(path):
        if not storage.exists(storage.join(path, HF_CONFIG)):
            raise ConfigError(f"init_from {path} is an unfinished export (no {HF_CONFIG}); "
                              "export again with make export.")  # fmt: skip
        return Source(path, "export", "export", 0, {})
    if _looks_like_checkpoint(path):
        checkpoint_dir = path
    elif resume.checkpoint_dirs(path):
        checkpoint_dir = resume.last_good_checkpoint(path)
        if checkpoint_dir is None:
            raise ConfigError(f"init_from {path} is a run directory without a complete "
                              "checkpoint (none passes manifest verification).")  # fmt: skip
    else:
        raise ConfigError(f"init_from {path} is neither a checkpoint, a run directory nor an "
                          "exported model directory.")  # fmt: skip
    try:
        checkpoint.verify_checkpoint(checkpoint_dir)
    except CheckpointInvalid as err:
        raise ConfigError(f"init_from {checkpoint_dir} is an incomplete or damaged checkpoint "
                          f"({err}).") from None  # fmt: skip
    return describe(checkpoint_dir)


def describe(path: str) -> Source:
    """The Source for a path :func:`resolve` already verified (workers: no re-hashing)."""
    if _is_export(path):
        return Source(path, "export", "export", 0, {})
    rank0 = json.loads(storage.read_text(storage.join(path, checkpoint.manifest_name(0))))
    settings = _run_settings(path)
    job = settings.get("_job") or FORMAT_JOB[_checkpoint_format(path)]
    return Source(path, "checkpoint", job, rank0["step"], settings, rank0["world_size"])


def _checkpoint_format(path: str) -> str:
    from shared.export.sources import DCP_DIR, ENGINE_TAG

    for kind, name in (("ddp", checkpoint.MODEL_FILE), ("dcp", DCP_DIR), ("deepspeed", ENGINE_TAG)):
        if storage.exists(storage.join(path, name)):
            return kind
    raise ConfigError(f"init_from {path} holds no model.pt, dcp/ or engine/: not a training "
                      "checkpoint.")  # fmt: skip


def _run_settings(checkpoint_dir: str) -> dict:
    """The settings of the run that wrote the checkpoint (its parent directory), if known."""
    path = storage.join(checkpoint_dir.rstrip("/").rsplit("/", 1)[0], SETTINGS_FILE)
    if not storage.exists(path):
        return {}
    record = json.loads(storage.read_text(path))
    return {**record.get("settings", {}), "_job": record.get("job", "")}


def check(cfg, vocab_size: int, eos_token_id: int | None) -> None:
    """Driver preflight: resolve ``cfg.init_from`` and check that its weights fit this run's
    model (names and shapes). Records the resolved path for the workers."""
    from shared.config.run_settings import has_checkpoints

    if not getattr(cfg, "init_from", ""):
        return
    if cfg.job not in JOBS:
        raise ConfigError(f"init_from is supported by the GPT-2 jobs {', '.join(JOBS)}, "
                          f"not by {cfg.job}.")  # fmt: skip
    if storage.exists(cfg.run_dir) and has_checkpoints(cfg.run_dir):
        print(f"init_from ignored: {cfg.run_dir} has checkpoints of its own; resuming from "
              "them", flush=True)  # fmt: skip
        return
    source = resolve(cfg.init_from)
    with open_source(source) as local, warnings.catch_warnings():
        # DCP warns that it reads in one process without a process group: that is the intent.
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to load")
        state = source_state_dict(source, local)
    _check_fits(cfg, source, state, _expected_shapes(cfg, vocab_size, eos_token_id))
    cfg.init_checkpoint = source.path


def _expected_shapes(cfg, vocab_size: int, eos_token_id: int | None) -> dict[str, tuple]:
    """Parameter names and shapes of this run's model, built on the meta device (no memory)."""
    from shared.models.gpt2 import build_gpt2

    with torch.device("meta"):
        if cfg.pretrained:
            from transformers import GPT2Config, GPT2LMHeadModel

            model = GPT2LMHeadModel(GPT2Config.from_pretrained(cfg.pretrained))
        else:
            model = build_gpt2(cfg.model, vocab_size, cfg.seq_len, "", eos_token_id)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def _check_fits(cfg, source: Source, state: dict, expected: dict[str, tuple]) -> None:
    where = f"init_from {source.path}"
    if "transformer.wte.weight" not in state:
        found = ("tok_embeddings.weight: tp2d's Llama" if "tok_embeddings.weight" in state
                 else ", ".join(sorted(state)[:2]) + ", ...")  # fmt: skip
        raise ConfigError(f"{where} holds another model's weights ({found}), not GPT-2's: "
                          f"this run trains {cfg.model}.")  # fmt: skip
    for name, shape in expected.items():
        if name == "lm_head.weight" and name not in state:
            continue  # tied to the token embedding
        if name not in state:
            raise ConfigError(f"{where} lacks {name}: it holds another GPT-2 configuration "
                              f"than this run's {cfg.model}.")  # fmt: skip
        if tuple(state[name].shape) != shape:
            raise ConfigError(
                f"{where} has {name} of shape {list(state[name].shape)} where this run's "
                f"{cfg.model} has {list(shape)} (another model preset, tokenizer or seq_len)."
            )


# ------------------------------------------------------------------------------------------
# reading the source


@contextlib.contextmanager
def open_source(source: Source) -> Iterator[str]:
    """A local directory with the source's files (a temporary download from object storage)."""
    if source.kind == "checkpoint":
        with resume.open_checkpoint(source.path) as local:
            yield local
        return
    if not storage.is_remote(source.path):
        yield storage.local_path(source.path)
        return
    local = tempfile.mkdtemp(prefix="init-from-")
    try:
        storage.download_dir(source.path, local)
        yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)


def source_state_dict(source: Source, local: str) -> dict[str, torch.Tensor]:
    """Unsharded fp32 weights by the training model's names (``transformer.*``)."""
    if source.kind == "checkpoint":
        from shared.export.sources import full_state_dict

        return full_state_dict(local)
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(local, "*.safetensors")))
    if not files:
        raise ConfigError(f"init_from {source.path} has no .safetensors weights.")
    state = {}
    for path in files:
        state |= load_file(path)
    # GPT2LMHeadModel saves "transformer.*"; a bare GPT2Model export saves without the prefix.
    bare = re.compile(r"(wte|wpe|h\.\d+|ln_f)\.")
    return {(f"transformer.{k}" if bare.match(k) else k): v.float() for k, v in state.items()}


def source_train_state(directory: str, rank: int) -> TrainState:
    """Step, epoch, data position and this rank's RNG of the source checkpoint.

    The only place init_from reads them: the data layer's position format may change, and
    :func:`shared.checkpoint.load_train_state` is what resuming reads too."""
    return checkpoint.load_train_state(directory, rank)


def carries_optimizer(cfg, source: Source) -> bool:
    """Whether this run's strategy reads the source's optimizer state itself (module doc)."""
    if source.kind != "checkpoint" or source.job != cfg.job:
        return False
    if cfg.job == "zero":  # another world size goes through DeepSpeed's universal format
        return source.settings.get("zero_stage") == cfg.zero_stage
    return True


def _source_for(cfg) -> Source | None:
    if not getattr(cfg, "init_checkpoint", ""):
        return None
    return describe(cfg.init_checkpoint)


# ------------------------------------------------------------------------------------------
# workers


def load_weights(cfg, session, model: nn.Module) -> None:
    """Before the strategy wraps ``model``: the source's weights, on every rank, for a run
    that has no checkpoint of its own (that one wins: it is a resume)."""
    source = _source_for(cfg)
    if source is None or resume.plan_for(session).checkpoint is not None:
        return
    with open_source(source) as local:
        state = source_state_dict(source, local)
    own = model.state_dict()
    missing, _ = model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    if set(missing) - {"lm_head.weight"}:
        raise RuntimeError(f"init_from {source.path} lacks {sorted(missing)[:3]}")


def start_state(cfg, strategy, session) -> TrainState:
    """For a fresh run (no checkpoint of its own): where the source left off (step, data
    position, RNG; optimizer state where :func:`carries_optimizer`); a fresh state without
    ``init_from``. The weights are already in (:func:`load_weights`)."""
    source = _source_for(cfg)
    if source is None:
        return TrainState(world_size=session.world_size)
    full = carries_optimizer(cfg, source)
    state = TrainState(world_size=session.world_size)
    if source.kind == "checkpoint":
        with open_source(source) as local:
            if full:
                strategy.load(local)  # model + optimizer + scheduler, in the strategy's format
            state = source_train_state(local, session.rank)
    if full:
        optim.continue_schedule(strategy.scheduler, state.step, cfg.max_steps)
    else:
        set_schedule_step(strategy.scheduler, state.step)
    if session.rank == 0:
        what = ("weights and optimizer state loaded" if full else
                "weights loaded, optimizer state fresh")  # fmt: skip
        print(f"init_from {cfg.init_from} ({source.label()}): {what} ({source.job} -> "
              f"{cfg.job}); continuing at step {state.step} (epoch {state.epoch}, "
              f"{state.samples_in_epoch} samples into it), lr {strategy.current_lr():.2e}",
              flush=True)  # fmt: skip
    return state


def set_schedule_step(scheduler, step: int) -> None:
    """A fresh ``LambdaLR`` moved to ``step``: the LR this run's schedule has there."""
    scheduler.last_epoch = step
    lrs = []
    for group, base_lr, multiplier in zip(scheduler.optimizer.param_groups, scheduler.base_lrs,
                                          scheduler.lr_lambdas, strict=True):  # fmt: skip
        group["lr"] = base_lr * multiplier(step)
        lrs.append(group["lr"])
    scheduler._last_lr = lrs
