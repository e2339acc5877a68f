"""Which samples go to which rank, and which samples form each global batch. Pure, no MPI.

Positions ``0 .. n-1`` index the training samples in a fixed global order. A rank owns a
contiguous block of positions; a global batch is a set of positions drawn from a seeded
per-epoch permutation, identical for every world size. Each rank processes the part of
each global batch it owns, so the union over ranks is exactly the single-process batch.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


def block_counts(n: int, size: int) -> np.ndarray:
    """Rows per rank for ``n`` rows over ``size`` ranks, as even as possible.

    Notes: counts differ by at most 1, the first ``n % size`` ranks get one more;
    ``sum(counts) == n``; ranks get zero rows when ``n < size``.
    """
    if n < 0 or size < 1:
        raise ValueError(f"need n >= 0 and size >= 1, got n={n}, size={size}")
    q, r = divmod(n, size)
    return np.array([q + (i < r) for i in range(size)], np.int64)


def counts_displs(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, displs)`` for ``Scatterv``/``Gatherv``: ``displs[r] = sum(counts[:r])``."""
    counts = np.asarray(counts, np.int64)
    if (counts < 0).any():
        raise ValueError(f"counts must be >= 0, got {counts.tolist()}")
    return counts, np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


def block_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of the block of ``n`` positions owned by ``rank`` of ``size``."""
    counts, displs = counts_displs(block_counts(n, size))
    return int(displs[rank]), int(displs[rank] + counts[rank])


def train_test_split(n: int, test_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split row numbers ``0 .. n-1`` at random into sorted ``(train_rows, test_rows)``.

    ``len(test_rows) == round(n * test_fraction)``; deterministic given ``seed``.
    """
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test fraction must be in [0, 1), got {test_fraction}")
    n_test = int(round(n * test_fraction))
    test = np.random.default_rng([seed, 0x7E57]).choice(n, n_test, replace=False)
    mask = np.zeros(n, bool)
    mask[test] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


def steps_per_epoch(n: int, batch_size: int, drop_last: bool = False) -> int:
    """Global steps in one epoch of ``n`` samples: the same on every rank."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return n // batch_size if drop_last else -(-n // batch_size)


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """Positions ``0 .. n-1`` in the order epoch ``epoch`` visits them (seeded, P-independent)."""
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch]).permutation(n)


def local_batches(n: int, batch_size: int, start: int, stop: int, epoch: int, seed: int,
                  shuffle: bool = True, drop_last: bool = False) -> Iterator[np.ndarray | slice]:
    """For each global batch of an epoch, the LOCAL row indices (``0 .. stop-start-1``)
    of the samples this rank owns (positions ``start .. stop-1``); may be empty. Without
    shuffling each is a ``slice`` (so ``X[idx]`` is a view, not a copy).

    Yields exactly :func:`steps_per_epoch` arrays on every rank.
    """
    order = epoch_order(n, epoch, seed, shuffle)
    for s in range(steps_per_epoch(n, batch_size, drop_last)):
        pos = order[s * batch_size:(s + 1) * batch_size]
        if not shuffle:  # contiguous: a slice, so the batch is a view, not a copy
            lo, hi = max(int(pos[0]), start), min(int(pos[-1]) + 1, stop)
            yield slice(lo - start, max(hi, lo) - start)
            continue
        yield pos[(pos >= start) & (pos < stop)] - start
