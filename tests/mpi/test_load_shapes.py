"""Samples of any shape through ``mpidp.load`` (both distributions, every file format),
``shard_from_arrays`` and row moves between ranks; a dataset's own test set (MNIST-1D).
Shards are compared with rows taken by plain NumPy from the arrays written, at their
global positions."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi_helpers import all_ranks, file_map, raises_everywhere

import mpidp
from mpidp.comm import collectives as Coll
from mpidp.data import rows as R
from mpidp.data.partition import assign, positions_of, train_test_split

FORMATS = ["folder", "npz", "npz-compressed", "h5", "h5-chunked"]


@pytest.fixture
def tiny_limits(monkeypatch):
    monkeypatch.setattr(R, "BLOCK_BYTES", 256)  # a few samples per block
    monkeypatch.setattr(Coll, "ROUND_BYTES", 512)  # a few samples per rank per round


def _write(comm, base, fmt, X, y) -> str:
    """Write ``(X, y)`` as ``fmt`` on rank 0; every rank gets the path."""
    path = base + {"npz": ".npz", "npz-compressed": ".npz"}.get(fmt, ".h5" if "h5" in fmt else "")
    if comm.rank == 0:
        if fmt == "folder":
            os.makedirs(path)
            np.save(os.path.join(path, "X.npy"), X)
            np.save(os.path.join(path, "y.npy"), y)
        elif fmt.startswith("npz"):
            (np.savez_compressed if fmt == "npz-compressed" else np.savez)(path, X=X, y=y)
        else:
            import h5py
            with h5py.File(path, "w") as f:
                f.create_dataset("X", data=X, chunks=(5, *X.shape[1:]) if fmt == "h5-chunked"
                                 else None)
                f["y"] = y
    comm.Barrier()
    return path


def _expected(X, y, test_fraction, seed, strategy, size, rank):
    train, test = train_test_split(len(X), test_fraction, seed)
    pos = positions_of(assign(strategy, len(train), size, seed=seed), rank)
    test_pos = np.array_split(np.arange(len(test)), size)[rank]
    return (X[train[pos]], y[train[pos]], pos), (X[test[test_pos]], y[test[test_pos]], test_pos)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape, strategy", [((1, 6, 6), "block"), ((2, 3, 2, 2), "cyclic")])
@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_samples_keep_their_shape_and_rows_their_positions(comm, shared_tmp, tiny_limits, fmt,
                                                           shape, strategy, distribute):
    if "h5" in fmt:
        pytest.importorskip("h5py")  # on every rank: a skip on one alone would hang the rest
    rng = np.random.default_rng(6)
    X, y = rng.standard_normal((71, *shape)).astype(np.float32), rng.integers(0, 5, 71)
    path = _write(comm, os.path.join(shared_tmp, "d"), fmt, X, y)
    data = mpidp.load(comm, path, distribute=distribute, test_fraction=0.3, seed=4,
                      dtype=np.float32, partition=strategy)
    all_ranks(comm, data.sample_shape == shape and data.n_features == int(np.prod(shape))
              and data.test_split == "random", f"{data.sample_shape}, {data.n_features}")
    refs = _expected(X, y, 0.3, 4, strategy, comm.size, comm.rank)
    for shard, (Xr, yr, pos) in zip((data.train, data.test), refs):
        all_ranks(comm, shard.X.shape == (len(pos), *shape) and shard.sample_shape == shape
                  and shard.X.dtype == np.float32 and np.array_equal(shard.X, Xr)
                  and np.array_equal(shard.y, yr) and np.array_equal(shard.positions, pos),
                  f"{fmt} {distribute}: rank {comm.rank} got {shard.X.shape}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_images_are_cast_while_read(comm, shared_tmp, tiny_limits, distribute):
    X = np.random.default_rng(7).standard_normal((40, 3, 4, 4))  # float64 file
    y = np.arange(40) % 3
    path = _write(comm, os.path.join(shared_tmp, "c"), "folder", X, y)
    data = mpidp.load(comm, path, distribute=distribute, test_fraction=0.0, dtype=np.float32)
    got = np.concatenate(comm.allgather(data.train.X))
    all_ranks(comm, got.shape == X.shape and np.array_equal(got, X.astype(np.float32)))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fmt", ["folder", "h5"])
def test_local_reads_map_4d_samples_copy_on_write(comm, shared_tmp, fmt):
    if fmt == "h5":
        pytest.importorskip("h5py")
    X = np.random.default_rng(8).standard_normal((203, 2, 3, 2, 2)).astype(np.float32)
    y = np.arange(203) % 4
    path = _write(comm, os.path.join(shared_tmp, "m"), fmt, X, y)
    data = mpidp.load(comm, path, distribute="local", test_fraction=0.0)
    (Xr, _, _), _ = _expected(X, y, 0.0, 0, "block", comm.size, comm.rank)
    train = data.train.X
    all_ranks(comm, train.shape == Xr.shape and np.array_equal(train, Xr)
              and file_map(train) is not None and train.flags.writeable, f"{fmt}: not mapped")
    train[:] = -1.0  # copy-on-write: neither the file nor another rank sees it
    comm.Barrier()
    again = mpidp.load(comm, path, distribute="scatter", test_fraction=0.0)
    all_ranks(comm, np.array_equal(again.train.X, Xr), "a write reached the file")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_nan_in_an_image_fails_everywhere_naming_its_row(comm, shared_tmp, distribute):
    X = np.ones((30, 1, 3, 3))
    X[28, 0, 1, 2] = np.nan  # the last rank's rows in local mode
    path = _write(comm, os.path.join(shared_tmp, "n"), "folder", X, np.zeros(30, np.int64))
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.load(
        comm, path, distribute=distribute, test_fraction=0.0), "NaN or Inf (first at row 28)")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_a_datasets_own_test_set_is_kept(comm, monkeypatch, distribute):
    """A source with a fixed test set (as ``mnist1d``: its last rows; a stand-in here, the
    real set is checked in tests/data/test_datasets.py) keeps it as the test set unless a test
    fraction is asked for; the training rows stay in file order."""
    from mpidp.data import datasets
    from mpidp.data.sources import ArraySource
    X = np.random.default_rng(9).standard_normal((200, 1, 40))
    y = np.arange(200) % 10
    monkeypatch.setattr(datasets, "mnist1d", lambda: ArraySource("mnist1d", X, y, fixed_test=40))
    data = mpidp.load(comm, "mnist1d", distribute=distribute, dtype=np.float64)
    test = np.arange(160, 200)[np.array_split(np.arange(40), comm.size)[comm.rank]]
    all_ranks(comm, data.test_split == "fixed" and data.train.n_total == 160
              and data.test.n_total == 40 and data.sample_shape == (1, 40))
    all_ranks(comm, np.array_equal(data.test.X, X[test]) and np.array_equal(data.test.y, y[test]))
    train = np.concatenate(comm.allgather(data.train.X))
    all_ranks(comm, np.array_equal(train, X[:160]))
    data = mpidp.load(comm, "mnist1d", distribute=distribute, dtype=np.float64,
                      test_fraction=0.25, seed=1)
    refs = _expected(X, y, 0.25, 1, "block", comm.size, comm.rank)
    all_ranks(comm, data.test_split == "random" and data.test.n_total == 50
              and np.array_equal(data.test.X, refs[1][0]))


@pytest.mark.mpi(min_size=1)
def test_shard_from_arrays_takes_images(comm):
    X = np.full((comm.rank + 1, 2, 3), float(comm.rank))
    shard = mpidp.shard_from_arrays(comm, X, np.zeros(comm.rank + 1, np.int64), 6,
                                    sample_shape=(2, 3))
    all_ranks(comm, shard.sample_shape == (2, 3) and shard.n_total == comm.size * (comm.size + 1) // 2)
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.shard_from_arrays(
        comm, X, np.zeros(comm.rank + 1, np.int64), sample_shape=(3, 2)),
        "X's samples have shape (2, 3) but the model expects (3, 2)")
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.shard_from_arrays(
        comm, X, np.zeros(comm.rank + 1, np.int64), 5), "X has 6 features but the model expects 5")


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_on_the_sample_shape_are_named(comm):
    last = comm.size - 1
    y = np.zeros(2, np.int64)
    X = np.ones((2, 3, 2) if comm.rank == last else (2, 2, 3))
    others = ", ".join(map(str, range(last)))
    plural = "s" if last > 1 else ""
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.shard_from_arrays(comm, X, y),
                      f"ranks disagree on the sample shape: (2, 3) on rank{plural} {others}; "
                      f"(3, 2) on rank {last}")
    X = np.ones((2, 6) if comm.rank == last else (2, 2, 3))
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.shard_from_arrays(comm, X, y),
                      f"(6,) on rank {last}")
    X = np.ones((2, 7) if comm.rank == last else (2, 2, 3))
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.shard_from_arrays(comm, X, y),
                      "ranks disagree on the number of features per sample")
    X = np.ones(2) if comm.rank == last else np.ones((2, 2, 3))
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.shard_from_arrays(comm, X, y),
                      "X must be (n_samples, *sample_shape) with at least 2 dimensions")


@pytest.mark.mpi(min_size=1)
def test_image_rows_move_between_ranks_with_their_shape(comm):
    from mpidp.data.balance import redistribute
    n = 29
    X = np.arange(n * 12, dtype=np.float64).reshape(n, 1, 3, 4)
    y = np.arange(n) % 3
    data = mpidp.shard_from_arrays(comm, *(a[np.array_split(np.arange(n), comm.size)[comm.rank]]
                                           for a in (X, y)))
    owner = assign("cyclic", n, comm.size)
    moved, _ = redistribute(comm, data, owner)
    mine = positions_of(owner, comm.rank)
    all_ranks(comm, moved.X.shape == (len(mine), 1, 3, 4) and np.array_equal(moved.X, X[mine])
              and np.array_equal(moved.y, y[mine]) and np.array_equal(moved.positions, mine))
