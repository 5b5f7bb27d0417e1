"""The data position a checkpoint carries: which samples of the current epoch were trained on.

Stored as sorted, disjoint ``[start, end)`` ranges of ``sample_id``, encoded compactly: the
range boundaries as delta varints, or a bitmap when that is smaller, zlib-compressed and
base64'd into ``train_state.json``. Worst case (every other sample) for N samples is the bitmap,
N/8 bytes before compression: 1,000,000 samples stay under 130 kB.
"""

from __future__ import annotations

import base64
import zlib

import numpy as np


def to_ranges(sample_ids: np.ndarray) -> np.ndarray:
    """Sorted disjoint ``[start, end)`` ranges (shape [k, 2]) covering ``sample_ids``."""
    ids = np.unique(np.asarray(sample_ids, dtype=np.int64))
    if not len(ids):
        return np.zeros((0, 2), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.r_[0, breaks]]
    ends = ids[np.r_[breaks - 1, len(ids) - 1]] + 1
    return np.stack([starts, ends], axis=1)


def _varints(values: np.ndarray) -> bytes:
    out = bytearray()
    for value in values.tolist():
        while value >= 0x80:
            out.append((value & 0x7F) | 0x80)
            value >>= 7
        out.append(value)
    return bytes(out)


def _from_varints(data: bytes) -> np.ndarray:
    values, value, shift = [], 0, 0
    for byte in data:
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            values.append(value)
            value, shift = 0, 0
    return np.asarray(values, dtype=np.int64)


def encode_consumed(sample_ids: np.ndarray, num_samples: int) -> dict:
    """The consumed set as a small JSON-able dict (see the module docstring)."""
    ranges = to_ranges(sample_ids)
    deltas = np.diff(np.r_[0, ranges.reshape(-1)])  # boundaries are increasing: deltas >= 0
    as_ranges = zlib.compress(_varints(deltas), 9)
    bitmap = np.zeros(num_samples, dtype=bool)
    for start, end in ranges.tolist():
        bitmap[start:end] = True
    as_bitmap = zlib.compress(np.packbits(bitmap).tobytes(), 9)
    smaller = len(as_ranges) <= len(as_bitmap)
    kind, data = ("ranges", as_ranges) if smaller else ("bitmap", as_bitmap)
    return {"num_samples": num_samples, "count": int(sum(e - s for s, e in ranges.tolist())),
            "encoding": kind, "data": base64.b64encode(data).decode("ascii")}  # fmt: skip


def decode_consumed(record: dict) -> np.ndarray:
    """The sorted sample ids an :func:`encode_consumed` record holds."""
    data = zlib.decompress(base64.b64decode(record["data"]))
    if record["encoding"] == "bitmap":
        bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8))[: record["num_samples"]]
        return np.flatnonzero(bits).astype(np.int64)
    bounds = np.cumsum(_from_varints(data)).reshape(-1, 2)
    if not len(bounds):
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in bounds.tolist()])
