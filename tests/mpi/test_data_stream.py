"""The streamed data path: ``scatterv_fill`` rounds, and ``mpidp.load`` reading block by
block (many blocks and rounds forced by tiny limits) against shards built with plain NumPy
from the file, for scattered rows (test split, cyclic and shuffled partitions) and casts."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi_helpers import all_ranks, file_map, raises_everywhere

import mpidp
from mpidp import comm as C
from mpidp.comm import collectives as Coll
from mpidp.data import rows as R
from mpidp.data.partition import assign, positions_of, train_test_split


@pytest.fixture
def tiny_limits(monkeypatch):
    monkeypatch.setattr(R, "BLOCK_BYTES", 64)  # a few rows per block
    monkeypatch.setattr(Coll, "ROUND_BYTES", 200)  # a few rows per rank per round


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("per_round", [None, 1, 2, 1000])
def test_scatterv_fill_gives_each_rank_its_rows(comm, per_round):
    counts = [(3 * r + 2) % 5 for r in range(comm.size)]  # uneven, zeros for some P
    root = comm.size - 1
    full = np.arange(sum(counts) * 6, dtype=np.float32).reshape(-1, 2, 3)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    asked = []

    def fill(rank, lo, dest):
        asked.append((rank, lo, len(dest)))
        dest[...] = full[displs[rank] + lo:displs[rank] + lo + len(dest)]

    got = C.scatterv_fill(comm, counts, (2, 3), np.dtype(np.float32),
                          fill if comm.rank == root else None, root, per_round)
    mine = full[displs[comm.rank]:displs[comm.rank] + counts[comm.rank]]
    all_ranks(comm, got.shape == mine.shape and np.array_equal(got, mine))
    covered = sorted((r, lo + i) for r, lo, m in asked for i in range(m))
    expected = sorted((r, i) for r in range(comm.size) for i in range(counts[r]))
    all_ranks(comm, comm.rank != root or covered == expected)  # every row asked for once


def _reference(X, y, test_fraction, seed, strategy, size, rank, dtype):
    train, test = train_test_split(len(X), test_fraction, seed)
    owner = assign(strategy, len(train), size, seed=seed)
    pos = positions_of(owner, rank)
    test_pos = np.array_split(np.arange(len(test)), size)[rank]  # test rows: blocks
    return ((X[train[pos]].astype(dtype), y[train[pos]], pos),
            (X[test[test_pos]].astype(dtype), y[test[test_pos]], test_pos))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fmt", ["folder", "h5", "h5-chunked", "h5-big-endian"])
@pytest.mark.parametrize("strategy", ["block", "cyclic", "shuffled"])
@pytest.mark.parametrize("distribute", ["scatter", "local"])
@pytest.mark.parametrize("file_dtype", [np.float64, np.float32])  # cast on load, or not
def test_streamed_shards_match_numpy(comm, shared_tmp, tiny_limits, fmt, strategy, distribute,
                                     file_dtype):
    rng = np.random.default_rng(3)
    X, y = rng.standard_normal((83, 5)).astype(file_dtype), rng.integers(0, 4, 83)
    path = os.path.join(shared_tmp, "d")
    if comm.rank == 0:
        if fmt == "folder":
            os.makedirs(path)
            np.save(os.path.join(path, "X.npy"), X)
            np.save(os.path.join(path, "y.npy"), y)
        else:  # contiguous: read by byte offset; chunked or big-endian: through h5py
            h5py = pytest.importorskip("h5py")
            with h5py.File(path + ".h5", "w") as f:
                kw = {"chunks": (7, 5), "compression": "gzip"} if fmt == "h5-chunked" else {}
                f.create_dataset("X", data=X.astype(X.dtype.newbyteorder(">"))
                                 if fmt == "h5-big-endian" else X, **kw)
                f["y"] = y
    comm.Barrier()
    path += ".h5" if fmt != "folder" else ""
    data = mpidp.load(comm, path, distribute=distribute, test_fraction=0.3, seed=2,
                      dtype=np.float32, partition=strategy)
    refs = _reference(X, y, 0.3, 2, strategy, comm.size, comm.rank, np.float32)
    for shard, (Xr, yr, pos) in zip((data.train, data.test), refs):
        all_ranks(comm, shard.X.dtype == np.float32 and shard.y.dtype == np.int64
                  and np.array_equal(shard.X, Xr) and np.array_equal(shard.y, yr)
                  and np.array_equal(shard.positions, pos), f"{strategy} {distribute}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_first_nan_named_across_blocks_and_huge_finite_values_pass(comm, shared_tmp,
                                                                    tiny_limits, distribute):
    X = np.ones((60, 3), np.float32)
    X[7, 0] = 3e38  # finite, but its square overflows: the quick check defers to the full one
    path = os.path.join(shared_tmp, "v")
    if comm.rank == 0:
        os.makedirs(path)
        np.save(os.path.join(path, "y.npy"), np.zeros(60, np.int64))
        np.save(os.path.join(path, "X.npy"), X)
    comm.Barrier()
    data = mpidp.load(comm, path, distribute=distribute, test_fraction=0.0)
    all_ranks(comm, sum(comm.allgather(len(data.train.X))) == 60)
    if comm.rank == 0:
        X[[41, 52], 1] = [np.inf, np.nan]
        np.save(os.path.join(path, "X.npy"), X)
    comm.Barrier()
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.load(  # local: rows mapped
        comm, path, distribute=distribute, test_fraction=0.0), "NaN or Inf (first at row 41)")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("fmt", ["folder", "npz", "h5", "h5-chunked", "float64 file"])
@pytest.mark.parametrize("test_fraction", [0.0, 0.3])
def test_local_reads_map_one_run_of_rows_and_copy_the_rest(comm, shared_tmp, fmt,
                                                          test_fraction):
    """One run of float32 rows stored as plain, aligned bytes is mapped, not copied;
    scattered rows, chunked HDF5, a cast and unaligned ``.npz`` members are copied. Both
    give the rows of the file exactly, and writes to a mapped shard stay in that rank's
    memory."""
    h5py = pytest.importorskip("h5py") if fmt.startswith("h5") else None  # on every rank
    rng = np.random.default_rng(4)
    X = rng.standard_normal((97, 6)).astype(np.float64 if fmt == "float64 file" else np.float32)
    y = rng.integers(0, 3, 97)
    path = os.path.join(shared_tmp, "m") + {"npz": ".npz", "h5": ".h5", "h5-chunked": ".h5"}.get(
        fmt, "")
    if comm.rank == 0:
        if fmt == "npz":
            np.savez(path, X=X, y=y)  # stored members: plain bytes at an offset
        elif h5py is not None:
            with h5py.File(path, "w") as f:
                f.create_dataset("X", data=X, chunks=(8, 6) if fmt == "h5-chunked" else None)
                f["y"] = y
        else:
            os.makedirs(path)
            np.save(os.path.join(path, "X.npy"), X)
            np.save(os.path.join(path, "y.npy"), y)
    comm.Barrier()
    data = mpidp.load(comm, path, distribute="local", test_fraction=test_fraction, seed=5)
    refs = _reference(X, y, test_fraction, 5, "block", comm.size, comm.rank, np.float32)
    exact = all(np.array_equal(s.X, Xr) and np.array_equal(s.y, yr)
                and s.X.dtype == np.float32 for s, (Xr, yr, _) in zip((data.train, data.test), refs))
    all_ranks(comm, exact, f"{fmt}: rows differ from the file's")
    maps = test_fraction == 0 and fmt in ("folder", "h5")  # np.savez leaves X unaligned
    train = data.train.X
    all_ranks(comm, len(train) == 0 or (file_map(train) is not None) == maps,
              f"{fmt}, test fraction {test_fraction}: mapped is not {maps}")
    all_ranks(comm, train.flags.writeable)
    train[:] = -1.0  # copy-on-write: neither the file nor another rank sees it
    comm.Barrier()
    again = mpidp.load(comm, path, distribute="local", test_fraction=test_fraction, seed=5,
                       copy=True)
    all_ranks(comm, np.array_equal(again.train.X, refs[0][0])
              and file_map(again.train.X) is None, "a write reached the file")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n_rows", [2, 61])  # 2: some ranks hold no rows at P = 3, 4
@pytest.mark.parametrize("can_map", [True, False])
def test_rows_a_file_system_cannot_map_are_read(comm, shared_tmp, monkeypatch, n_rows,
                                                can_map):
    def no_map(*args):
        raise OSError("this file system cannot map files")

    if not can_map:
        monkeypatch.setattr(R, "map_rows", no_map)
    X = np.arange(n_rows * 3, dtype=np.float32).reshape(n_rows, 3)
    path = os.path.join(shared_tmp, "r")
    if comm.rank == 0:
        os.makedirs(path)
        np.save(os.path.join(path, "X.npy"), X)
        np.save(os.path.join(path, "y.npy"), np.zeros(n_rows, np.int64))
    comm.Barrier()
    data = mpidp.load(comm, path, distribute="local", test_fraction=0.0)
    (Xr, _, _), _ = _reference(X, np.zeros(n_rows, np.int64), 0.0, 0, "block", comm.size,
                               comm.rank, np.float32)
    mapped = file_map(data.train.X) is not None
    all_ranks(comm, np.array_equal(data.train.X, Xr) and data.train.X.shape == (len(Xr), 3)
              and mapped == (can_map and len(Xr) > 0), f"mapped {mapped}")


def test_hdf5_bytes_found_only_for_contiguous_datasets(tmp_path):
    h5py = pytest.importorskip("h5py")
    X = np.arange(40, dtype=np.float32).reshape(10, 4)
    with h5py.File(tmp_path / "a.h5", "w") as f:
        f["plain"] = X
        f.create_dataset("chunked", data=X, chunks=(5, 4))
        f.create_dataset("empty", shape=(10, 4), dtype=np.float32)  # never written
    with h5py.File(tmp_path / "a.h5", "r") as f:
        path, offset = R.hdf5_bytes(f["plain"])
        raw = np.fromfile(path, np.float32, count=40, offset=offset)
        assert np.array_equal(raw.reshape(10, 4), X)
        assert R.hdf5_bytes(f["chunked"]) == (None, 0)
        assert R.hdf5_bytes(f["empty"]) == (None, 0)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("member,where", [("X.npy", 0.0), ("X.npy", 0.5), ("X.npy", 0.999),
                                          ("y.npy", 0.7), (None, 0.0)])
def test_local_loads_check_an_npz_checksum_together(comm, shared_tmp, member, where):
    """Each rank checks a share of every member: a flipped byte anywhere (in any rank's
    share) is found, the same error on every rank; an intact file loads."""
    import zipfile
    rng = np.random.default_rng(5)
    X, y = rng.standard_normal((97, 6)), rng.integers(0, 3, 97)
    path = os.path.join(shared_tmp, f"c-{member}-{where}.npz")
    if comm.rank == 0:
        np.savez(path, X=X, y=y)
        if member is not None:
            with zipfile.ZipFile(path) as zf, open(path, "r+b") as f:
                info = zf.getinfo(member)
                f.seek(info.header_offset + 26)
                skip = int.from_bytes(f.read(2), "little") + int.from_bytes(f.read(2), "little")
                at = info.header_offset + 30 + skip + int(where * (info.compress_size - 1))
                f.seek(at)
                byte = f.read(1)[0]
                f.seek(at)
                f.write(bytes([byte ^ 0x10]))
    comm.Barrier()
    if member is None:
        data = mpidp.load(comm, path, distribute="local", test_fraction=0.0, dtype=np.float64)
        got = np.concatenate(comm.allgather(data.train.X))
        all_ranks(comm, np.array_equal(got, X))
    else:
        raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.load(
            comm, path, distribute="local", test_fraction=0.0), f"member {member} fails its "
            "CRC-32 check")
        if member == "X.npy" and where > 0.5:  # a flipped value, not the header: loads
            data = mpidp.load(comm, path, distribute="local", test_fraction=0.0,
                              dtype=np.float64, verify=False)  # when asked not to check
            got = np.concatenate(comm.allgather(data.train.X))
            all_ranks(comm, got.shape == X.shape and not np.array_equal(got, X))
