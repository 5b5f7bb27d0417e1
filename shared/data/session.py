"""What both sessions (Ray Train and torchrun) report about the data: the checkpoint's data
position and the read amplification. Pure torch; no Ray."""

from __future__ import annotations

import torch
import torch.distributed as dist

from shared.data.position import encode_consumed
from shared.data.reader import EpochReader


def data_position_record(reader: EpochReader, packed, epoch: int, samples_in_epoch: int) -> dict:
    """Which samples of ``epoch`` are trained on at ``samples_in_epoch`` positions: the first
    positions of the epoch's order, as compact id ranges, with what the order depends on."""
    consumed = reader.order(epoch)[:samples_in_epoch]
    return {"dataset": getattr(packed, "key", None), "seed": reader.seed, "epoch": epoch,
            "position": samples_in_epoch,
            "consumed": encode_consumed(consumed, reader.num_samples)}  # fmt: skip


def data_read_summary(reader: EpochReader, device: torch.device) -> dict:
    """Cluster-wide rows read / rows trained in this run (every rank's counts summed)."""
    counts = torch.tensor([reader.rows_read, reader.rows_trained], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        counts = counts.to(device)
        dist.all_reduce(counts)
        counts = counts.cpu()
    read, trained = (int(c) for c in counts.tolist())
    return {"data_read_amplification": round(read / trained, 4) if trained else None,
            "data_rows_read": read, "data_rows_trained": trained}  # fmt: skip
