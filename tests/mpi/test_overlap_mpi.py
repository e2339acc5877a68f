"""Overlapped gradient sums (``--sync overlapped``) under MPI: the single-process arithmetic
with several buckets and uneven shards, identical replicas, sums that complete while
backward is still running, and no communication thread left between steps."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import all_ranks

import mpidp
from mpidp import comm as C
from mpidp import nn
from mpidp.comm import collectives as Coll
from mpidp.nn.layers import Layer
from mpidp.parallel.overlap import Overlapped

RTOL, ATOL = 1e-10, 1e-12  # float64; only the order of additions differs
PROGRESS = ["thread", "test"]


def _uneven(comm, n=157, seed=0):
    """This rank's block of ``n`` rows: rank ``r`` gets a share growing with ``r``; with 3
    ranks or more, rank 1 gets none. Returns the shard and all the rows."""
    rng = np.random.default_rng(seed)
    X, y = rng.standard_normal((n, 6)), rng.integers(0, 3, n)
    weights = np.arange(1, comm.size + 1, dtype=float)
    if comm.size >= 3:
        weights[1] = 0
    cuts = np.concatenate([[0], np.round(np.cumsum(weights) / weights.sum() * n)]).astype(int)
    rows = np.arange(cuts[comm.rank], cuts[comm.rank + 1])
    return mpidp.shard_from_arrays(comm, X[rows], y[rows]), X, y


def _model(first=None):
    layers = ([first] if first is not None else []) + nn.presets.mlp_layers(6, (12, 8), 3)
    return nn.Sequential(layers, 6, np.float64).init_(4)


def _train(comm, shard, sync, epochs=2, first=None, **kw):
    dp = mpidp.DataParallel(_model(first), nn.SGD(0.1, momentum=0.9), nn.SoftmaxCrossEntropy(),
                            comm, sync=sync)
    hist = mpidp.fit(dp, shard, epochs, 16, seed=2, **kw)
    return dp, hist


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("progress", PROGRESS)
def test_equals_one_process_and_fused_allreduce(comm, progress):
    shard, X, y = _uneven(comm)
    sync = Overlapped(bucket_bytes=200, progress=progress)
    dp, hist = _train(comm, shard, sync)
    all_ranks(comm, len(sync.buckets) == 3, f"buckets {sync.buckets}")
    fused, fused_hist = _train(comm, shard, "allreduce")
    one, one_hist = _train(MPI.COMM_SELF, mpidp.shard_from_arrays(MPI.COMM_SELF, X, y), "allreduce")
    p = dp.model.params
    all_ranks(comm, np.allclose(p, one.model.params, rtol=RTOL, atol=ATOL),
              f"vs one process: max diff {np.abs(p - one.model.params).max():.3g}")
    all_ranks(comm, np.allclose(p, fused.model.params, rtol=RTOL, atol=ATOL),
              f"vs fused allreduce: max diff {np.abs(p - fused.model.params).max():.3g}")
    all_ranks(comm, abs(hist[-1]["loss"] - one_hist[-1]["loss"]) < 1e-10)
    all_ranks(comm, dp.in_sync(), "replicas differ")  # bit-identical parameters
    all_ranks(comm, sync.bytes_sent == fused.sync.bytes_sent, "not one buffer per step")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("bucket_bytes", [1, 500, 1 << 20])
def test_any_bucket_size_sums_every_element_once(comm, bucket_bytes):
    shard, _, _ = _uneven(comm, seed=1)
    sync = Overlapped(bucket_bytes=bucket_bytes)
    dp, _ = _train(comm, shard, sync, epochs=1)
    fused, _ = _train(comm, shard, "allreduce", epochs=1)
    covered = sorted((lo, hi) for _, lo, hi in sync.buckets)
    tiles = all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    all_ranks(comm, tiles and covered[0][0] == 0 and covered[-1][1] == sync.buf.size, f"{covered}")
    all_ranks(comm, np.allclose(dp.model.params, fused.model.params, rtol=RTOL, atol=ATOL))
    all_ranks(comm, dp.in_sync())


@pytest.mark.mpi(min_size=1)
def test_buckets_beyond_one_calls_count_go_in_pieces(comm, monkeypatch):
    monkeypatch.setattr(Coll, "MAX_COUNT", 7)  # where the pieces are cut
    shard, _, _ = _uneven(comm, seed=2)
    dp, _ = _train(comm, shard, Overlapped(bucket_bytes=200, progress="thread"), epochs=1)
    monkeypatch.undo()
    fused, _ = _train(comm, shard, "allreduce", epochs=1)
    all_ranks(comm, np.allclose(dp.model.params, fused.model.params, rtol=RTOL, atol=ATOL))


class _Gate(Layer):
    """A model's first layer (so its backward runs last): the identity, whose backward
    waits until ``ready()`` holds (or a deadline passes) and records whether it did."""

    def __init__(self) -> None:
        super().__init__()
        self.ready, self.seen = (lambda: True), []

    def forward(self, x):
        return x

    def backward(self, dy, accumulate=False, need_input_grad=True):
        deadline = time.monotonic() + 30  # a guard against a hang, not a speed assertion
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.001)  # no MPI call in here: only a thread can move the sums
        self.seen.append(self.ready())
        return dy if need_input_grad else None


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("progress", PROGRESS)
def test_buckets_are_summed_while_backward_still_runs(comm, progress):
    """Inside backward's last layer every bucket is summed already, on every rank. With
    the thread this layer makes no MPI call (``reduced`` reads counters): the sums moved
    on the communication thread during the computation. With ``test``, asking
    ``reduced`` tests the requests, which were started by the hooks of earlier layers."""
    shard, _, _ = _uneven(comm)
    gate = _Gate()
    sync = Overlapped(bucket_bytes=200, progress=progress)
    gate.ready = lambda: sync.reduced == sync.launched == len(sync.buckets)
    _train(comm, shard, sync, epochs=1, first=gate)
    all_ranks(comm, len(sync.buckets) == 3 and gate.seen and all(gate.seen),
              f"summed before backward ended in {sum(gate.seen)} of {len(gate.seen)} steps")


@pytest.mark.mpi(min_size=1)
def test_no_thread_outlives_a_step_and_every_step_ends_at_a_boundary(comm):
    shard, _, _ = _uneven(comm)
    sync = Overlapped(bucket_bytes=200, progress="thread")
    between: list[bool] = []

    def on_step(*_):
        alive = [t for t in threading.enumerate() if t.name == "mpidp-overlapped"]
        between.append(not alive and sync.at_boundary() and sync.reducer.pending == 0)

    dp, _ = _train(comm, shard, sync, epochs=1, on_step=on_step)
    all_ranks(comm, between and all(between), f"{between}")
    # 3 buckets; with 2+ ranks the two larger Dense layers' buckets go in 2 and 3 parts
    sums = 3 if comm.size == 1 else 6
    all_ranks(comm, len(between) == dp.global_step and sync.reducer.completed == sums * len(between),
              f"{sync.reducer.completed} sums in {len(between)} steps")
    sync.close()
    sync.close()  # idempotent
    all_ranks(comm, sync.reducer is None)


@pytest.mark.mpi(min_size=1)
def test_thread_failure_is_raised_on_the_calling_thread(comm, monkeypatch):
    """Every rank's thread fails (the same on every rank, so no rank is left waiting):
    each rank raises the failure from its wait, and its submits after that raise too."""
    def broken(c, buf):
        raise RuntimeError("link down")
    monkeypatch.setattr("mpidp.comm.progress._sum_in_place", broken)
    r = C.BackgroundAllreduce(comm)
    r.submit(np.ones(3))
    errors = []
    for call in (r.wait, lambda: r.submit(np.ones(3))):
        try:
            call()
            errors.append(None)
        except C.MpidpError as e:
            errors.append(str(e))
    all_ranks(comm, all(e and "link down" in e for e in errors) and not r.running, f"{errors}")
    with pytest.raises(C.MpidpError, match="link down"):
        r.close()  # raises again, and frees the communicator all the same
    with pytest.raises(C.MpidpError, match="closed"):
        r.submit(np.ones(1))


@pytest.mark.mpi(min_size=1)
def test_background_sums_in_submission_order(comm):
    with C.BackgroundAllreduce(comm) as r:
        bufs = [np.full(n, comm.rank + 1.0) for n in (1, 5, 1000, 3)]
        for b in bufs:
            r.submit(b)
        r.wait()
        total = comm.size * (comm.size + 1) / 2
        all_ranks(comm, all(np.all(b == total) for b in bufs) and r.completed == 4
                  and r.pending == 0 and not r.running)
        r.wait()  # nothing pending: returns at once
    with pytest.raises(C.MpidpError, match="closed"):
        r.submit(np.ones(1))
