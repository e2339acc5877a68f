"""Node-aware allreduce (shared memory inside a node, leaders across nodes): the one-process
model in float64, identical replicas, chosen only where it takes bytes off the network.

One host has one node; ``MPIDP_RANKS_PER_NODE=k`` makes each block of ``k`` ranks a node
(they still share memory), so the several-node path runs here too. Across real test hosts,
tests/test_multihost.py runs it."""

from __future__ import annotations

import os
from contextlib import contextmanager

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import all_ranks, raises_everywhere

import mpidp
from mpidp import comm as C
from mpidp import nn
from mpidp.comm.runtime import RANKS_PER_NODE
from mpidp.parallel.modes import make_sync

RTOL, ATOL = 1e-9, 1e-11


@contextmanager
def ranks_per_node(k):
    old = os.environ.get(RANKS_PER_NODE)
    if k is None:
        os.environ.pop(RANKS_PER_NODE, None)
    else:
        os.environ[RANKS_PER_NODE] = str(k)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(RANKS_PER_NODE, None)
        else:
            os.environ[RANKS_PER_NODE] = old


def _data(comm, n=130):
    rng = np.random.default_rng(1)
    X, y = rng.standard_normal((n, 5)), rng.integers(0, 3, n)
    # uneven shards, and from 3 ranks on one rank holds nothing
    cuts = np.linspace(0, n, comm.size + 1).astype(int)
    if comm.size >= 3:
        cuts[1] = 0
    rows = np.arange(cuts[comm.rank], cuts[comm.rank + 1]) if comm.rank else np.arange(cuts[1])
    return mpidp.shard_from_arrays(comm, X[rows], y[rows]), X, y


def _train(comm, shard, sync, epochs=2):
    model = nn.mlp(5, (9,), 3, dtype=np.float64).init_(3)
    dp = mpidp.DataParallel(model, nn.Adam(0.01), nn.SoftmaxCrossEntropy(), comm, sync=sync)
    return dp, mpidp.fit(dp, shard, epochs, 16, seed=4)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", ["allreduce", "accumulate"])
@pytest.mark.parametrize("per_node", [None, 1, 2])
def test_node_aware_matches_one_process(comm, name, per_node):
    shard, X, y = _data(comm)
    with ranks_per_node(per_node):
        sync = make_sync(name, node_aware=True, **({"k": 3} if name == "accumulate" else {}))
        dp, hist = _train(comm, shard, sync)
    ref, ref_hist = _train(MPI.COMM_SELF, mpidp.shard_from_arrays(MPI.COMM_SELF, X, y),
                           make_sync(name, **({"k": 3} if name == "accumulate" else {})))
    all_ranks(comm, comm.size == 1 or sync.hierarchy is not None, "node-aware path not taken")
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL),
              f"max diff {np.abs(dp.model.params - ref.model.params).max():.3g}")
    all_ranks(comm, dp.in_sync(), "replicas differ")
    all_ranks(comm, abs(hist[-1]["loss"] - ref_hist[-1]["loss"]) < 1e-9)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("per_node", [None, 1, 2])
