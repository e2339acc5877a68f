"""Which samples go to which rank, and which form each global batch. Pure, no MPI. A global
batch is drawn from a seeded per-epoch permutation of positions ``0 .. n-1``, the same for
any world size; each rank processes its part of it. :class:`Partition` names a strategy."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


def block_counts(n: int, size: int) -> np.ndarray:
    """Rows per rank, ``n`` over ``size`` ranks: ``n // size``, one more on the first ``n % size``."""
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
    """Sorted ``(train_rows, test_rows)`` of ``0 .. n-1``; ``round(n * test_fraction)`` random test rows."""
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test fraction must be in [0, 1), got {test_fraction}")
    n_test = int(round(n * test_fraction))
    mask = np.zeros(n, bool)
    mask[np.random.default_rng([seed, 0x7E57]).choice(n, n_test, replace=False)] = True
    return np.flatnonzero(~mask), np.flatnonzero(mask)


def validation_split(train_rows: np.ndarray, val_fraction: float, seed: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Hold ``round(len(train_rows) * val_fraction)`` of the training rows out, at random
    (seeded apart from the test split): sorted ``(train_rows, val_rows)``."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"validation fraction must be in [0, 1), got {val_fraction}")
    keep, held = train_test_split(len(train_rows), val_fraction, seed + 0x5A11)
    return train_rows[keep], train_rows[held]


#: The share of rows held out for testing when neither a fraction nor a fixed test set is given.
DEFAULT_TEST_FRACTION = 0.2


def split_rows(n: int, test_fraction: float | None, seed: int,
               fixed_test: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Sorted ``(train_rows, test_rows)`` of ``n`` rows: the dataset's own test set (its last
    ``fixed_test`` rows) when ``test_fraction`` is None and it has one; else
    :func:`train_test_split` (None: :data:`DEFAULT_TEST_FRACTION`)."""
    if test_fraction is None and fixed_test is not None:
        if not 0 < fixed_test < n:
            raise ValueError(f"a fixed test set of {fixed_test} rows needs 0 < rows < {n}")
        return (np.arange(n - fixed_test, dtype=np.int64),
                np.arange(n - fixed_test, n, dtype=np.int64))
    return train_test_split(n, DEFAULT_TEST_FRACTION if test_fraction is None else test_fraction,
                            seed)


def steps_per_epoch(n: int, batch_size: int, drop_last: bool = False) -> int:
    """Global steps in one epoch of ``n`` samples: the same on every rank."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    return n // batch_size if drop_last else -(-n // batch_size)


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """Positions ``0 .. n-1`` in the order epoch ``epoch`` visits them (seeded, P-independent)."""
    return np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)


def local_batches(n: int, batch_size: int, start: int, stop: int, epoch: int, seed: int,
                  shuffle: bool = True, drop_last: bool = False) -> Iterator[np.ndarray | slice]:
    """For each global batch of an epoch, the LOCAL row indices (``0 .. stop-start-1``) of
    the samples this rank owns (positions ``start .. stop-1``); may be empty; without
    shuffling a ``slice`` (a view, not a copy). Exactly :func:`steps_per_epoch` of them."""
    order = epoch_order(n, epoch, seed, shuffle)
    for s in range(steps_per_epoch(n, batch_size, drop_last)):
        pos = order[s * batch_size:(s + 1) * batch_size]
        if not shuffle:  # contiguous: a slice, so the batch is a view, not a copy
            lo, hi = max(int(pos[0]), start), min(int(pos[-1]) + 1, stop)
            yield slice(lo - start, max(hi, lo) - start)
            continue
        yield pos[(pos >= start) & (pos < stop)] - start


# --- strategies: ``owner`` int64 ``(n,)``, the rank that holds each training position ----
# (one owner each, so every sample is used once per epoch whatever the strategy)

STRATEGIES = ("block", "cyclic", "shuffled", "weighted", "cost", "adaptive")
#: Strategies whose ownership is recomputed for every epoch's global batches.
PER_BATCH = ("cost", "adaptive")


def check_weights(values, length: int, what: str) -> np.ndarray:
    """``values`` as float64 ``(length,)``; ValueError for a wrong length, NaN/Inf, negatives or all zeros."""
    a = np.asarray(values, np.float64).reshape(-1) if values is not None else None
    if a is None or len(a) != length:
        got = "none" if a is None else str(len(a))
        raise ValueError(f"{what} must have {length} entries, got {got}")
    if not np.isfinite(a).all():
        raise ValueError(f"{what} contain NaN or Inf")
    if (a < 0).any():
        raise ValueError(f"{what} must be >= 0, found {a.min():g}")
    if length and not (a > 0).any():
        raise ValueError(f"{what} are all zero: nothing to balance")
    return a


