"""The data a checkpoint was trained on is fingerprinted by every byte (ranks share the
reading), so resuming on changed data is refused however small the change."""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from mpi_helpers import all_ranks

from mpidp.cli import settings
from mpidp.data.distribute import data_fingerprint


@pytest.fixture
def folder(comm, tmp_path_factory):
    path = comm.bcast(str(tmp_path_factory.mktemp("fp")) if comm.rank == 0 else None)
    if comm.rank == 0:
        rng = np.random.default_rng(0)
        np.save(os.path.join(path, "X.npy"), rng.standard_normal((200_000, 4)))  # 6.4 MB
        np.save(os.path.join(path, "y.npy"), rng.integers(0, 3, 200_000))
    comm.Barrier()
    return path


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("together", [True, False])
def test_every_byte_counts_and_every_rank_agrees(comm, folder, together):
    first = data_fingerprint(comm, folder, together)
    assert [f["name"] for f in first["files"]] == ["X.npy", "y.npy"]
    with open(os.path.join(folder, "X.npy"), "rb") as f:
        whole = zlib.crc32(f.read())
    all_ranks(comm, first["files"][0]["crc32"] == whole, f"{first}")
    all_ranks(comm, len(set(map(repr, comm.allgather(first)))) == 1)
    comm.Barrier()
    if comm.rank == 0:  # 8 KB overwritten in the middle, the size unchanged
        with open(os.path.join(folder, "X.npy"), "r+b") as f:
            f.seek(3_000_001)
            f.write(b"\x01" * 8192)
    comm.Barrier()
    changed = data_fingerprint(comm, folder, together)
    _, refusal = settings.compare_resume({"data_fingerprint": first, "dataset": folder},
                                   {"data_fingerprint": changed, "dataset": folder}, path="P")
    all_ranks(comm, refusal is not None and "X.npy has the same size but different contents"
              in refusal, f"{refusal}")


@pytest.mark.mpi(min_size=1)
def test_an_h5_file_is_fingerprinted_whole(comm, tmp_path_factory):
    h5py = pytest.importorskip("h5py")
    path = comm.bcast(str(tmp_path_factory.mktemp("h5") / "d.h5") if comm.rank == 0 else None)
    if comm.rank == 0:
        with h5py.File(path, "w") as f:
            f["X"], f["y"] = np.ones((5000, 8)), np.zeros(5000, np.int64)
    comm.Barrier()
    first = data_fingerprint(comm, path, True)
    comm.Barrier()
    if comm.rank == 0:
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.seek(size // 2)
            f.write(b"\x07" * 16)
    comm.Barrier()
    all_ranks(comm, data_fingerprint(comm, path, True) != first)
