"""Partition strategies under MPI: exact training whatever the strategy, rows moved
correctly between ranks, per-batch cost balance, adaptive re-weighting, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import all_ranks, raises_everywhere

import mpidp
from mpidp import nn
from mpidp.data.balance import Partition, Plan, redistribute
from mpidp.data.distribute import Shard
from mpidp.data.partition import STRATEGIES, positions_of
from mpidp.data.sources import BowSource

RTOL, ATOL = 1e-9, 1e-11  # as in test_data_parallel.py: summation order only


def _costs(n):
    return np.random.default_rng(9).pareto(1.2, n) + 0.5


def _train(comm, strategy="block", distribute="scatter", epochs=2, n_samples=203,
           batch_size=24, spec="synthetic", adapt_every=None, shuffle=True):
    size = comm.size
    caps = np.arange(1.0, size + 1) if strategy == "weighted" else None
    costs = _costs(n_samples) if spec == "synthetic" and strategy in ("cost", "adaptive") else None
    data = mpidp.load(comm, spec, distribute=distribute, seed=3, dtype=np.float64,
                      n_samples=n_samples, n_features=7 if spec == "synthetic" else 50,
                      n_classes=3, partition=strategy, costs=costs, capacities=caps)
    if spec == "bow":
        net = nn.Sequential([nn.SparseDense(50, 8), nn.ReLU(), nn.Dense(8, 3)], 50, np.float64)
        loss = nn.SoftmaxCrossEntropy()
    else:
        net, loss = nn.build("mlp", data.n_features, data.n_outputs, (16, 8), np.float64, True)
    net.init_(np.random.default_rng(11))
    dp = mpidp.DataParallel(net, nn.make_optimizer("momentum", 0.05), loss, comm)
    part = Partition(strategy, data.costs, caps, adapt_every, seed=3)
    history = mpidp.fit(dp, data.train, epochs, batch_size, seed=5, test=data.test,
                        partition=part, shuffle=shuffle)
    return dp, history, data


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_every_strategy_trains_exactly_like_one_process(comm, strategy, distribute):
    dp, hist, _ = _train(comm, strategy, distribute, adapt_every=3 if strategy == "adaptive" else None)
    ref, ref_hist, _ = _train(MPI.COMM_SELF, "block")
    diff = float(np.max(np.abs(dp.model.params - ref.model.params)))
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL),
              f"{strategy}: max diff {diff:.3g}")
    all_ranks(comm, dp.in_sync(), "replicas differ")
    for h in hist:  # every sample exactly once per epoch, over the ranks
        b = h["balance"]
        all_ranks(comm, sum(r["samples"] for r in b["per_rank"]) == 162, str(b["per_rank"]))
        all_ranks(comm, b["steps"] == 7 and b["strategy"] == strategy)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("strategy", ["block", "cost", "adaptive"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_sparse_workload_is_exact_and_cost_balanced(comm, strategy, shuffle):
    dp, hist, data = _train(comm, strategy, "local", spec="bow", n_samples=150, batch_size=32,
                            shuffle=shuffle)
    ref, _, _ = _train(MPI.COMM_SELF, "block", "local", spec="bow", n_samples=150, batch_size=32,
                       shuffle=shuffle)
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL))
    total = data.costs.sum()
    for h in hist:
        per = h["balance"]["per_rank"]
        all_ranks(comm, abs(sum(r["cost"] for r in per) - total) < 1e-6 * total)
    if strategy == "cost" and comm.size > 1:
        # per batch: the spread of the ranks' costs is at most the batch's largest cost
        last = hist[-1]["balance"]["per_rank"]
        spread = max(r["cost"] for r in last) - min(r["cost"] for r in last)
        all_ranks(comm, spread <= 5 * data.costs.max(), f"epoch cost spread {spread}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sparse", [False, True])
def test_redistribute_moves_rows_to_their_new_owners(comm, sparse):
    n = 57
    src = BowSource(n, 30, seed=1)
    Xall, yall = src.read(np.arange(n))
    if not sparse:
        Xall = Xall.toarray()
    mine = positions_of(np.arange(n) % comm.size, comm.rank)
    shard = Shard(Xall[mine], yall[mine], int(mine[0]) if len(mine) else 0, n, mine)
    owner = np.random.default_rng(4).integers(0, comm.size, n)
    new, moved = redistribute(comm, shard, owner)
    want = positions_of(owner, comm.rank)
    Xw = Xall[want]
    same_X = (np.array_equal(new.X.toarray(), Xw.toarray()) if sparse else np.array_equal(new.X, Xw))
    all_ranks(comm, np.array_equal(new.positions, want) and same_X
              and np.array_equal(new.y, yall[want]))
    all_ranks(comm, moved == int(np.sum(owner != np.arange(n) % comm.size)))
    again, moved2 = redistribute(comm, new, owner)
    all_ranks(comm, again is new and moved2 == 0, "nothing to move must not copy")


@pytest.mark.mpi(min_size=2)
def test_adaptive_gives_a_slowed_rank_less_work(comm):
    data = mpidp.load(comm, "synthetic", distribute="local", n_samples=2048, n_features=64,
                      partition="adaptive", test_fraction=0.0, dtype=np.float64)
    net = nn.mlp(64, (256,), 10, dtype=np.float64).init_(0)
    dp = mpidp.DataParallel(net, nn.SGD(0.01), nn.SoftmaxCrossEntropy(), comm)
    slow = comm.size - 1
    # 8x and three epochs: a busy machine stretching the other ranks' steps for a while
    # cannot make the slowed rank look the fastest when the last epoch's shares are cut
    dp.timer.slowdown = 8.0 if comm.rank == slow else 1.0
    plan = Plan(comm, Partition("adaptive"), data.train.n_total, 256, 0)
    hist = mpidp.fit(dp, data.train, 3, 256, partition=plan)
    caps = np.array(hist[-1]["balance"]["capacities"])
    others = np.delete(caps, slow)
    all_ranks(comm, caps[slow] < 0.6 * others.min(), f"capacities {caps}")
    samples = [r["samples"] for r in hist[-1]["balance"]["per_rank"]]
    all_ranks(comm, samples[slow] < min(np.delete(samples, slow)), f"samples {samples}")


@pytest.mark.mpi(min_size=1)
def test_adapt_every_also_uses_the_last_window_of_each_epoch(comm):
    # 6 steps per epoch, re-measured every 2: after steps 2 and 4 and at the epoch's end
    data = mpidp.load(comm, "synthetic", distribute="local", n_samples=6 * 64, n_features=16,
                      partition="adaptive", test_fraction=0.0, dtype=np.float64)
    net = nn.mlp(16, (8,), 10, dtype=np.float64).init_(0)
    dp = mpidp.DataParallel(net, nn.SGD(0.01), nn.SoftmaxCrossEntropy(), comm)
    plan = Plan(comm, Partition("adaptive", adapt_every=2), data.train.n_total, 64, 0)
    hist = mpidp.fit(dp, data.train, 2, 64, partition=plan)
    all_ranks(comm, len(plan.history_caps) == 2 * 3, f"{len(plan.history_caps)} re-measurements")
    all_ranks(comm, hist[-1]["balance"]["capacities"] == plan.history_caps[-1])


BAD = {
    "unknown strategy": (dict(partition="zigzag"), "unknown partition strategy 'zigzag'"),
    "costs wrong length": (dict(partition="cost", costs=np.ones(7)), "costs must have 50 entries"),
    "negative costs": (dict(partition="cost", costs=-np.ones(50)), "costs must be >= 0"),
    "NaN costs": (dict(partition="cost", costs=np.full(50, np.nan)), "costs contain NaN"),
    "zero costs": (dict(partition="cost", costs=np.zeros(50)), "costs are all zero"),
    "capacities wrong length": (dict(partition="weighted", capacities=np.ones(99)),
                                "capacities must have"),
    "zero capacities": (dict(partition="weighted", capacities="zeros"), "capacities are all zero"),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_bad_partition_input_fails_on_every_rank(comm, case, distribute):
    kw, message = BAD[case]
    if isinstance(kw.get("capacities"), str):
        kw = {**kw, "capacities": np.zeros(comm.size)}
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.load(
        comm, "synthetic", n_samples=50, n_features=3, test_fraction=0.2,
        distribute=distribute, **kw), message)


@pytest.mark.mpi(min_size=2)
def test_adaptive_with_fewer_samples_than_ranks_fails_everywhere(comm):
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.load(
        comm, "synthetic", n_samples=comm.size - 1, n_features=3, test_fraction=0.0,
        partition="adaptive"), "needs at least one sample per rank")


@pytest.mark.mpi(min_size=1)
def test_plan_rejects_bad_costs_on_every_rank(comm):
    raises_everywhere(comm, mpidp.MpidpError, lambda: Plan(
        comm, Partition("cost", costs=np.ones(5)), 10, 4, 0), "costs must have 10 entries")
    raises_everywhere(comm, mpidp.MpidpError, lambda: Plan(
        comm, Partition("adaptive", adapt_every=0), 10, 4, 0), "adapt interval")


