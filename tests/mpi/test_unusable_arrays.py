"""Arrays that cannot be trained on as they are (complex numbers, objects) are refused by
``shard_from_arrays`` with the same error on every rank, also when one rank alone holds
them: never accepted silently, and never one rank raising while the others wait."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_helpers import all_ranks, raises_everywhere

import mpidp


def _on(comm, which: str) -> bool:
    """Whether this rank holds the bad array: every rank, or only the last one."""
    return which == "every rank" or comm.rank == comm.size - 1


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("which", ["every rank", "one rank"])
def test_complex_X_is_refused_on_every_rank(comm, which):
    X = np.ones((3, 4)) + (1j if _on(comm, which) else 0)
    err = raises_everywhere(comm, mpidp.MpidpError,
                            lambda: mpidp.shard_from_arrays(comm, X, np.zeros(3, np.int64)),
                            "X is complex (complex128) but mpidp trains on real numbers")
    messages = comm.allgather(str(err))
    all_ranks(comm, len(set(messages)) == 1, f"the ranks say different things: {messages}")


@pytest.mark.mpi(min_size=1)
def test_complex_y_is_refused_on_every_rank(comm):
    y = np.zeros(3) + (1j if _on(comm, "one rank") else 0)
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: mpidp.shard_from_arrays(comm, np.ones((3, 4)), y), "y is complex")


@pytest.mark.mpi(min_size=1)
def test_an_object_array_on_one_rank_is_refused_on_every_rank(comm):
    X = np.ones((3, 4), dtype=object if _on(comm, "one rank") else np.float64)
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: mpidp.shard_from_arrays(comm, X, np.zeros(3, np.int64)),
                      "X must be an array of numbers, got dtype object")


@pytest.mark.mpi(min_size=1)
def test_real_arrays_are_still_accepted(comm):
    for X in (np.ones((2, 3), np.float32), np.ones((2, 3), np.int16), np.ones((2, 3), bool)):
        shard = mpidp.shard_from_arrays(comm, X, np.zeros(2, np.int64))
        all_ranks(comm, shard.n_total == 2 * comm.size and shard.X.dtype == X.dtype)
