"""Partition strategies (pure functions): guarantees checked over many n, P, costs and
capacities, including n = 0, n < P and prime n; the load-balance figures; no MPI."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mpidp.data import partition as Pt
from mpidp.data.balance import balance_figures
from mpidp.data.sources import BowSource
from mpidp.nn.sparse import CSR, SparseDense
from mpidp.observe.metrics import STEP_FIELDS

FAST = settings(max_examples=120, deadline=None)
sizes = st.integers(1, 9)
ns = st.one_of(st.integers(0, 300), st.sampled_from([0, 1, 2, 3, 97, 101, 257]))
weights = st.floats(0.0, 50.0, allow_nan=False)


def _check_owner(owner, n, size):
    assert owner.dtype == np.int64 and owner.shape == (n,)
    assert ((owner >= 0) & (owner < size)).all()  # every position exactly one owner


@FAST
@given(n=ns, size=sizes, seed=st.integers(0, 2**31))
def test_block_cyclic_shuffled_cover_every_sample_once_with_even_counts(n, size, seed):
    for strategy in ("block", "cyclic", "shuffled"):
        owner = Pt.assign(strategy, n, size, seed=seed)
        _check_owner(owner, n, size)
        counts = np.bincount(owner, minlength=size)
        assert counts.sum() == n and counts.max() - counts.min() <= 1
        if n < size:
            assert (counts <= 1).all()
    assert Pt.owner_cyclic(n, size).tolist() == [i % size for i in range(n)]
    np.testing.assert_array_equal(Pt.owner_block(n, size),
                                  np.repeat(np.arange(size), Pt.block_counts(n, size)))


def test_shuffled_is_seeded_and_world_size_independent():
    a, b = Pt.owner_shuffled(50, 2, 7), Pt.owner_shuffled(50, 5, 7)
    np.testing.assert_array_equal(a, Pt.owner_shuffled(50, 2, 7))
    assert not np.array_equal(a, Pt.owner_shuffled(50, 2, 8))
    # the same permutation cut in 2 or 5: sorting positions by (owner, rank order) agrees
    perm_2 = np.argsort(a, kind="stable")
    assert not np.array_equal(perm_2, np.arange(50))
    np.testing.assert_array_equal(np.sort(np.flatnonzero(b == 0)),
                                  np.sort(np.random.default_rng([7, 0x5AFF]).permutation(50)[:10]))


@FAST
@given(n=ns, caps=st.lists(weights, min_size=1, max_size=9).filter(lambda c: sum(c) > 0))
def test_weighted_counts_are_proportional_within_one(n, caps):
    counts = Pt.weighted_counts(n, caps)
    exact = n * np.array(caps) / sum(caps)
    assert counts.sum() == n and (np.abs(counts - exact) < 1).all()
    assert (counts[np.array(caps) == 0] == 0).all()
    owner = Pt.owner_weighted(n, caps)
    _check_owner(owner, n, len(caps))
    assert (np.diff(owner) >= 0).all()  # contiguous blocks in rank order


@settings(max_examples=150, deadline=None)
@given(n=ns, size=sizes, batch=st.integers(1, 64), seed=st.integers(0, 1000),
       data=st.data())
def test_cost_balances_every_batch_within_the_lpt_bound(n, size, batch, seed, data):
    costs = np.array(data.draw(st.lists(weights, min_size=n, max_size=n)))
    if n and not costs.any():
        costs[0] = 1.0
    caps = np.array(data.draw(st.lists(st.floats(0.1, 10.0), min_size=size, max_size=size)))
    order = Pt.epoch_order(n, 0, seed)
    for capacities in (np.ones(size), caps):
        owner = Pt.balance_batches(order, batch, costs, capacities)
        _check_owner(owner, n, size)
        for s in range(0, n, batch):
            pos = order[s:s + batch]
            loads = np.bincount(owner[pos], weights=costs[pos], minlength=size)
            biggest, total = costs[pos].max(), costs[pos].sum()
            W = capacities.sum()
            assert (loads / capacities).max() <= total / W + size * biggest / W + 1e-9
            if (capacities == 1).all():
                assert loads.max() - loads.min() <= biggest + 1e-9


def _batch_imbalance(owner, order, costs, size, batch=512):
    out = []
    for s in range(0, len(order), batch):
        pos = order[s:s + batch]
        loads = np.bincount(owner[pos], weights=costs[pos], minlength=size)
        out.append(loads.max() / loads.mean())
    return float(np.mean(out))


def test_cost_beats_block_on_sorted_zipf_costs():
    costs = BowSource(4000, 500, seed=0).costs()  # sorted by length, heavy tail
    order = Pt.epoch_order(4000, 0, 1)
    for size in (2, 4):
        block = _batch_imbalance(Pt.owner_block(4000, size), order, costs, size)
        cost = _batch_imbalance(Pt.balance_batches(order, 512, costs, np.ones(size)), order,
                                costs, size)
        assert block >= 1.5 and cost <= 1.01, (block, cost)


@pytest.mark.parametrize("bad, message", [
    (dict(costs=np.ones(3)), "costs must have 10 entries"),
    (dict(costs=-np.ones(10)), "costs must be >= 0"),
    (dict(costs=np.full(10, np.nan)), "NaN"),
    (dict(costs=np.zeros(10)), "all zero"),
    (dict(capacities=np.ones(5)), "capacities must have 2 entries"),
    (dict(capacities=[1, np.inf]), "NaN or Inf"),
    (dict(capacities=[0, 0]), "all zero"),
])
def test_bad_costs_and_capacities_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        Pt.assign("cost", 10, 2, **bad)


def test_unknown_strategy_and_adaptive_without_work_for_everyone():
    with pytest.raises(ValueError, match="unknown partition strategy 'zigzag'"):
        Pt.assign("zigzag", 10, 2)
    with pytest.raises(ValueError, match="at least one sample per rank"):
        Pt.assign("adaptive", 3, 4)
    for s in Pt.STRATEGIES[:-1]:  # the others accept n < P (some ranks get nothing)
        assert Pt.assign(s, 3, 4).shape == (3,)


def test_adaptive_capacities_follow_throughput():
    caps = Pt.adaptive_capacities([100, 100], [1.0, 2.0], [1, 1])
    np.testing.assert_allclose(caps, [4 / 3, 2 / 3])
    # a rank without measurements keeps its previous share relative to the measured ones
    caps = Pt.adaptive_capacities([100, 0, 50], [1.0, 0.0, 1.0], [1, 1, 1])
    assert caps[0] > caps[2] and abs(caps.mean() - 1) < 1e-12 and (caps > 0).all()


@FAST
@given(n=st.integers(0, 80), size=sizes, batch=st.integers(1, 30), epoch=st.integers(0, 3),
       seed=st.integers(0, 99), shuffle=st.booleans(), drop_last=st.booleans())
def test_owned_batches_union_is_each_global_batch(n, size, batch, epoch, seed, shuffle, drop_last):
    owner = Pt.owner_cyclic(n, size)
    order = Pt.epoch_order(n, epoch, seed, shuffle)
    got = [[Pt.positions_of(owner, r)[i] for i in
            Pt.owned_batches(n, batch, Pt.positions_of(owner, r), epoch, seed, shuffle, drop_last)]
           for r in range(size)]
    steps = Pt.steps_per_epoch(n, batch, drop_last)
    assert all(len(g) == steps for g in got)
    for s in range(steps):
        union = np.concatenate([got[r][s] for r in range(size)])
        assert sorted(union.tolist()) == sorted(order[s * batch:(s + 1) * batch].tolist())


def test_scatter_plan_groups_rows_by_rank():
    owner = np.array([1, 0, 1, 2, 0])
    rows, counts, displs = Pt.scatter_plan(owner, 4)
    assert rows.tolist() == [1, 4, 0, 2, 3] and counts.tolist() == [2, 2, 1, 0]
    assert displs.tolist() == [0, 2, 4, 5]


def _records(compute, comm=None, cost=None):
    compute = np.asarray(compute, float)  # (size, steps)
    rec = np.zeros((*compute.shape, len(STEP_FIELDS)))
    rec[:, :, STEP_FIELDS.index("compute_s")] = compute
    rec[:, :, STEP_FIELDS.index("compute_cpu_s")] = compute
    wait = compute.max(0) - compute
    rec[:, :, STEP_FIELDS.index("comm_s")] = wait + 0.1 if comm is None else comm
    rec[:, :, STEP_FIELDS.index("samples")] = 4
    rec[:, :, STEP_FIELDS.index("cost")] = 4 if cost is None else cost
    return rec


def test_balance_figures_on_a_known_timeline():
    fig = balance_figures(_records([[1.0, 1.0], [3.0, 1.0]]))
    assert fig["imbalance"] == pytest.approx((1.5 + 1.0) / 2)
    assert fig["efficiency"] == pytest.approx((2.0 + 1.0) / (3.0 + 1.0))
    r0, r1 = fig["per_rank"]
    assert r0["wait_s"] == pytest.approx(2.0) and r1["wait_s"] == pytest.approx(0.0)
    assert r0["comm_s"] == pytest.approx(0.2) and r1["comm_s"] == pytest.approx(0.2)
    assert r0["idle_fraction"] == pytest.approx(2.0 / (2.0 + 2.2))
    assert fig["slowest_rank"] == 1 and r0["samples"] == 8
    assert r0["speed"] == pytest.approx(4.0) and r1["speed"] == pytest.approx(2.0)
    assert fig["ideal_rate"] == pytest.approx(6.0)
    assert fig["rate"] == pytest.approx(16 / (3.1 + 1.1))
    perfect = balance_figures(_records([[2.0, 2.0], [2.0, 2.0]]))
    assert perfect["imbalance"] == 1.0 and perfect["efficiency"] == 1.0


def test_attainable_rate_counts_the_time_no_split_can_shorten():
    # rank 1 is twice as slow; every step has 0.1 s of Allreduce proper and 0.05 s of update
    rec = _records([[1.0, 1.0], [2.0, 2.0]])
    rec[:, :, STEP_FIELDS.index("update_s")] = 0.05
    fig = balance_figures(rec)
    assert fig["fixed_s"] == pytest.approx(2 * (0.1 + 0.05))
    assert fig["ideal_rate"] == pytest.approx(4.0 + 2.0)  # cost 8 per rank over 2 s and 4 s
    assert fig["attainable_rate"] == pytest.approx(16 / (16 / 6.0 + 0.3))
    assert fig["rate"] == pytest.approx(16 / (2 * (2.0 + 0.1 + 0.05)))
    assert fig["rate"] < fig["attainable_rate"] < fig["ideal_rate"]
    # a split in proportion to the speeds reaches the attainable rate exactly
    fair = _records([[4 / 3, 4 / 3], [4 / 3, 4 / 3]], cost=[[16 / 3] * 2, [8 / 3] * 2])
    fair[:, :, STEP_FIELDS.index("update_s")] = 0.05
    fair_fig = balance_figures(fair)
    assert fair_fig["rate"] == pytest.approx(fair_fig["attainable_rate"])


def test_adaptive_rebalances_a_2x_straggler_after_one_measurement():
    """No damping: measured speeds replace the capacities. With a rank's step time
    ``slow_r (a + x)`` (``x``: its samples, ``a``: a per-step overhead, both stretched on the
    slowed rank) one measurement is exact when ``a = 0``; with ``a > 0`` the iteration
    under-corrects and approaches the balanced split from one side, never overshooting, so
    damping would only slow it down."""
    slow, batch = np.array([1.0, 2.0]), 2048

    def times(caps, a):
        x = np.bincount(Pt.balance_batches(np.arange(batch), batch, np.ones(batch), caps),
                        minlength=2).astype(float)
        return x, slow * (a + x)

    for a, epochs, tolerance in ((0.0, 1, 3e-3), (100.0, 3, 0.01)):
        caps, ratios = np.ones(2), []
        for _ in range(epochs):
            x, t = times(caps, a)
            ratios.append(t[1] / t[0])
            caps = Pt.adaptive_capacities(x, t, caps)
        t = times(caps, a)[1]
        ratios.append(t[1] / t[0])
        assert ratios[0] == pytest.approx(2.0)  # the equal split: rank 1 takes twice as long
        assert abs(ratios[-1] - 1) <= tolerance, ratios
        assert all(1 - 3e-3 <= r1 <= r0 for r0, r1 in zip(ratios, ratios[1:])), ratios


def test_step_timer_slowdown_stretches_the_local_work_but_not_the_update():
    import time

    from mpidp.observe.metrics import StepTimer
    timer = StepTimer(slowdown=3.0)
    with timer.compute():
        time.sleep(0.02)  # forward/backward: scales with the rank's samples
    with timer.communicate():
        pass
    with timer.compute():
        time.sleep(0.02)  # the replicated update after the collective
    timer.end_step(4)
    row = timer.take_records()[0]
    assert row[STEP_FIELDS.index("compute_s")] >= 3 * 0.02
    assert 0.02 <= row[STEP_FIELDS.index("update_s")] < 2 * 0.02



def test_a_slowdown_sleep_is_wall_time_not_the_works_cpu_time(monkeypatch):
    """The CPU column holds the work's CPU time: what other threads of the process burn
    while the slowed rank sleeps is not the forward/backward's (it made the wall-to-CPU
    ratio of a slowed rank depend on the MPI library's threads)."""
    import time
    from types import SimpleNamespace

    from mpidp.observe import metrics

    def busy_sleep(seconds):  # the sleep, with another thread of the process on the CPU
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    monkeypatch.setattr(metrics, "time", SimpleNamespace(
        perf_counter=time.perf_counter, process_time=time.process_time, sleep=busy_sleep))
    timer = metrics.StepTimer(slowdown=4.0)
    with timer.compute():
        time.sleep(0.02)  # forward/backward waiting on nothing: no CPU of its own
    timer.end_step(4)
    row = timer.take_records()[0]
    wall, cpu = row[STEP_FIELDS.index("compute_s")], row[STEP_FIELDS.index("compute_cpu_s")]
    assert wall >= 4 * 0.02 and cpu < 0.02, (wall, cpu)

