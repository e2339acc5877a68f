"""Both ways of splitting the input, and bad input raised identically on every rank."""

from __future__ import annotations

import mmap
import os

import numpy as np
import pytest
from mpi_helpers import all_ranks, file_map, raises_everywhere

import mpidp
from mpidp.comm import scatterv_rows
from mpidp.data.partition import block_counts


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 7, 13, 100])
def test_scatterv_block_rows_any_n(comm, n):
    full = np.arange(n * 3, dtype=np.float64).reshape(n, 3)
    got = scatterv_rows(comm, full if comm.rank == 0 else None, block_counts(n, comm.size),
                        (3,), np.float64)
    expected = np.array_split(full, comm.size)[comm.rank]  # reference: numpy's split
    all_ranks(comm, got.shape == expected.shape and np.array_equal(got, expected))


@pytest.mark.mpi(min_size=2)
def test_scatterv_arbitrary_counts_with_zeros_and_root(comm):
    counts = [(r * 3) % 4 for r in range(comm.size)]  # 0, 3, 2, 1, ...
    n = sum(counts)
    root = comm.size - 1
    full = np.arange(n * 4, dtype=np.int64).reshape(n, 2, 2)
    got = scatterv_rows(comm, full if comm.rank == root else None, counts, (2, 2), np.int64, root)
    start = sum(counts[:comm.rank])
    all_ranks(comm, np.array_equal(got, full[start:start + counts[comm.rank]]))


def _write_folder(comm, path, X, y):
    if comm.rank == 0:
        os.makedirs(path, exist_ok=True)
        np.save(os.path.join(path, "X.npy"), X)
        np.save(os.path.join(path, "y.npy"), y)
    comm.Barrier()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fmt", ["folder", "npz", "h5"])
def test_scatter_and_local_give_identical_shards(comm, shared_tmp, fmt):
    if fmt == "h5":
        pytest.importorskip("h5py")  # on every rank: a skip on one alone would hang the rest
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((57, 4)), rng.integers(0, 3, 57)
    path = os.path.join(shared_tmp, "d")
    if fmt == "folder":
        _write_folder(comm, path, X, y)
    elif comm.rank == 0:
        if fmt == "npz":
            np.savez(path + ".npz", X=X, y=y)
        else:
            import h5py
            with h5py.File(path + ".h5", "w") as f:
                f["X"], f["y"] = X, y
    comm.Barrier()
    path += {"folder": "", "npz": ".npz", "h5": ".h5"}[fmt]
    a = mpidp.load(comm, path, distribute="scatter", seed=1, dtype=np.float64)
    b = mpidp.load(comm, path, distribute="local", seed=1, dtype=np.float64)
    for sa, sb in ((a.train, b.train), (a.test, b.test)):
        all_ranks(comm, np.array_equal(sa.X, sb.X) and np.array_equal(sa.y, sb.y)
                  and sa.start == sb.start and sa.n_total == sb.n_total)
    rows = comm.allgather(a.train.X)
    all_ranks(comm, sum(len(r) for r in rows) == 46 and a.test.n_total == 11)
    # every training row is a row of the file, each exactly once
    allX = np.concatenate(rows)
    all_ranks(comm, len({tuple(r) for r in allX}) == 46 and
              all(any(np.array_equal(r, x) for x in X) for r in allX[:5]))


@pytest.mark.mpi(min_size=1)
def test_local_reads_hold_about_n_over_p_rows(comm, shared_tmp):
    n = 4000
    X = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    path = os.path.join(shared_tmp, "big")
    _write_folder(comm, path, X, np.zeros(n, np.int64))
    mine = block_counts(n, comm.size)[comm.rank]
    data = mpidp.load(comm, path, distribute="local", test_fraction=0.0)
    pages = file_map(data.train.X)  # mapped: only this rank's rows, shared with the cache
    all_ranks(comm, len(data.train.X) == mine and pages is not None
              and mine * 8 <= len(pages) < mine * 8 + mmap.PAGESIZE)
    data = mpidp.load(comm, path, distribute="local", test_fraction=0.0, copy=True)
    all_ranks(comm, len(data.train.X) == mine and file_map(data.train.X) is None
              and data.train.X.flags.owndata and data.train.X.nbytes == mine * 8)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_missing_file_fails_everywhere(comm, shared_tmp, distribute):
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.load(
        comm, os.path.join(shared_tmp, "nope.npz"), distribute=distribute), "not found")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_nan_in_one_ranks_rows_fails_everywhere(comm, shared_tmp, distribute):
    X = np.ones((40, 3))
    X[39, 1] = np.nan  # the last rows belong to the last rank in local mode
    path = os.path.join(shared_tmp, "nan")
    _write_folder(comm, path, X, np.zeros(40, np.int64))
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.load(
        comm, path, distribute=distribute, test_fraction=0.0), "NaN or Inf (first at row 39)")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_labels_out_of_range_fail_everywhere(comm, shared_tmp, distribute):
    y = np.zeros(30, np.int64)
    y[-1] = 5
    path = os.path.join(shared_tmp, "labels")
    _write_folder(comm, path, np.ones((30, 2)), y)
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.load(
        comm, path, distribute=distribute, n_classes=3, test_fraction=0.0), "label 5 is out of range")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_length_mismatch_fails_everywhere(comm, shared_tmp, distribute):
    path = os.path.join(shared_tmp, "len")
    _write_folder(comm, path, np.ones((30, 2)), np.zeros(29, np.int64))
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.load(
        comm, path, distribute=distribute), "X has 30 rows but y has 29")


@pytest.mark.mpi(min_size=2)
def test_wrong_feature_count_on_one_rank_fails_everywhere(comm):
    width = 5 if comm.rank == comm.size - 1 else 4
    X, y = np.ones((3, width)), np.zeros(3, np.int64)
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.shard_from_arrays(comm, X, y, 4),
                      "X has 5 features but the model expects 4")
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.shard_from_arrays(comm, X, y),
                      "ranks disagree on the number of features")


@pytest.mark.mpi(min_size=2)
def test_inf_on_one_rank_fails_everywhere(comm):
    X = np.ones((3, 4))
    if comm.rank == 1:
        X[0, 0] = np.inf
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: mpidp.shard_from_arrays(comm, X, np.zeros(3, np.int64)), "NaN or Inf")


@pytest.mark.mpi(min_size=1)
def test_shard_from_arrays_orders_by_rank(comm):
    X = np.full((comm.rank + 1, 2), float(comm.rank))
    shard = mpidp.shard_from_arrays(comm, X, np.zeros(comm.rank + 1, np.int64))
    all_ranks(comm, shard.start == comm.rank * (comm.rank + 1) // 2)
    all_ranks(comm, shard.n_total == comm.size * (comm.size + 1) // 2)
