"""Row ownership and batch composition (``mpidp.data.partition``): plain and property-based tests."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpidp.data.partition import (
    block_counts,
    block_range,
    counts_displs,
    epoch_order,
    local_batches,
    steps_per_epoch,
    train_test_split,
    weighted_counts,
)

FAST = settings(max_examples=150, deadline=None)

# ---------------------------------------------------------------------------- blocks


@pytest.mark.parametrize("n, size, expected", [
    (10, 3, [4, 3, 3]),
    (11, 3, [4, 4, 3]),
    (12, 3, [4, 4, 4]),
    (2, 5, [1, 1, 0, 0, 0]),
    (0, 4, [0, 0, 0, 0]),
    (0, 1, [0]),
    (7, 1, [7]),
    (13, 4, [4, 3, 3, 3]),   # prime n
    (97, 7, [14, 14, 14, 14, 14, 14, 13]),
])
def test_block_counts_examples(n, size, expected):
    counts = block_counts(n, size)
    assert counts.tolist() == expected
    assert counts.dtype == np.int64


@FAST
@given(n=st.integers(0, 10_000), size=st.integers(1, 64))
def test_block_counts_properties(n, size):
    counts = block_counts(n, size)
    assert len(counts) == size
    assert counts.sum() == n
    assert counts.max() - counts.min() <= 1
    assert (counts >= 0).all()
    # the larger blocks come first
    assert (np.diff(counts) <= 0).all()
    assert np.count_nonzero(counts == counts.max()) == (n % size or size)
    if n < size:
        assert counts.tolist() == [1] * n + [0] * (size - n)


@pytest.mark.parametrize("n, size", [(-1, 2), (5, 0), (5, -1)])
def test_block_counts_rejects_bad_arguments(n, size):
    with pytest.raises(ValueError):
        block_counts(n, size)


def test_counts_displs():
    counts, displs = counts_displs([3, 0, 2, 5])
    assert counts.tolist() == [3, 0, 2, 5]
    assert displs.tolist() == [0, 3, 3, 5]
    assert counts.dtype == displs.dtype == np.int64
    c, d = counts_displs(np.array([4]))
    assert c.tolist() == [4] and d.tolist() == [0]
    with pytest.raises(ValueError):
        counts_displs([1, -1, 2])


@FAST
@given(n=st.integers(0, 2_000), size=st.integers(1, 16))
def test_block_range_tiles_the_positions(n, size):
    counts = block_counts(n, size)
    covered = []
    prev_stop = 0
    for rank in range(size):
        start, stop = block_range(n, size, rank)
        assert isinstance(start, int) and isinstance(stop, int)
        assert start == prev_stop  # contiguous, in rank order
        assert stop - start == counts[rank]
        covered.extend(range(start, stop))
        prev_stop = stop
    assert covered == list(range(n))


# ---------------------------------------------------------------------------- train/test split


@FAST
@given(n=st.integers(0, 3_000), frac=st.floats(0.0, 0.99), seed=st.integers(0, 2**32 - 1))
def test_train_test_split_properties(n, frac, seed):
    train, test = train_test_split(n, frac, seed)
    assert len(test) == round(n * frac)
    assert len(train) + len(test) == n
    assert np.intersect1d(train, test).size == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), np.arange(n))
    assert (np.diff(train) > 0).all() and (np.diff(test) > 0).all()  # sorted, unique
    tr2, te2 = train_test_split(n, frac, seed)
    np.testing.assert_array_equal(train, tr2)
    np.testing.assert_array_equal(test, te2)


def test_train_test_split_depends_on_seed_and_is_random():
    _, a = train_test_split(1000, 0.2, 0)
    _, b = train_test_split(1000, 0.2, 1)
    assert len(a) == len(b) == 200
    assert not np.array_equal(a, b)
    assert not np.array_equal(a, np.arange(800, 1000))  # not simply the tail
    assert a.min() < 100 and a.max() > 900


@pytest.mark.parametrize("frac", [-0.1, 1.0, 1.5])
def test_train_test_split_rejects_bad_fraction(frac):
    with pytest.raises(ValueError):
        train_test_split(10, frac, 0)


# ---------------------------------------------------------------------------- epochs


@pytest.mark.parametrize("n, bs, drop_last, expected", [
    (10, 3, False, 4), (10, 3, True, 3), (9, 3, False, 3), (9, 3, True, 3),
    (0, 4, False, 0), (0, 4, True, 0), (2, 5, False, 1), (2, 5, True, 0), (1, 1, False, 1),
])
def test_steps_per_epoch(n, bs, drop_last, expected):
    assert steps_per_epoch(n, bs, drop_last) == expected


def test_steps_per_epoch_rejects_bad_batch_size():
    with pytest.raises(ValueError):
        steps_per_epoch(10, 0)


def test_epoch_order():
    a = epoch_order(100, 3, 7)
    np.testing.assert_array_equal(np.sort(a), np.arange(100))
    np.testing.assert_array_equal(a, epoch_order(100, 3, 7))
    assert not np.array_equal(a, np.arange(100))
    assert not np.array_equal(a, epoch_order(100, 4, 7))  # new epoch, new order
    assert not np.array_equal(a, epoch_order(100, 3, 8))  # new seed, new order
    np.testing.assert_array_equal(epoch_order(100, 3, 7, shuffle=False), np.arange(100))
    assert len(epoch_order(0, 0, 0)) == 0
    # world-size independent: for 1 rank and for 5 ranks the global batches are the same sets
    for size in (1, 5):
        batches = [[] for _ in range(3)]
        for rank in range(size):
            start, stop = block_range(100, size, rank)
            for s, b in enumerate(local_batches(100, 40, start, stop, 3, 7)):
                batches[s] += (b + start).tolist()
        assert [sorted(b) for b in batches] == [sorted(a[i:i + 40].tolist()) for i in (0, 40, 80)]
    # seeded from (seed, epoch) only, so it is reproducible in any process
    np.testing.assert_array_equal(epoch_order(5, 0, 0), np.random.default_rng([0, 0]).permutation(5))


# ---------------------------------------------------------------------------- local batches


def _as_indices(idx, n_local: int) -> np.ndarray:
    if isinstance(idx, slice):
        return np.arange(n_local)[idx]
    return np.asarray(idx)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 120), batch_size=st.integers(1, 40), size=st.integers(1, 7),
       epoch=st.integers(0, 5), seed=st.integers(0, 2**31), shuffle=st.booleans(),
       drop_last=st.booleans())
def test_local_batches_union_is_the_global_batch(n, batch_size, size, epoch, seed, shuffle, drop_last):
    steps = steps_per_epoch(n, batch_size, drop_last)
    order = epoch_order(n, epoch, seed, shuffle)
    per_rank = []
    for rank in range(size):
        start, stop = block_range(n, size, rank)
        batches = list(local_batches(n, batch_size, start, stop, epoch, seed, shuffle, drop_last))
        assert len(batches) == steps  # every rank takes the same number of steps
        idxs = []
        for b in batches:
            if not shuffle:
                assert isinstance(b, slice)
            else:
                assert isinstance(b, np.ndarray) and np.issubdtype(b.dtype, np.integer)
            i = _as_indices(b, stop - start)
            assert ((i >= 0) & (i < stop - start)).all()
            idxs.append(i + start)
        per_rank.append(idxs)

    seen = []
    for s in range(steps):
        glob = order[s * batch_size:(s + 1) * batch_size]
        union = np.concatenate([per_rank[r][s] for r in range(size)])
        assert len(union) == len(glob)  # each position exactly once
        np.testing.assert_array_equal(np.sort(union), np.sort(glob))
        if drop_last:
            assert len(glob) == batch_size
        seen.append(union)
    allpos = np.concatenate(seen) if seen else np.zeros(0, np.int64)
    expected_total = (n // batch_size) * batch_size if drop_last else n
    assert len(allpos) == len(np.unique(allpos)) == expected_total


def test_local_batches_concrete_example():
    # n = 10 over 3 ranks: blocks [0, 4), [4, 7), [7, 10); batches of 4 without shuffle
    out = {r: list(local_batches(10, 4, *block_range(10, 3, r), epoch=0, seed=0, shuffle=False))
           for r in range(3)}
    X = np.arange(10) * 10
    got = {r: [X[slice(block_range(10, 3, r)[0], block_range(10, 3, r)[1])][b].tolist()
               for b in out[r]] for r in range(3)}
    assert got[0] == [[0, 10, 20, 30], [], []]
    assert got[1] == [[], [40, 50, 60], []]
    assert got[2] == [[], [70], [80, 90]]


def test_local_batches_without_shuffle_are_views():
    X = np.arange(20.0).reshape(10, 2)
    start, stop = block_range(10, 2, 1)
    local = X[start:stop]
    for b in local_batches(10, 3, start, stop, 0, 0, shuffle=False):
        assert isinstance(b, slice)
        view = local[b]
        if view.size:
            assert np.shares_memory(view, X)


def test_local_batches_shuffled_is_deterministic_and_epoch_dependent():
    args = (50, 8, 10, 35)
    a = [b.tolist() for b in local_batches(*args, epoch=1, seed=3)]
    b = [b.tolist() for b in local_batches(*args, epoch=1, seed=3)]
    c = [b.tolist() for b in local_batches(*args, epoch=2, seed=3)]
    assert a == b
    assert a != c


def test_weighted_counts_of_capacities_near_floats_largest_value():
    """Their sum overflowed to inf: NumPy warnings, then a message about negative repeats."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert weighted_counts(10, [1e308, 1e308]).tolist() == [5, 5]
        assert weighted_counts(7, [0, 1e308, 1e-300]).tolist() == [0, 7, 0]
        assert weighted_counts(9, [1e308, 2e307]).tolist() == weighted_counts(9, [10, 2]).tolist()