def test_an_exchange_that_raises_is_still_timed():
    """An exchange that fails and is done another way (auto's float16 fallback) costs the
    step both: the failed one's seconds count as communication."""
    import time

    from mpidp.observe.metrics import StepTimer
    timer = StepTimer()
    with pytest.raises(RuntimeError), timer.communicate():
        time.sleep(0.02)
        raise RuntimeError("overflow")
    with timer.communicate():
        time.sleep(0.01)
    timer.end_step(4)
    row = timer.take_records()[0]
    assert timer.comm_s >= 0.03 and row[STEP_FIELDS.index("comm_s")] >= 0.03


def test_csr_rows_and_sparse_layer_match_dense():
    rng = np.random.default_rng(0)
    lengths = np.array([3, 0, 5, 1, 0])
    X = CSR(np.concatenate([[0], np.cumsum(lengths)]), rng.integers(0, 6, 9), rng.random(9), 6)
    D = X.toarray()
    for rows in (np.array([4, 2, 2, 0]), slice(1, 4), np.array([], np.int64)):
        np.testing.assert_array_equal(X[rows].toarray(), D[rows])
    layer = SparseDense(6, 3)
    W, gW = np.zeros((6, 3)), np.zeros((6, 3))
    layer.bind({"W": W, "b": np.zeros(3)}, {"W": gW, "b": np.zeros(3)})
    layer.init_(rng)
    np.testing.assert_allclose(layer.forward(X), D @ W)
    dy = rng.standard_normal((5, 3))
    layer.backward(dy)
    np.testing.assert_allclose(gW, D.T @ dy)


