"""Export any job's checkpoint as a Hugging Face model directory.

    make export JOB=fsdp RUN=my-run [STEP=30] [DEST=dir]
    python -m shared.export --job fsdp --run my-run [--step 30] [--dest dir] [--storage-path runs]

The result loads with ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained``: ``config.json``, ``model.safetensors``, the tokenizer files,
and ``export_info.json`` (which checkpoint, which step, which format it came from). Default
destination: ``<run_dir>/export/step_<N>``.

Which checkpoint: the newest one whose manifests verify (shared/checkpoint/resume.py, the one
a rerun would resume from), or ``step=N``, which must verify too: a half-written checkpoint is
refused, never exported. Writing goes to a temporary directory renamed when complete; on
object storage (renames are copies) every file is uploaded first and ``config.json`` last,
so a directory without ``config.json`` is an unfinished export that nothing can load.
"""

from __future__ import annotations

import json
import os
import tempfile
import types

from shared import storage
from shared.checkpoint import CheckpointInvalid, verify_checkpoint

EXPORT_DIR = "export"
INFO_FILE = "export_info.json"
SETTINGS_FILE = "settings.json"  # shared/config/run_settings.py


class ExportError(ValueError):
    """Nothing to export (or the destination is taken); the message is one sentence."""


def hf_model_from_checkpoint(directory: str, model: str, eos_token_id: int | None,
                             pretrained: str = ""):  # fmt: skip
    """The ``transformers`` model (fp32, eval mode) holding a local checkpoint's weights."""
    from shared.export import hf, sources

    state = sources.full_state_dict(directory)
    if model.startswith("llama"):
        from shared.models.llama import LLAMA_PRESETS

        if "tok_embeddings.weight" not in state:
            raise ExportError(f"{directory} holds no Llama weights but the run's model is {model}")
        result = hf.llama_hf_model(state, LLAMA_PRESETS[model], eos_token_id)
    else:
        from shared.models.gpt2 import PRESETS

        if "transformer.wte.weight" not in state:
            raise ExportError(f"{directory} holds no GPT-2 weights but the run's model is {model}")
        result = hf.gpt2_hf_model(state, PRESETS[model].n_head, eos_token_id, pretrained)
    return result.float().eval()


def export_checkpoint(checkpoint: str, dest: str, model: str, tokenizer: str,
                      pretrained: str = "", step: int | None = None) -> str:  # fmt: skip
    """Write the HF directory for ``checkpoint`` (local or remote) to ``dest``; return dest."""
    from shared.checkpoint import resume
    from shared.data import load_tokenizer
    from shared.export.sources import checkpoint_format

    if storage.exists(storage.join(dest, "config.json")):
        raise ExportError(f"{dest} already holds an export; remove it or choose another dest")
    tok = load_tokenizer(tokenizer)
    with resume.open_checkpoint(checkpoint) as local:
        hf_model = hf_model_from_checkpoint(local, model, tok.eos_token_id, pretrained)
        info = {"checkpoint": checkpoint, "step": step, "format": checkpoint_format(local),
                "model": model, "architecture": type(hf_model).__name__}  # fmt: skip

    def write(directory: str) -> None:
        hf_model.save_pretrained(directory, safe_serialization=True)
        tok.save_pretrained(directory)
        with open(os.path.join(directory, INFO_FILE), "w") as f:
            json.dump(info, f, indent=2)

    if not storage.is_remote(dest):
        with storage.atomic_directory(storage.local_path(dest)) as tmp:
            write(tmp)
        return dest
    with tempfile.TemporaryDirectory(prefix="export-") as tmp:
        write(tmp)
        config = os.path.join(tmp, "config.json")
        with open(config, "rb") as f:
            config_bytes = f.read()
        os.remove(config)
        storage.upload_dir(tmp, dest)
        storage.write_bytes(storage.join(dest, "config.json"), config_bytes)  # last: complete
    return dest


def run_settings(run_dir: str) -> dict:
    if not storage.exists(run_dir):
        raise ExportError(f"run directory {run_dir} does not exist")
    path = storage.join(run_dir, SETTINGS_FILE)
    if not storage.exists(path):
        raise ExportError(f"{run_dir} has no {SETTINGS_FILE}: not a run directory of this project")
    return json.loads(storage.read_text(path))["settings"]


def run_tokenizer(run_dir: str, settings: dict) -> str:
    """The run's tokenizer: the configured one, or the corpus' generated tokenizer (found in
    ``<storage_path>/_data`` next to the job folders, as the run resolved it)."""
    if settings.get("tokenizer"):
        return settings["tokenizer"]
    from shared.data import resolve_text_source

    storage_path = run_dir.rstrip("/").rsplit("/", 2)[0]
    cfg = types.SimpleNamespace(**{**settings, "storage_path": storage_path})
    return resolve_text_source(cfg).tokenizer


def select_checkpoint(run_dir: str, step: int | None = None) -> tuple[str, int]:
    """(path, step) of the verified checkpoint to export: the newest, or the given step's."""
    from shared.checkpoint import resume

    if not storage.exists(run_dir):
        raise ExportError(f"run directory {run_dir} does not exist")
    if step is None:
        path = resume.last_good_checkpoint(run_dir)
        if path is None:
            raise ExportError(f"{run_dir} has no complete checkpoint (none verifies)")
        return path, verify_checkpoint(path)
    names = [n for n in resume.checkpoint_dirs(run_dir) if resume.checkpoint_order(n)[0] == step]
    if not names:
        raise ExportError(f"{run_dir} has no checkpoint for step {step}")
    path = storage.join(run_dir, names[-1])  # a re-save of the step (.a<attempt>) is newer
    try:
        verify_checkpoint(path)
    except CheckpointInvalid as err:
        raise ExportError(f"checkpoint {names[-1]} is incomplete or damaged ({err})") from None
    return path, step


def default_dest(run_dir: str, step: int) -> str:
    return storage.join(run_dir, EXPORT_DIR, f"step_{step:06d}")


def export_run(run_dir: str, step: int | None = None, dest: str | None = None) -> str:
    """Export a run's checkpoint (see the module docstring); return the destination."""
    settings = run_settings(run_dir)
    checkpoint, step = select_checkpoint(run_dir, step)
    dest = dest or default_dest(run_dir, step)
    return export_checkpoint(checkpoint, dest, settings["model"], run_tokenizer(run_dir, settings),
                             settings.get("pretrained", ""), step)  # fmt: skip


def export_at_end(cfg) -> str | None:
    """Driver side, after a run that ended well: export its last checkpoint (idempotent)."""
    checkpoint, step = select_checkpoint(cfg.run_dir)
    dest = default_dest(cfg.run_dir, step)
    if storage.exists(storage.join(dest, "config.json")):
        return dest
    return export_run(cfg.run_dir, step, dest)


__all__ = ["ExportError", "export_checkpoint", "export_run", "hf_model_from_checkpoint",
           "select_checkpoint"]  # fmt: skip