def owner_block(n: int, size: int) -> np.ndarray:
    """Contiguous :func:`block_counts` blocks: rank 0 owns the first positions."""
    return np.repeat(np.arange(size, dtype=np.int64), block_counts(n, size))


def owner_cyclic(n: int, size: int) -> np.ndarray:
    """Round robin: position ``i`` goes to rank ``i % size``. Counts differ by at most 1,
    and on data sorted by cost each rank gets every size-th sample of every cost level."""
    if n < 0 or size < 1:
        raise ValueError(f"need n >= 0 and size >= 1, got n={n}, size={size}")
    return np.arange(n, dtype=np.int64) % size


def owner_shuffled(n: int, size: int, seed: int) -> np.ndarray:
    """Blocks of a seeded permutation that depends on ``seed`` only, so the same order is cut
    into ``size`` pieces for any world size."""
    perm = np.random.default_rng([seed, 0x5AFF]).permutation(n)
    owner = np.empty(n, np.int64)
    owner[perm] = owner_block(n, size)
    return owner


def weighted_counts(n: int, capacities) -> np.ndarray:
    """Rows per rank proportional to ``capacities`` ``(size,)`` (largest remainder):
    ``sum(counts) == n``, each within 1 of its share, ties to the lower rank."""
    caps = check_weights(capacities, len(np.atleast_1d(capacities)), "capacities")
    if n < 0:
        raise ValueError(f"need n >= 0, got {n}")
    with np.errstate(over="ignore"):
        if not np.isfinite(caps.sum() * max(n, 1)):  # near float's largest value: the same
            caps = caps / caps.max()  # shares, relative to the largest capacity
    exact = n * caps / caps.sum()
    counts = np.floor(exact).astype(np.int64)
    extra = int(n - counts.sum())
    order = np.lexsort((np.arange(len(caps)), -(exact - counts)))  # biggest remainder first
    counts[order[:extra]] += 1
    return counts


def owner_weighted(n: int, capacities) -> np.ndarray:
    """Contiguous blocks of :func:`weighted_counts` rows (heterogeneous ranks, equal costs)."""
    counts = weighted_counts(n, capacities)
    return np.repeat(np.arange(len(counts), dtype=np.int64), counts)