def test_bow_rows_are_sorted_by_length_and_reproducible():
    src = BowSource(3000, 200, seed=2)
    assert (np.diff(src.lengths) >= 0).all() and src.lengths[-1] > 10 * np.median(src.lengths)
    X, y = src.read(np.array([5, 2999, 1500]))
    X2, y2 = src.read(np.arange(3000))
    np.testing.assert_array_equal(X.toarray(), X2[np.array([5, 2999, 1500])].toarray())
    np.testing.assert_array_equal(X.row_lengths(), src.lengths[[5, 2999, 1500]])
    assert (y == y2[[5, 2999, 1500]]).all() and len(np.unique(y2)) > 3


# --- gradient-exchange strategies: names, the reduced buffer's slots, the NaN policy -----

def test_sync_names_import_without_mpi():
    import subprocess
    import sys
    code = ("import sys, mpidp.parallel.modes as s, mpidp.cli.options as o; "
            "assert 'mpi4py.MPI' not in sys.modules, 'MPI started'; "
            "assert o.MODES is s.MODES and 'allreduce' in s.SYNCS")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_buffer_slots_carry_totals_and_the_stop_request():
    from mpidp.parallel import buffer
    buf = buffer.new(5, np.float32)
    assert buf.shape == (5 + buffer.N_EXTRA,) and buffer.EXTRAS[buffer.STOP] == "stop"
    buffer.put(buf, 5, 2.5, 4, 3, stop=False)
    buffer.put(buf, 5, 1.0, 2, 1, stop=True, add=True)  # accumulated; the request is set
    assert buffer.totals(buf, 5) == (3.5, 6, 4) and buffer.stopping(buf, 5)
    buffer.put(buf, 5, 0.5, 1, 0, stop=False)
    assert buffer.totals(buf, 5) == (0.5, 1, 0) and not buffer.stopping(buf, 5)
    summed = buf + np.eye(1, buf.size, 5 + buffer.STOP, dtype=np.float32)[0]  # one rank asked
    assert buffer.stopping(summed, 5)


def test_the_early_mark_is_set_for_a_synchronisation_and_cleared_by_the_next_step():
    from mpidp.parallel import buffer
    buf = buffer.new(5, np.float32)
    buffer.mark_early(buf, 5, True)
    assert buffer.early_ranks(buf, 5) == 1 and buffer.totals(buf, 5) == (0.0, 0, 0)
    assert buffer.early_ranks(buf * 3, 5) == 3  # three ranks' marks, summed
    buffer.put(buf, 5, 1.0, 2, 1, stop=False, add=True)
    assert buffer.early_ranks(buf, 5) == 0 and not buffer.stopping(buf, 5)


def test_policy_counts_every_skipped_step_and_stops_before_the_update():
    from mpidp.run.nonfinite import NonFiniteError, Policy
    skip, stop, ignore = Policy("skip"), Policy("stop"), Policy("ignore")
    assert skip.apply(True, 1.0, 0) and not skip.apply(False, float("nan"), 1, steps=3)
    assert not skip.apply(False, float("nan"), 2) and skip.skipped == 4
    with pytest.raises(NonFiniteError, match="step 7"):
        stop.apply(False, float("nan"), 7)
    assert ignore.apply(False, float("nan"), 0) and not ignore.checks and ignore.skipped == 0
