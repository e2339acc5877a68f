"""Data-parallel map/reduce: every strategy and the dynamic mode give the single-process
answer; per-sample outputs land in one .npy in the original order; errors on every rank."""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi_helpers import all_ranks, raises_everywhere

import mpidp
from mpidp.data.partition import STRATEGIES
from mpidp.data.sources import BowSource
from mpidp.parallel import mapreduce
from mpidp.parallel.mapreduce import map_reduce

X = np.random.default_rng(5).standard_normal((101, 3))  # prime n


def fn(rows):
    return np.stack([rows.sum(axis=1), rows[:, 0] ** 2], axis=1)  # (m, 2)


MODES = [dict(partition=s) for s in STRATEGIES if s != "adaptive"] + [dict(dynamic=True)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", MODES, ids=lambda m: str(list(m.values())[0]))
@pytest.mark.parametrize("chunk", [1, 7, 1000])
def test_reductions_equal_numpy(comm, mode, chunk):
    full = fn(X)
    costs = np.arange(1.0, 102.0) if mode.get("partition") == "cost" else None
    caps = np.arange(1.0, comm.size + 1) if mode.get("partition") == "weighted" else None
    kw = dict(costs=costs, capacities=caps, chunk_size=chunk, **mode)
    want = {"sum": full.sum(0), "mean": full.mean(0), "min": full.min(0), "max": full.max(0)}
    for reduce, expected in want.items():
        got = map_reduce(comm, fn, X, reduce, **kw).value
        all_ranks(comm, np.allclose(got, expected, rtol=1e-12), f"{reduce}: {got} vs {expected}")
    res = map_reduce(comm, fn, X, "concat", **kw)
    if comm.rank == 0:
        all_ranks(comm, np.array_equal(res.value, full), "concat order")
    else:
        all_ranks(comm, res.value is None)
    all_ranks(comm, sum(r["samples"] for r in res.per_rank) == 101)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dynamic", [False, True])
def test_outputs_written_by_every_rank_into_one_npy(comm, shared_tmp, dynamic):
    src = BowSource(300, 40, seed=3)
    out = os.path.join(shared_tmp, "pred", "lengths.npy")
    res = map_reduce(comm, lambda R: R.row_lengths()[:, None] * np.ones((1, 2)), src, "concat",
                     dynamic=dynamic, chunk_size=16, out=out, partition="cyclic")
    left = [f for f in os.listdir(os.path.dirname(out)) if f.endswith(".part.npy")]
    all_ranks(comm, res.value is None and not left, f"left behind: {left}")
    got = np.load(out)
    all_ranks(comm, np.array_equal(got[:, 0], src.lengths) and got.shape == (300, 2))
    all_ranks(comm, sum(r["samples"] for r in res.per_rank) == 300, str(res.per_rank))
    if comm.size > 1 and not dynamic:  # cyclic rows: every rank wrote some (chunks handed
        # out on demand may all go to the ranks that start first on a busy machine)
        all_ranks(comm, all(r["samples"] > 0 for r in res.per_rank), str(res.per_rank))


@pytest.mark.mpi(min_size=1)
def test_bad_map_reduce_input_fails_everywhere(comm):
    raises_everywhere(comm, mpidp.MpidpError, lambda: map_reduce(comm, fn, X, "median"),
                      "unknown reduction 'median'")
    raises_everywhere(comm, mpidp.MpidpError, lambda: map_reduce(
        comm, fn, X, partition="zigzag"), "unknown partition strategy")
    raises_everywhere(comm, mpidp.MpidpError, lambda: map_reduce(
        comm, fn, X, partition="cost", costs=np.ones(5)), "costs must have 101 entries")
    raises_everywhere(comm, mpidp.MpidpError, lambda: map_reduce(
        comm, lambda r: r.sum(), X), "one output row per input row")
    # fn fails on one rank's rows only (row 100 is the last rank's): all ranks raise
    def picky(rows):
        if (rows == X[100]).all(axis=1).any():
            raise RuntimeError("bad row 100")
        return fn(rows)
    raises_everywhere(comm, mpidp.MpidpError, lambda: map_reduce(comm, picky, X, chunk_size=5),
                      "bad row 100")


@pytest.mark.mpi(min_size=1)
def test_a_failed_write_leaves_neither_the_output_nor_its_part_file(comm, shared_tmp):
    src = BowSource(64, 20, seed=4)
    out = os.path.join(shared_tmp, "fail", "out.npy")

    def fn(R):
        if comm.rank == comm.size - 1 and R.shape[0] > 1:  # a chunk, not the probe's row
            raise RuntimeError("this rank's function fails")
        return R.row_lengths()[:, None] * np.ones((1, 2))
    with pytest.raises(mpidp.MpidpError, match="this rank's function fails"):
        map_reduce(comm, fn, src, "concat", chunk_size=8, out=out)
    comm.Barrier()
    all_ranks(comm, os.listdir(os.path.dirname(out)) == [], str(os.listdir(os.path.dirname(out))))


@pytest.mark.mpi(min_size=1)
def test_two_jobs_writing_one_output_get_part_files_of_their_own(comm, shared_tmp):
    out = os.path.join(shared_tmp, f"p{comm.rank}.npy")
    a, b = (mapreduce._create_npy(out, "float32", (3, 2)) for _ in range(2))
    all_ranks(comm, a != b and np.load(a).shape == np.load(b).shape == (3, 2)
              and not os.path.exists(out), f"{a} {b}")
    os.unlink(a)
    os.unlink(b)