def balance_batches(order: np.ndarray, batch_size: int, costs, capacities) -> np.ndarray:
    """Owner (int64 ``(n,)``) of each position so that EVERY global batch of ``order`` is
    balanced by ``costs`` ``(n,)`` over ranks of speeds ``capacities``: largest cost first,
    each to the rank that would finish it earliest (LPT), lowest rank on ties; per batch
    ``max_r load_r / capacity_r <= total / W + P' * max(c) / W``. Vectorised over batches."""
    order = np.asarray(order, np.int64)
    n = len(order)
    costs = check_weights(costs, n, "costs") if n else np.zeros(0)
    caps = check_weights(capacities, len(np.atleast_1d(capacities)), "capacities")
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    owner = np.zeros(n, np.int64)
    if n == 0:
        return owner
    bs = min(batch_size, n)
    nb = -(-n // bs)
    pos = np.concatenate([order, np.full(nb * bs - n, -1, np.int64)]).reshape(nb, bs)
    c = np.where(pos >= 0, costs[np.maximum(pos, 0)], -1.0)  # padding sorts last
    by_cost = np.argsort(-c, axis=1, kind="stable")
    pos, c = np.take_along_axis(pos, by_cost, 1), np.maximum(np.take_along_axis(c, by_cost, 1), 0)
    usable = caps > 0
    inv = np.where(usable, 1.0 / np.where(usable, caps, 1.0), 0.0)
    loads, rows = np.zeros((nb, len(caps))), np.arange(nb)
    who = np.empty((nb, bs), np.int64)
    for k in range(bs):
        finish = np.where(usable, (loads + c[:, k:k + 1]) * inv, np.inf)
        who[:, k] = r = np.argmin(finish, axis=1)
        loads[rows, r] += c[:, k]
    valid = pos >= 0
    owner[pos[valid]] = who[valid]
    return owner


def adaptive_capacities(work: np.ndarray, seconds: np.ndarray, previous) -> np.ndarray:
    """New capacities ``(size,)`` (mean 1) from the measured ``work / seconds``; a rank that did
    no work or took no time keeps its previous capacity (rescaled)."""
    work, seconds = np.asarray(work, np.float64), np.asarray(seconds, np.float64)
    prev = check_weights(previous, len(work), "capacities")
    measured = (work > 0) & (seconds > 0) & np.isfinite(seconds)
    caps = prev / prev.mean()
    if measured.any():
        speed = work[measured] / seconds[measured]
        caps = caps * (speed.sum() / caps[measured].sum())
        caps[measured] = speed
    caps = np.where(caps > 0, caps, caps[caps > 0].min() if (caps > 0).any() else 1.0)
    return caps / caps.mean()


def _checked(strategy: str, n: int, size: int, costs, capacities) -> tuple:
    """``(costs, capacities)`` checked (all ones where not given); ValueError for an unknown
    strategy, bad weights, or ``adaptive`` with fewer samples than ranks."""
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown partition strategy {strategy!r}; expected one of {STRATEGIES}")
    if n < 0 or size < 1:
        raise ValueError(f"need n >= 0 and size >= 1, got n={n}, size={size}")
    costs = check_weights(costs, n, "costs") if costs is not None else np.ones(n)
    caps = check_weights(capacities, size, "capacities") if capacities is not None else np.ones(size)
    if strategy == "adaptive" and n < size:
        raise ValueError(f"partition 'adaptive' needs at least one sample per rank to measure "
                         f"its speed: {n} samples for {size} ranks")
    return costs, caps


def assign(strategy: str, n: int, size: int, *, seed: int = 0, costs=None,
           capacities=None) -> np.ndarray:
    """The initial owner ``(n,)`` of every position under ``strategy`` (:data:`STRATEGIES`;
    ``cost`` and ``adaptive``: one LPT assignment over the whole set, unit costs and equal
    capacities unless given). ValueError as :func:`_checked` says."""
    costs, caps = _checked(strategy, n, size, costs, capacities)
    owner = {"block": lambda: owner_block(n, size), "cyclic": lambda: owner_cyclic(n, size),
             "shuffled": lambda: owner_shuffled(n, size, seed),
             "weighted": lambda: owner_weighted(n, caps)}.get(strategy)
    return owner() if owner else balance_batches(np.arange(n), max(n, 1), costs, caps)


def positions_of(owner: np.ndarray, rank: int) -> np.ndarray:
    """Sorted positions owned by ``rank``: int64 ``(count,)``."""
    return np.flatnonzero(np.asarray(owner) == rank).astype(np.int64)


def scatter_plan(owner: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(rows, counts, displs)`` for ``Scatterv``: ``X[rows]`` holds rank 0's positions in
    increasing order, then rank 1's, ..."""
    owner = np.asarray(owner, np.int64)
    rows = np.argsort(owner, kind="stable").astype(np.int64)
    counts, displs = counts_displs(np.bincount(owner, minlength=size).astype(np.int64))
    return rows, counts, displs


def owned_batches(n: int, batch_size: int, positions: np.ndarray, epoch: int, seed: int,
                  shuffle: bool = True, drop_last: bool = False,
                  first_step: int = 0) -> Iterator[np.ndarray]:
    """As :func:`local_batches` for any sorted owned ``positions``: per global batch from
    step ``first_step`` on, the local row indices of the samples this rank owns."""
    local = np.full(n, -1, np.int64)
    local[positions] = np.arange(len(positions))
    order = epoch_order(n, epoch, seed, shuffle)
    for s in range(first_step, steps_per_epoch(n, batch_size, drop_last)):
        idx = local[order[s * batch_size:(s + 1) * batch_size]]
        yield idx[idx >= 0]


@dataclass
class Partition:
    """A strategy by name (:data:`STRATEGIES`) and its inputs: ``costs`` ``(n,)`` per training
    position (``cost``/``adaptive``; None: unit costs), ``capacities`` ``(size,)`` relative
    rank speeds (``weighted``; ``adaptive``'s start), ``adapt_every``: ``adaptive``
    re-measures every this many steps (None: every epoch)."""

    strategy: str = "block"
    costs: np.ndarray | None = None
    capacities: np.ndarray | None = None
    adapt_every: int | None = None
    seed: int = 0

    def check(self, n: int, size: int) -> None:
        """Raise ValueError for an unknown strategy, bad costs/capacities or a bad interval."""
        _checked(self.strategy, n, size, self.costs, self.capacities)
        if self.adapt_every is not None and self.adapt_every < 1:
            raise ValueError(f"adapt interval must be >= 1 step, got {self.adapt_every}")

    def owner(self, n: int, size: int) -> np.ndarray:
        """The initial owner ``(n,)`` (:func:`mpidp.data.partition.assign`)."""
        return assign(self.strategy, n, size, seed=self.seed, costs=self.costs,
                      capacities=self.capacities)
