"""One full fp32 state dict (the training model's parameter names) from any strategy's
checkpoint, in one process and without a process group.

  model.pt   DDP (and the jobs built on it): rank 0's full ``{"model": state_dict, ...}``
  dcp/       FSDP2 and TP x FSDP: DCP shards; ``dcp.load`` without a process group reads
             every shard and reassembles full tensors (the shapes come from DCP's metadata)
  engine/    DeepSpeed: ZeRO 1/2/3 partitions merged by DeepSpeed's own ``zero_to_fp32``;
             stage 0 keeps the whole module in ``mp_rank_00_model_states.pt``
"""

from __future__ import annotations

import glob
import os

import torch

from shared.checkpoint import MODEL_FILE

DCP_DIR = "dcp"  # shared/parallel/fsdp.py (not imported: it pulls in FSDP for nothing)
ENGINE_TAG = "engine"  # shared/parallel/zero.py


def checkpoint_format(directory: str) -> str:
    """'ddp', 'dcp' or 'deepspeed' from the files a checkpoint holds."""
    if os.path.isfile(os.path.join(directory, MODEL_FILE)):
        return "ddp"
    if os.path.isdir(os.path.join(directory, DCP_DIR)):
        return "dcp"
    if os.path.isdir(os.path.join(directory, ENGINE_TAG)):
        return "deepspeed"
    raise ValueError(f"{directory} holds no model.pt, dcp/ or engine/: not a training checkpoint")


def full_state_dict(directory: str) -> dict[str, torch.Tensor]:
    """Unsharded fp32 tensors by the training model's names."""
    kind = checkpoint_format(directory)
    if kind == "ddp":
        state = torch.load(os.path.join(directory, MODEL_FILE), map_location="cpu",
                           weights_only=True)  # fmt: skip
        model = state["model"]
    elif kind == "dcp":
        model = _dcp_model_state(os.path.join(directory, DCP_DIR))
    else:
        model = _deepspeed_model_state(directory)
    return {k: v.float() if v.is_floating_point() else v for k, v in model.items()}


def _dcp_model_state(path: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(path).read_metadata()
    template = {
        key[len("model."):]: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }  # fmt: skip
    state = {"model": template}
    dcp.load(state, checkpoint_id=path, no_dist=True)  # reshards into this one process
    return state["model"]


def _deepspeed_model_state(directory: str) -> dict[str, torch.Tensor]:
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    engine = os.path.join(directory, ENGINE_TAG)
    if glob.glob(os.path.join(engine, "*optim_states.pt")):  # ZeRO 1/2/3 partitions
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return dict(get_fp32_state_dict_from_zero_checkpoint(directory, tag=ENGINE_TAG))
    state = torch.load(os.path.join(engine, "mp_rank_00_model_states.pt"), map_location="cpu",
                       weights_only=False)  # fmt: skip
    return state["module"]
