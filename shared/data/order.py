"""Each epoch's sample order, and which rank reads which part of it.

The order is a function of (seed, epoch, number of samples, chunk size) only, never of the
world size or of timing (elastic determinism, as in Megatron's indexed datasets):

  * **granularity**: the packed dataset is cut into chunks of ``chunk_rows`` consecutive
    ``sample_id`` (one parquet file each). An epoch permutes the chunks, then the rows inside
    each chunk, both from ``numpy.random.default_rng([seed, epoch])``. Two samples of one chunk
    stay within one chunk-length window of the epoch; anything else is fully shuffled.
  * **cost**: every rank computes the whole permutation: O(N) time and 8 bytes per sample
    (1,000,000 samples: 8 MB, ~20 ms); nothing is shuffled through the network.

Positions ``[j*G, (j+1)*G)`` of the order are global batch ``j`` (``G`` sequences per optimizer
step) at every world size. Inside a step, micro-step ``t`` covers positions
``[t*R*b, (t+1)*R*b)`` and reader ``w`` of ``R`` takes ``b`` of them: ``[t*R*b + w*b, ... + b)``.
Only the split of a global batch among ranks depends on the world size, never its samples, so
a checkpoint's position (a count of positions consumed, always a multiple of ``G``) means the
same samples at every world size. The tail of an epoch shorter than ``G`` is not trained in
that epoch (a different tail each epoch).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def epoch_order(seed: int, epoch: int, num_samples: int, chunk_rows: int) -> np.ndarray:
    """The sample ids of ``epoch`` in training order (a permutation of ``range(num_samples)``)."""
    rng = np.random.default_rng([seed, epoch])
    n_chunks = -(-num_samples // chunk_rows)
    parts = []
    for chunk in rng.permutation(n_chunks):
        start = int(chunk) * chunk_rows
        size = min(chunk_rows, num_samples - start)
        parts.append(start + rng.permutation(size))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def usable_samples(num_samples: int, global_batch: int) -> int:
    """Samples an epoch trains on: whole global batches only, the same at every world size."""
    return num_samples // global_batch * global_batch


def reader_micro_batches(
    order: np.ndarray, start: int, end: int, reader: int, readers: int, batch: int
) -> Iterator[tuple[int, np.ndarray]]:
    """(first position, sample ids) of each micro-batch reader ``reader`` of ``readers`` trains
    on between positions ``start`` and ``end`` (both multiples of ``readers * batch``)."""
    step = readers * batch
    if start % step or end % step:
        raise ValueError(f"positions {start}..{end} are not multiples of {readers} x {batch}")
    for base in range(start, end, step):
        first = base + reader * batch
        yield first, order[first : first + batch]


def reader_sample_ids(
    order: np.ndarray, start: int, end: int, reader: int, readers: int, batch: int
) -> np.ndarray:
    """Every sample id one reader needs in ``[start, end)``, in training order."""
    parts = [ids for _, ids in reader_micro_batches(order, start, end, reader, readers, batch)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
