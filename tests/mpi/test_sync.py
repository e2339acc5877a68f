"""Every way of combining gradients gives the single-process arithmetic (float64), except
local SGD and lossy compression, whose costs are bounded here and measured in bench-sync."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import CountingComm, all_ranks, raises_everywhere, record_timer_sleeps

import mpidp
from mpidp import nn
from mpidp.parallel.buffer import N_EXTRA
from mpidp.parallel.modes import MODES, SYNCS, make_sync
from mpidp.parallel.overlap import Overlapped
from mpidp.run.checkpoint import State
from mpidp.run.loop import run
from mpidp.run.nonfinite import NonFiniteError
from mpidp.run.signals import Preempted, StopSignals
from mpidp.run.spec import RunSpec

RTOL, ATOL = 1e-9, 1e-11  # reduction order only: see test_data_parallel.py


def _data(comm, n=150, skip_rank=None):
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((n, 6)), rng.integers(0, 3, n)
    workers = [r for r in range(comm.size) if r != skip_rank]
    parts = np.array_split(np.arange(n), len(workers))
    rows = parts[workers.index(comm.rank)] if comm.rank in workers else np.arange(0)
    return mpidp.shard_from_arrays(comm, X[rows], y[rows]), X, y


def _train(comm, shard, sync="allreduce", optimizer=lambda: nn.Adam(0.01), epochs=2, batch=16, **kw):
    model = nn.mlp(6, (12, 8), 3, dtype=np.float64).init_(4)
    opt = optimizer()
    if isinstance(sync, str) and sync in ("sharded-ps", "accumulate", "local-sgd", "overlapped"):
        sync = make_sync(sync, optimizer, **kw)
    dp = mpidp.DataParallel(model, opt, nn.SoftmaxCrossEntropy(), comm, sync=sync)
    hist = mpidp.fit(dp, shard, epochs, batch, seed=2)
    return dp, hist


def _own(sync, **values):
    """Of ``values``, the settings that mode ``sync`` has."""
    return {k: v for k, v in values.items() if k in MODES[sync].fields}


def _reference(X, y, batch=16, **kw):
    return _train(MPI.COMM_SELF, mpidp.shard_from_arrays(MPI.COMM_SELF, X, y), batch=batch, **kw)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sync,kw", [("allreduce", {}), ("per-layer", {}),
                                     ("overlapped", {"bucket_bytes": 200}),
                                     ("sharded-ps", {})])
def test_exact_strategies_match_single_process(comm, sync, kw):
    shard, X, y = _data(comm)
    dp, hist = _train(comm, shard, sync, **kw)
    ref, ref_hist = _reference(X, y)
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL),
              f"{sync}: max diff {np.abs(dp.model.params - ref.model.params).max():.3g}")
    all_ranks(comm, dp.in_sync() and abs(hist[-1]["loss"] - ref_hist[-1]["loss"]) < 1e-9)


@pytest.mark.mpi(min_size=1)
def test_overlapped_uses_several_buckets(comm):
    shard, _, _ = _data(comm)
    sync = Overlapped(bucket_bytes=200)
    _train(comm, shard, sync, epochs=1)
    all_ranks(comm, len(sync.buckets) > 2, f"buckets {sync.buckets}")


@pytest.mark.mpi(min_size=2)
def test_overlapped_starts_a_large_layers_bucket_in_parts(comm):
    """``bucket_bytes=200`` (25 float64 values), a bucket per layer: the second Dense's 96
    gradient values are announced in parts of 4 rows (32 values), the first's 72 in parts
    of 3 rows (36), so their buckets start in 3 and 2 sums, the first ones before the
    layer is done (the last Dense, 24 values, in one). Every step's sums cover the buffer
    once; still the single-process arithmetic."""
    shard, X, y = _data(comm)
    sync, starts = Overlapped(bucket_bytes=200), []

    def counted(lo, hi, start=sync._start):
        starts.append((lo, hi, sync.launched))
        start(lo, hi)
    sync._start = counted
    dp, _ = _train(comm, shard, sync, epochs=1)
    per_step = len(starts) // dp.global_step
    first = sorted(starts[:per_step])
    tiles = all(a[1] == b[0] for a, b in zip(first, first[1:]))
    all_ranks(comm, len(starts) == per_step * dp.global_step and per_step == len(sync.buckets) + 3 == 6,
              f"{per_step} sums per step, {len(sync.buckets)} buckets")
    all_ranks(comm, tiles and first[0][0] == 0 and first[-1][1] == dp.buf.size, f"{first}")
    last = [s for s in starts[:per_step] if s[2] == len(sync.buckets) - 1]
    all_ranks(comm, last == [(0, 36, len(sync.buckets) - 1), (36, sync.buckets[-1][2],
                                                               len(sync.buckets) - 1)], f"{last}")
    ref, _ = _reference(X, y, epochs=1)
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dedicated", [False, True])
def test_parameter_server_matches_single_process(comm, dedicated):
    shard, X, y = _data(comm, skip_rank=0 if dedicated else None)
    dp, _ = _train(comm, shard, make_sync("ps", dedicated=dedicated))
    ref, _ = _reference(X, y)
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL))
    all_ranks(comm, dp.in_sync())
    if dedicated:
        all_ranks(comm, (len(shard.X) == 0) == (comm.rank == 0))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shared_memory", [True, False])
@pytest.mark.parametrize("optimizer", [lambda: nn.Adam(0.01), lambda: nn.SGD(0.1, momentum=0.9)],
                         ids=["adam", "momentum"])
@pytest.mark.parametrize("last_root", [False, True])
def test_parameter_server_in_pieces_matches_single_process(comm, shared_memory, optimizer, last_root):
    """Gradients summed in shared memory, and the server updating in 64-byte pieces that
    workers copy out of its memory (or, with shared_memory=False, Reduce_scatter + Gatherv
    and one Bcast): still the single-process arithmetic, whichever rank serves."""
    from mpidp.parallel.ps import ParameterServer
    shard, X, y = _data(comm)
    root = comm.size - 1 if last_root else 0
    ps = ParameterServer(shared_memory=shared_memory, chunk_bytes=64)
    model = nn.mlp(6, (12, 8), 3, dtype=np.float64).init_(4)
    dp = mpidp.DataParallel(model, optimizer(), nn.SoftmaxCrossEntropy(), comm, sync=ps, root=root)
    mpidp.fit(dp, shard, 2, 16, seed=2)
    ref, _ = _reference(X, y, optimizer=optimizer)
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL),
              f"max diff {np.abs(dp.model.params - ref.model.params).max():.3g}")
    all_ranks(comm, dp.in_sync())
    # one node here: the shared path is taken exactly when asked for, in many pieces, with
    # the gradient buffer and the server's parameters in the shared windows themselves
    all_ranks(comm, (ps.shared is not None) == (ps.gather is not None) == shared_memory)
    if shared_memory:
        all_ranks(comm, len(ps.edges) - 1 == -(-dp.model.params.nbytes // 64))
        all_ranks(comm, np.shares_memory(dp.model.params, ps.shared.array) == (comm.rank == root))
        all_ranks(comm, np.shares_memory(dp.model.grads, ps.gather.array))


@pytest.mark.mpi(min_size=2)
def test_parameter_server_without_room_for_shared_windows_uses_mpi(comm, monkeypatch):
    """One rank finds too little free shared memory (a 64 MiB Docker /dev/shm and a big
    model): every rank takes the MPI path together, and training stays exact."""
    from mpidp import comm as C
    from mpidp.parallel.ps import ParameterServer
    if comm.rank == comm.size - 1:
        monkeypatch.setattr(C, "shm_room", lambda nbytes, path=None: False)
    shard, X, y = _data(comm)
    ps = ParameterServer()
    dp, _ = _train(comm, shard, ps)
    ref, _ = _reference(X, y)
    all_ranks(comm, ps.shared is None and ps.gather is None)
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("shared_memory", [True, False])
def test_parameter_server_nan_policy_is_shared_by_every_rank(comm, shared_memory):
    """A non-finite gradient on one rank: with "skip" every rank skips the same steps and
    the replicas stay equal (no worker waits for pieces that never come); with "stop" every
    rank raises."""
    from mpidp.parallel.ps import ParameterServer
    shard, _, _ = _data(comm)
    if comm.rank == comm.size - 1:
        shard.X[3] = np.nan
    model = nn.mlp(6, (12, 8), 3, dtype=np.float64).init_(4)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                            sync=ParameterServer(shared_memory=shared_memory, chunk_bytes=64),
                            on_nonfinite="skip")
    mpidp.fit(dp, shard, 2, 16, seed=2)
    skipped = comm.allgather(dp.skipped_steps)
    all_ranks(comm, skipped[0] == 2 and len(set(skipped)) == 1, f"skipped {skipped}")
    all_ranks(comm, dp.in_sync() and np.isfinite(dp.model.params).all())
    raises_everywhere(comm, NonFiniteError, lambda: _train(
        comm, shard, ParameterServer(shared_memory=shared_memory, chunk_bytes=64), epochs=1),
        "non-finite")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sync", ["allreduce", "per-layer", "overlapped", "accumulate"])
def test_allreduce_nan_policy_is_shared_by_every_rank(comm, sync):
    """A NaN in one gradient of the reduced sums (every rank checks all of them): "skip"
    drops the same steps everywhere and the replicas stay equal and finite; "stop" raises
    on every rank."""
    shard, _, _ = _data(comm)

    def train(policy, epochs):
        model = nn.mlp(6, (12, 8), 3, dtype=np.float64).init_(4)
        strategy = make_sync(sync, **_own(sync, k=2, bucket_bytes=200))
        reduce, done = strategy.reduce, []

        def poisoned():  # the 2nd and 4th reductions carry a NaN gradient
            reduce()
            done.append(1)
            if len(done) in (2, 4):
                strategy.buf[strategy.n - 2] = np.nan  # a last-layer bias
        strategy.reduce = poisoned
        dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                                sync=strategy, on_nonfinite=policy)
        mpidp.fit(dp, shard, epochs, 16, seed=2)
        return dp

    dp = train("skip", 2)
    skipped = comm.allgather(dp.skipped_steps)
    all_ranks(comm, skipped[0] == 2 and len(set(skipped)) == 1, f"skipped {skipped}")
    all_ranks(comm, dp.in_sync() and np.isfinite(dp.model.params).all())
    raises_everywhere(comm, NonFiniteError, lambda: train("stop", 1), "non-finite")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sync", ["allreduce", "ps"])
def test_ignore_policy_applies_non_finite_updates_without_checking(comm, sync):
    """on_nonfinite="ignore": no check, no skip, no error: the NaN reaches every replica."""
    if sync == "ps" and comm.size < 2:
        pytest.skip("a parameter server needs 2 ranks")
    shard, _, _ = _data(comm)
    if comm.rank == 0:
        shard.X[0] = np.nan
    model = nn.mlp(6, (12, 8), 3, dtype=np.float64).init_(4)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, sync=sync,
                            on_nonfinite="ignore")
    mpidp.fit(dp, shard, 1, 16, seed=2)
    all_ranks(comm, dp.skipped_steps == 0 and np.isnan(dp.model.params).any())


@pytest.mark.mpi(min_size=1)
def test_sharded_ps_keeps_a_slice_of_optimizer_state(comm):
    shard, _, _ = _data(comm)
    dp, _ = _train(comm, shard, "sharded-ps", epochs=1)
    n = dp.model.n_params
    all_ranks(comm, dp.sync.optimizer.state["m"].size <= -(-(n + N_EXTRA) // comm.size))
    all_ranks(comm, dp.optimizer.state == {}, "the full optimizer must stay unused")


@pytest.mark.mpi(min_size=1)
def test_accumulation_equals_a_k_times_larger_batch(comm):
    shard, X, y = _data(comm, n=160)  # 10 batches of 16 per epoch: groups of 5
    dp, _ = _train(comm, shard, "accumulate", optimizer=lambda: nn.SGD(0.1, momentum=0.9), k=5)
    ref, _ = _reference(X, y, batch=80, optimizer=lambda: nn.SGD(0.1, momentum=0.9))
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL))
    all_ranks(comm, dp.sync.bytes_sent == 4 * dp.buf.nbytes, "2 epochs x 2 groups")


@pytest.mark.mpi(min_size=1)
def test_local_sgd_keeps_replicas_equal_after_averaging(comm):
    shard, X, y = _data(comm, n=160)
    dp, hist = _train(comm, shard, "local-sgd", optimizer=lambda: nn.SGD(0.05), k=2, epochs=3)
    all_ranks(comm, dp.in_sync(), "parameters are averaged at every epoch end")
    all_ranks(comm, hist[-1]["loss"] < hist[0]["loss"])
    if comm.size == 1:  # one replica: local SGD is plain SGD
        ref, _ = _reference(X, y, optimizer=lambda: nn.SGD(0.05), epochs=3)
        assert np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sync", ["accumulate", "local-sgd"])
def test_an_epoch_end_told_on_some_ranks_only_is_refused_on_every_rank(comm, sync):
    """A loop of one's own that tells rank 0 alone of an epoch's end: rank 0 synchronises
    after 2 steps, the others after 3, and these two exchanges pair up. Every rank raises
    there (the sums used to be applied as if nothing were wrong, and the steps stayed
    shifted)."""
    model = nn.mlp(6, (5,), 3, dtype=np.float64).init_(0)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                            sync=make_sync(sync, k=3))
    rng = np.random.default_rng(comm.rank)
    X, y = rng.standard_normal((4, 6)), rng.integers(0, 3, 4)

    def loop():
        for i in range(6):
            dp.step(X, y, last_of_epoch=comm.rank == 0 and i == 1)
    raises_everywhere(comm, mpidp.MpidpError, loop, f"1 of {comm.size} ranks synchronised early")
    told_all = mpidp.DataParallel(nn.mlp(6, (5,), 3, dtype=np.float64).init_(0), nn.SGD(0.1),
                                  nn.SoftmaxCrossEntropy(), comm, sync=make_sync(sync, k=3))
    for i in range(5):  # every rank told at the same step: no complaint (2 + 3 steps)
        told_all.step(X, y, last_of_epoch=i == 1)
    all_ranks(comm, told_all.sync.at_boundary() and told_all.in_sync())


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("codec", ["bfloat16", "float16"])
def test_compressed_halves_gradient_bytes_and_tracks_full_precision(comm, codec):
    shard, X, y = _data(comm)
    full, _ = _train(comm, shard, "allreduce", optimizer=lambda: nn.SGD(0.1), epochs=2)
    small, _ = _train(comm, shard, make_sync("compressed", codec=codec),
                      optimizer=lambda: nn.SGD(0.1), epochs=2)
    all_ranks(comm, small.sync.bytes_sent <= 0.52 * full.sync.bytes_sent,
              f"{small.sync.bytes_sent} vs {full.sync.bytes_sent}")
    rel = np.linalg.norm(small.model.params - full.model.params) / np.linalg.norm(full.model.params)
    all_ranks(comm, 0 < rel < 0.02, f"relative parameter difference {rel:.3g}")
    all_ranks(comm, small.in_sync())


@pytest.mark.mpi(min_size=1)
def test_float16_overflow_is_an_error_on_every_rank(comm):
    shard, _, _ = _data(comm)
    shard.X *= 1e6  # gradients far beyond float16's 65504
    raises_everywhere(comm, mpidp.MpidpError, lambda: _train(
        comm, shard, make_sync("compressed", codec="float16"), epochs=1), "overflowed")


@pytest.mark.mpi(min_size=1)
def test_bad_sync_options_fail_everywhere(comm):
    model = nn.mlp(6, (4,), 3).init_(0)
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.DataParallel(
        model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, sync="gossip"), "unknown sync mode")
    raises_everywhere(comm, mpidp.MpidpError, lambda: make_sync("overlapped", bucket_bytes=0),
                      "bucket_bytes must be a finite number of bytes from 1")
    raises_everywhere(comm, mpidp.MpidpError, lambda: make_sync("compressed", codec=""),
                      "unknown compression ''")
    raises_everywhere(comm, mpidp.MpidpError, lambda: make_sync("overlapped", codec="int8"),
                      "codec 'int8' applies to --sync compressed or auto, not overlapped")
    raises_everywhere(comm, mpidp.MpidpError, lambda: make_sync(
        "compressed", progress="thread"), "applies to --sync overlapped or auto")
    for bad in ("off", 0, 1.0):
        raises_everywhere(comm, mpidp.MpidpError, lambda bad=bad: make_sync(
            "allreduce", node_aware=bad), f"node_aware must be None (node-aware where it pays), "
            f"True or False, got {bad!r}")
    assert make_sync("accumulate", node_aware=np.False_).node_aware is False
    f64 = nn.mlp(6, (4,), 3, dtype=np.float64).init_(0)
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.DataParallel(
        f64, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, sync=make_sync("auto", codec="int8")),
        "auto tries compression for float32 models only, and this model is float64")
    for name in ("compressed", "auto"):  # auto refuses it too, not only when it tries it
        raises_everywhere(comm, mpidp.MpidpError, lambda name=name: make_sync(name, codec="int4"),
                          "unknown compression 'int4'")
    raises_everywhere(comm, mpidp.MpidpError, lambda: make_sync("accumulate", k=0), ">= 1")
    if comm.size == 1:
        raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.DataParallel(
            model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, sync="ps"), "at least 2 ranks")


@pytest.mark.parametrize("name", ["allreduce", "overlapped", "compressed", "auto"])
def test_a_strategy_object_serves_one_trainer(comm, name):
    """A second DataParallel given the first one's strategy object is refused on every
    rank (it would reduce the second's buffer for the first), before and after the first
    closes; the first trains on exactly as a trainer that was never shared."""
    shard, X, y = _data(comm)
    models = [nn.mlp(6, (12, 8), 3, dtype=np.float32).init_(4) for _ in range(3)]
    dps = [mpidp.DataParallel(models[i], nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                              sync=make_sync(name)) for i in (0, 2)]
    again = lambda: mpidp.DataParallel(models[1], nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                                       sync=dps[0].sync)
    raises_everywhere(comm, mpidp.MpidpError, again, "strategy object already served a DataParallel")
    for dp in dps:
        mpidp.fit(dp, shard, 1, 16, seed=2)
        dp.close()
    all_ranks(comm, np.array_equal(models[0].params, models[2].params), "the first trainer drifted")
    raises_everywhere(comm, mpidp.MpidpError, again, "strategy object already served a DataParallel")


@pytest.mark.mpi(min_size=2)
def test_a_strategy_whose_trainer_failed_to_start_serves_the_next(comm):
    model = nn.mlp(6, (12,), 3, dtype=np.float32).init_(comm.rank)  # replicas differ
    sync = make_sync("overlapped")
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.DataParallel(
        model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, init_sync="seed", sync=sync),
        "out of sync")
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, sync=sync)
    shard, X, y = _data(comm)
    mpidp.fit(dp, shard, 1, 16, seed=2)
    all_ranks(comm, mpidp.params_in_sync(comm, model.params))
    dp.close()


@pytest.mark.mpi(min_size=2)
def test_async_parameter_server_terminates_and_accounts_for_every_push(comm):
    from mpidp.parallel.async_ps import AsyncPS, fit_async
    shard, X, y = _data(comm, skip_rank=0)  # the server holds no data
    model = nn.mlp(6, (12, 8), 3, dtype=np.float64).init_(4)
    ps = AsyncPS(model, nn.SGD(0.05), nn.SoftmaxCrossEntropy(), comm, max_staleness=1)
    stats = fit_async(ps, shard, 3, 16, seed=2)
    pushes = comm.allreduce(sum(1 for e in range(3) for idx in mpidp.data.partition.local_batches(
        shard.n_total, 16, shard.start, shard.stop, e, 2) if len(idx)))
    all_ranks(comm, stats.applied + stats.dropped == pushes, f"{stats.applied}+{stats.dropped} != {pushes}")
    all_ranks(comm, mpidp.params_in_sync(comm, model.params))
    losses = [s / c for _, (s, c) in sorted((int(k), v) for k, v in stats.epoch_loss.items())]
    all_ranks(comm, len(losses) == 3 and losses[-1] < losses[0], str(losses))
    if comm.size == 2:  # one worker: no staleness, exactly sequential SGD
        ref, _ = _reference(X, y, optimizer=lambda: nn.SGD(0.05), epochs=3)
        all_ranks(comm, stats.dropped == 0 and np.allclose(model.params, ref.model.params,
                                                           rtol=RTOL, atol=ATOL))


@pytest.mark.mpi(min_size=2)
def test_async_trace_and_straggler_timer(comm, monkeypatch):
    """The server's trace has one row per push that adds up to the stats; a worker's timer
    counts its pushes, and the last worker's slowdown stretches its compute: its timer's
    sleeps (recorded, asked and taken) ask 2x the work that its compute column holds
    beside the sleep taken (slowdown 3), with no wall-clock threshold."""
    from mpidp.observe.metrics import StepTimer
    from mpidp.parallel.async_ps import TRACE_FIELDS, AsyncPS, fit_async
    asked, slept = record_timer_sleeps(monkeypatch)
    shard, _, _ = _data(comm, skip_rank=0)
    model = nn.mlp(6, (12, 8), 3, dtype=np.float64).init_(4)
    timer = StepTimer(slowdown=3.0 if comm.rank == comm.size - 1 else 1.0)
    ps = AsyncPS(model, nn.SGD(0.05), nn.SoftmaxCrossEntropy(), comm, max_staleness=1,
                 timer=timer)
    stats = fit_async(ps, shard, 2, 16, seed=2)
    mine = sum(1 for e in range(2) for idx in mpidp.data.partition.local_batches(
        shard.n_total, 16, shard.start, shard.stop, e, 2) if len(idx))
    all_ranks(comm, timer.steps == (0 if comm.rank == 0 else mine), f"{timer.steps} != {mine}")
    rows = timer.take_records()
    wall = rows[:, 1].sum() if len(rows) else 0.0
    slow = comm.rank == comm.size - 1
    ok = (0 < asked[0] <= 2 * (wall - slept[0])) if slow else not asked.any()
    all_ranks(comm, ok, f"asked {asked[0]}, slept {slept[0]}, wall {wall}")
    if comm.rank == 0:
        t = np.array(stats.trace, np.float64).reshape(-1, len(TRACE_FIELDS))
        ok = (len(t) == stats.applied + stats.dropped and t[:, 4].sum() == stats.applied
              and t[:, 2].sum() == 150 * 2 and np.all(np.diff(t[:, 0]) >= 0)
              and list(t[t[:, 4] == 1, 3]) == stats.staleness  # of the applied pushes only
              and max(stats.staleness, default=0) <= 1 and set(t[:, 5]) <= set(range(1, comm.size)))
        all_ranks(comm, ok, f"trace {t[:5]}")
    else:
        all_ranks(comm, stats.trace == [])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n", [1, 3, 1000, 40_000])  # 40,000 float64: the split path
@pytest.mark.parametrize("last_root", [False, True])
def test_reduce_sum_to_root_equals_the_plain_sum(comm, n, last_root):
    from mpidp import comm as C
    root = comm.size - 1 if last_root else 0
    parts = [np.random.default_rng(r).standard_normal(n) for r in range(comm.size)]
    buf = parts[comm.rank].copy()
    C.reduce_sum_to_(comm, buf, root)
    if comm.rank == root:
        expected = np.sum(parts, axis=0)
        all_ranks(comm, np.allclose(buf, expected, rtol=1e-13, atol=1e-13),
                  f"max diff {np.max(np.abs(buf - expected)):.3g}")
    else:
        all_ranks(comm, True)
    all_ranks(comm, (n * 8 >= C.REDUCE_SPLIT_BYTES) == (n == 40_000))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sync,optimizer,files,resume_at", [
    ("sharded-ps", lambda: nn.Adam(0.01), [3, 6, 9, 12, 15, 18, 20], 12),
    ("sharded-ps", lambda: nn.SGD(0.1, momentum=0.9), [3, 6, 9, 12, 15, 18, 20], 12),
    # groups of 4 restart each epoch (10 steps): saves due at 3, 6, 9, ... wait for a group's end
    ("accumulate", lambda: nn.SGD(0.1, momentum=0.9), [4, 8, 10, 14, 18, 20], 14),
    ("local-sgd", lambda: nn.SGD(0.1), [4, 8, 10, 14, 18, 20], 14),
    ("overlapped", lambda: nn.SGD(0.1, momentum=0.9), [3, 6, 9, 12, 15, 18, 20], 12)])
def test_resume_mid_epoch_is_bit_identical(comm, shared_tmp, sync, optimizer, files, resume_at):
    """Checkpoints every 3 steps, then a fresh run resumed from one taken mid-epoch ends on
    the uninterrupted run's very bits: a sharded optimizer's state is gathered into the
    checkpoint and sliced again on resume; accumulation saves only between groups."""
    import os
    import shutil

    from mpidp.run.checkpoint import restore
    from mpidp.run.spec import Checkpointing
    shard, _, _ = _data(comm)  # 150 rows, batches of 16: 10 steps per epoch

    def run(ck, resume=False, every=3):
        model = nn.mlp(6, (12, 8), 3, dtype=np.float64).init_(4)
        opt = optimizer()
        dp = mpidp.DataParallel(model, opt, nn.SoftmaxCrossEntropy(), comm,
                                sync=make_sync(sync, optimizer))
        state = restore(comm, ck, model, opt)[1] if resume else None
        mpidp.fit(dp, shard, 2, 16, seed=2, resume=state,
                  checkpoint=Checkpointing(ck, every, keep=100))
        return dp

    first = os.path.join(shared_tmp, "first")
    dp = run(first)
    comm.Barrier()  # the root writes the last checkpoint after the others are done
    saved = sorted(int(f[5:15]) for f in os.listdir(first) if f.endswith(".npz"))
    all_ranks(comm, saved == files, f"checkpoints at steps {saved}")
    again = os.path.join(shared_tmp, "again")
    if comm.rank == 0:
        os.makedirs(again)
        shutil.copy(os.path.join(first, f"ckpt-{resume_at:010d}.npz"), again)
    comm.Barrier()
    resumed = run(again, resume=True, every=1000)
    all_ranks(comm, np.array_equal(resumed.model.params, dp.model.params),
              f"max diff {np.abs(resumed.model.params - dp.model.params).max():.3g}")


class _Batches:
    """A :class:`mpidp.run.loop.Feed` of the same batches every epoch; no collectives."""

    labelled = True

    def __init__(self, batches):
        self.items, self.n_steps = batches, len(batches)

    def batches(self, epoch, first):
        yield from self.items[first:]

    def end_epoch(self):
        return None

    def evaluate(self):
        return None

    def state(self):
        return {}


@pytest.mark.mpi(min_size=1)
def test_allreduce_step_is_one_collective_with_nan_check_and_stop_signals(comm):
    """Through the loop, with on_nonfinite="stop" on a buffer over 1 MiB and stop signals
    installed: each step makes exactly ONE collective (the Allreduce, which also carries the
    stop request and gives every rank the sums it checks), plus the replica check every
    check_every steps."""
    counting = CountingComm(comm)
    model = nn.mlp(512, (512,), 10, dtype=np.float32).init_(0)  # 1.03 MiB of float32
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), counting,
                            on_nonfinite="stop")
    rng = np.random.default_rng(comm.rank)
    feed = _Batches([(rng.standard_normal((4, 512)).astype(np.float32), rng.integers(0, 10, 4))
                     for _ in range(6)])
    per_step = []

    def on_step(epoch, stats):
        per_step.append((dp.global_step, list(counting.calls), stats.stop))
        counting.calls.clear()

    stop = StopSignals(comm)
    try:
        counting.calls.clear()
        run(dp, feed, RunSpec(2, 4, check_every=3, on_step=on_step, stop=stop))
    finally:
        stop.close()
    all_ranks(comm, dp.buf.nbytes >= 1 << 20, f"{dp.buf.nbytes} bytes")
    want = [(i, ["Allreduce"] * (2 if i % 3 == 0 else 1), False) for i in range(1, 13)]
    all_ranks(comm, per_step == want, f"per step: {per_step}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sync", SYNCS)
def test_a_stop_request_on_one_rank_stops_every_rank_at_the_same_step(comm, sync):
    """The last rank asks to stop after step 1: every strategy delivers the request with its
    next synchronisation (step 2; step 4 for those synchronising every 4 steps), and every
    rank raises Preempted after that same step."""
    if sync == "ps" and comm.size < 2:
        pytest.skip("a parameter server needs 2 ranks")
    shard, _, _ = _data(comm)
    model = nn.mlp(6, (12, 8), 3, dtype=np.float64).init_(4)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                            sync=make_sync(sync, lambda: nn.SGD(0.1), **_own(sync, k=4)))
    stop, seen = StopSignals(comm), []

    def on_step(epoch, stats):
        seen.append(stats.stop)
        if dp.global_step == 1 and comm.rank == comm.size - 1:
            stop.requested = True

    try:
        err = raises_everywhere(comm, Preempted, lambda: mpidp.fit(
            dp, shard, 2, 16, seed=2, stop=stop, on_step=on_step))
    finally:
        stop.close()
    at = 4 if sync in ("accumulate", "local-sgd") else 2
    all_ranks(comm, f"after step {at}:" in str(err) and seen == [False] * (at - 1) + [True],
              f"{err}; stop seen {seen}")
    all_ranks(comm, dp.in_sync(), "replicas differ after the stop")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("through", ["step", "loop"])
def test_replica_checks_under_local_sgd_wait_for_the_average(comm, through):
    """Between averages local SGD's replicas differ by design: a check due then waits for
    the next average (it used to fail a healthy run): due after steps 2 and 4 (and 6),
    averages after steps 3 and 6, so checks after steps 3 and 6."""
    model = nn.mlp(6, (5,), 3, dtype=np.float64).init_(0)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                            sync=make_sync("local-sgd", k=3),
                            check_every=2 if through == "step" else 0)
    checked, check = [], dp.check_replicas

    def recorded():
        checked.append(dp.global_step)
        check()
    dp.check_replicas = recorded
    rng = np.random.default_rng(comm.rank)  # each rank its own rows: replicas drift apart
    batches = [(rng.standard_normal((4, 6)), rng.integers(0, 3, 4)) for _ in range(7)]
    if through == "step":
        for X, y in batches:
            dp.step(X, y)
    else:
        run(dp, _Batches(batches), RunSpec(1, 4, check_every=2))
    all_ranks(comm, checked == [3, 6], f"checked after steps {checked}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sync", ["allreduce", "ps", "sharded-ps"])
def test_a_loop_of_ones_own_continues_exactly_from_restore(comm, shared_tmp, sync):
    """``dp.restore`` then ``dp.step``: the optimizer state continues (a sharded strategy
    used to take its slice only inside fit, so Adam restarted from nothing)."""
    import os
    rng = np.random.default_rng(comm.rank)
    batches = [(rng.standard_normal((5, 4)), rng.integers(0, 3, 5)) for _ in range(6)]

    def new():
        model = nn.mlp(4, (6,), 3, dtype=np.float64).init_(0)
        return mpidp.DataParallel(model, nn.Adam(0.05), nn.SoftmaxCrossEntropy(), comm,
                                  sync=sync)
    whole = new()
    for X, y in batches:
        whole.step(X, y)
    first = new()
    for X, y in batches[:3]:
        first.step(X, y)
    folder = os.path.join(shared_tmp, f"own-{sync}")
    first.save_checkpoint(folder, State(epoch=0, step=3, global_step=3), keep=1)
    again = new()
    again.restore(folder)
    for X, y in batches[3:]:
        again.step(X, y)
    err = float(np.abs(again.model.params - whole.model.params).max())
    all_ranks(comm, err == 0.0, f"max difference {err:.3g}")