def test_chosen_only_when_it_takes_bytes_off_the_network(comm, per_node):
    """Automatic: on when there are several nodes and some node holds several ranks."""
    shard, _, _ = _data(comm)
    with ranks_per_node(per_node):
        nodes, crowded = C.node_layout(comm)
        sync = make_sync("allreduce")
        _train(comm, shard, sync, epochs=1)
    k = per_node or comm.size
    expect_nodes = -(-comm.size // k)
    all_ranks(comm, (nodes, crowded) == (expect_nodes, min(k, comm.size)), f"{nodes, crowded}")
    want = expect_nodes > 1 and min(k, comm.size) > 1
    all_ranks(comm, (sync.hierarchy is not None) == want, f"hierarchy {sync.hierarchy}")


@pytest.mark.mpi(min_size=2)
def test_only_node_leaders_hand_bytes_to_mpi(comm):
    shard, _, _ = _data(comm)
    with ranks_per_node(2):
        sync = make_sync("allreduce", node_aware=True)
        dp, hist = _train(comm, shard, sync, epochs=1)
        node, leaders = C.node_split(comm)
    leads = node.rank == 0 and comm.size > 2
    expected = dp.global_step * dp.buf.nbytes if leads else 0
    all_ranks(comm, dp.global_step > 0 and sync.bytes_sent == expected,
              f"rank {comm.rank}: bytes {sync.bytes_sent}, expected {expected}")


@pytest.mark.mpi(min_size=1)
def test_node_aware_refused_where_it_cannot_apply(comm):
    raises_everywhere(comm, mpidp.MpidpError, lambda: make_sync("compressed", node_aware=True),
                      "node_aware True applies to --sync allreduce, accumulate or auto")
    for bad in ("two", "0", "-1", "\u00b2", "\u0662"):  # superscript two, Arabic-Indic two
        with ranks_per_node(bad):
            raises_everywhere(comm, mpidp.MpidpError, lambda: C.node_layout(comm),
                              f"{RANKS_PER_NODE} must be a whole number >= 1")


@pytest.mark.mpi(min_size=2)
def test_ranks_per_node_that_differs_between_ranks_is_refused_on_every_rank(comm):
    """Read apart, the ranks would split differently and wait in different collectives."""
    for mine, told in ((2 if comm.rank == 0 else None, "it is set on some only"),
                       (1 + (comm.rank == 0), "1 on some, 2 on others"),
                       ("x" if comm.rank == 1 else 2, "must be a whole number")):
        with ranks_per_node(mine):
            raises_everywhere(comm, mpidp.MpidpError, lambda: C.node_layout(comm), told)
            raises_everywhere(comm, mpidp.MpidpError, lambda: C.local_ranks(comm), told)


def test_a_long_wait_for_the_leader_is_slept_and_a_short_one_polled():
    from mpidp.comm.shm import LONGEST_SLEEP, _sleep_for
    assert _sleep_for(1e-4) == 0.0  # 2 us of sleep would cost more than it frees
    assert _sleep_for(0.01) == pytest.approx(2e-4)
    assert _sleep_for(10.0) == LONGEST_SLEEP


@pytest.mark.mpi(min_size=3)
def test_sums_stay_exact_when_ranks_sleep_while_their_leader_exchanges(comm):
    """The last node's leader is slow to join the leaders' exchange, so the other nodes'
    ranks wait long for their leader and sleep in their next waits (not poll): the sums
    are those of a plain barrier's."""
    import time

    from mpidp.comm.shm import NodeAllreduce
    with ranks_per_node(2):
        h = NodeAllreduce(comm, 1000, np.float64)
    last = (comm.size - 1) // 2  # nodes of 2 ranks: the last node's index
    slept = []
    for step in range(4):
        h.array[...] = np.arange(1000) * (comm.rank + 1) + step
        if comm.rank == 2 * last:
            time.sleep(0.1)
        got = h.allreduce()
        expect = np.arange(1000) * sum(range(1, comm.size + 1)) + comm.size * step
        all_ranks(comm, np.array_equal(got, expect), f"step {step}: wrong sums")
        slept.append(h._sleep[1])
    from mpidp.comm.shm import LONGEST_SLEEP
    waits_long = h.node.rank != 0 and comm.rank // 2 != last  # >= 0.1 s each step
    all_ranks(comm, not waits_long or slept[-1] == LONGEST_SLEEP, f"rank {comm.rank}: {slept}")


@pytest.mark.mpi(min_size=3)
def test_the_leaders_exchange_is_timed_apart_from_the_node(comm):
    """``exchange_s``: on a leader, the seconds of its exchange with the other leaders (here
    mostly a wait for the last node's leader, 0.2 s late, whose own is shorter than any of
    theirs); 0 on the other ranks."""
    import time

    from mpidp.comm.shm import NodeAllreduce
    with ranks_per_node(2):
        h = NodeAllreduce(comm, 1000, np.float64)
    try:
        late = 2 * ((comm.size - 1) // 2)  # the last node's leader
        h.array[...] = comm.rank
        comm.Barrier()
        if comm.rank == late:
            time.sleep(0.2)
        t = time.perf_counter()
        got = h.allreduce()
        took = time.perf_counter() - t
        waited = [x for r, x in enumerate(comm.allgather(h.exchange_s if h.leads else None))
                  if x is not None and r != late]
        if not h.leads:
            ok = h.exchange_s == 0.0
        elif comm.rank == late:  # the others were waiting for it: no wait of its own
            ok = 0 < h.exchange_s < min(waited)
        else:
            ok = 0.15 < h.exchange_s <= took
        all_ranks(comm, ok and np.array_equal(got, np.full(1000, sum(range(comm.size)))),
                  f"rank {comm.rank} (leads: {h.leads}): exchange {h.exchange_s:.3f} s of {took:.3f} s")
    finally:
        h.free()


class _CountingLeaders:
    """The leaders' communicator, counting its ``Barrier`` calls."""

    def __init__(self, comm):
        self.comm, self.barriers = comm, 0

    def Barrier(self):
        self.barriers += 1
        self.comm.Barrier()

    def __getattr__(self, name):
        return getattr(self.comm, name)


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("large", [False, True])
def test_leaders_meet_before_a_large_exchange_only(comm, large):
    """A buffer of MEET_BYTES or more: the leaders meet (one Barrier among them) before
    each exchange; a smaller one goes at once. The sums are exact either way."""
    from mpidp.comm.shm import MEET_BYTES, NodeAllreduce
    n = MEET_BYTES // 8 if large else MEET_BYTES // 8 - 1
    with ranks_per_node(2):
        h = NodeAllreduce(comm, n, np.float64)
    try:
        counting = h.leaders = _CountingLeaders(h.leaders) if h.leaders is not None else None
        for step in range(3):
            h.array[...] = np.arange(n) * (comm.rank + 1) + step
            got = h.allreduce()
            expect = np.arange(n) * sum(range(1, comm.size + 1)) + comm.size * step
            all_ranks(comm, np.array_equal(got, expect), f"step {step}: wrong sums")
        met = 0 if counting is None else counting.barriers
        all_ranks(comm, met == (3 if large and h.leads else 0),
                  f"rank {comm.rank} (leads: {h.leads}): {met} meetings in 3 exchanges")
    finally:
        h.leaders = getattr(h.leaders, "comm", h.leaders)
        h.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("sync, trainers", [(lambda: make_sync("allreduce", node_aware=True), 2100),
                                            (lambda: make_sync("ps"), 700)])
def test_trainers_built_again_and_again_and_closed_never_run_out_of_communicators(
        comm, sync, trainers):
    """A sweep's loop: each trainer's node communicators are shared, its shared-memory
    windows freed by ``close`` (MPICH has 2048 communicators; one leaked per trainer would
    run out), and its model keeps its values and stays usable. A leak does not depend on the
    number of ranks, and thousands of trainers take seconds: checked at 2 ranks only."""
    if comm.size != 2:
        pytest.skip("checked at 2 ranks (a leak does not depend on the number of ranks)")
    rng, ok = np.random.default_rng(comm.rank), True
    for _ in range(trainers):
        model = nn.mlp(6, (10,), 3, dtype=np.float64).init_(0)
        with mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                                sync=sync(), watchdog=0) as dp:
            dp.step(rng.standard_normal((4, 6)), rng.integers(0, 3, 4))
            params, grads = model.params.copy(), model.grads.copy()
        ok = ok and np.array_equal(model.params, params) and np.array_equal(model.grads, grads)
    model.forward(rng.standard_normal((2, 6)))
    all_ranks(comm, ok, f"rank {comm.rank}: a model changed when its trainer closed")
    raises_everywhere(comm, mpidp.MpidpError, lambda: dp.step(np.zeros((1, 6)), np.zeros(1, int)),
                      "closed")


@pytest.mark.mpi(min_size=2)
def test_node_splits_are_freed_with_their_communicator(comm):
    """Node-aware trainers built on communicators made and freed again and again do not
    use up the library's communicators (MPICH has about 2000; each split holds two). A leak
    does not depend on the number of ranks: checked at 2 ranks only."""
    if comm.size != 2:
        pytest.skip("checked at 2 ranks (a leak does not depend on the number of ranks)")
    kept = []
    for _ in range(1200):
        sub = comm.Dup()
        node, leaders = C.node_split(sub)
        kept.append(C.node_split(sub) == (node, leaders))
        sub.Free()
    all_ranks(comm, all(kept) and node == MPI.COMM_NULL
              and (leaders is None or leaders == MPI.COMM_NULL), "node split kept or made twice")
