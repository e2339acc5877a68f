"""Buffers beyond one MPI call's count limit go in pieces. CI lowers the limit
(``mpidp.comm.MAX_COUNT``) so the chunked paths run on small arrays."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_helpers import all_ranks

import mpidp
from mpidp import comm as C
from mpidp import nn
from mpidp.comm import collectives as Coll
from mpidp.data.partition import block_counts


@pytest.fixture
def small_limit(monkeypatch):
    monkeypatch.setattr(C, "MAX_COUNT", 7)
    monkeypatch.setattr(Coll, "MAX_COUNT", 7)  # where the chunking reads it
    return 7


@pytest.mark.mpi(min_size=1)
def test_pieces_cover_exactly(small_limit):
    for n in (0, 1, 6, 7, 8, 50):
        buf = np.arange(n, dtype=np.float64)
        pieces = Coll._pieces(buf)
        assert np.array_equal(np.concatenate(pieces), buf)
        assert all(0 < p.size <= 7 for p in pieces if n)


@pytest.mark.mpi(min_size=1)
def test_chunked_bcast_and_allreduce(comm, small_limit):
    buf = np.arange(50, dtype=np.float64) * (comm.rank + 1)
    C.allreduce_sum_(comm, buf)
    factor = comm.size * (comm.size + 1) / 2
    all_ranks(comm, np.array_equal(buf, np.arange(50) * factor))
    b = np.arange(23, dtype=np.int64) if comm.rank == 0 else np.zeros(23, np.int64)
    C.bcast_(comm, b)
    all_ranks(comm, np.array_equal(b, np.arange(23)))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n", [0, 3, 41])
def test_scatterv_in_rounds(comm, small_limit, n):
    full = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    got = C.scatterv_rows(comm, full if comm.rank == 0 else None, block_counts(n, comm.size),
                          (2,), np.float32)
    all_ranks(comm, np.array_equal(got, np.array_split(full, comm.size)[comm.rank]))
    got = C.scatterv_rows(comm, full if comm.rank == 0 else None, block_counts(n, comm.size),
                          (2,), np.float32, rows_per_round=1)
    all_ranks(comm, np.array_equal(got, np.array_split(full, comm.size)[comm.rank]))


@pytest.mark.mpi(min_size=1)
def test_training_with_chunked_collectives_is_unchanged(comm, monkeypatch):
    def run():
        data = mpidp.load(comm, "synthetic", n_samples=120, n_features=5, n_classes=3,
                          dtype=np.float64, seed=1)
        model = nn.mlp(5, (6,), 3, dtype=np.float64).init_(2)
        dp = mpidp.DataParallel(model, nn.SGD(0.1, momentum=0.9), nn.SoftmaxCrossEntropy(), comm)
        mpidp.fit(dp, data.train, 2, 16, seed=3)
        return model.params.copy()

    whole = run()
    monkeypatch.setattr(C, "MAX_COUNT", 5)  # every collective, the data scatter too, in pieces
    chunked = run()
    all_ranks(comm, np.array_equal(whole, chunked))
