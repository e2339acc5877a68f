"""The fit entry points take the trainer, the data and one RunSpec; keyword arguments fill
it, and settings that cannot apply are refused on every rank before any work."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_helpers import all_ranks, raises_everywhere, record_timer_sleeps

import mpidp
from mpidp import nn
from mpidp.data.balance import Plan
from mpidp.parallel.pipeline import Pipeline
from mpidp.parallel.pipeline_feed import fit_pipeline


def _data(comm, n=60, d=5):
    rng = np.random.default_rng(7)
    X, y = rng.normal(size=(n, d)), rng.integers(0, 3, n)
    lo, hi = n * comm.rank // comm.size, n * (comm.rank + 1) // comm.size
    return mpidp.shard_from_arrays(comm, X[lo:hi], y[lo:hi]), X, y


def _dp(comm):
    model = nn.mlp(5, (8,), 3, dtype=np.float64).init_(3)
    return mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm)


@pytest.mark.mpi(min_size=1)
def test_a_spec_and_the_same_keywords_train_the_same_model(comm):
    shard, _, _ = _data(comm)
    a, b = _dp(comm), _dp(comm)
    mpidp.fit(a, shard, 2, 16, seed=4, shuffle=False)
    mpidp.fit(b, shard, spec=mpidp.RunSpec(2, 16, seed=4, shuffle=False))
    all_ranks(comm, np.array_equal(a.model.params, b.model.params))


@pytest.mark.mpi(min_size=1)
def test_keywords_override_the_spec(comm):
    shard, _, _ = _data(comm)
    a, b = _dp(comm), _dp(comm)
    h = mpidp.fit(a, shard, 1, 16, seed=4)
    g = mpidp.fit(b, shard, spec=mpidp.RunSpec(3, 16, seed=9), epochs=1, seed=4)
    all_ranks(comm, len(h) == len(g) == 1 and np.array_equal(a.model.params, b.model.params))


@pytest.mark.mpi(min_size=1)
def test_a_plan_that_disagrees_with_the_run_is_refused(comm):
    shard, _, _ = _data(comm)
    dp = _dp(comm)
    plan = Plan(comm, None, shard.n_total, 16, 0, True, False)
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: mpidp.fit(dp, shard, 1, 16, seed=1, partition=plan),
                      "batch_size, seed, shuffle, drop_last")
    hist = mpidp.fit(dp, shard, 1, 16, seed=0, partition=plan)  # the same settings: fine
    all_ranks(comm, len(hist) == 1)


@pytest.mark.mpi(min_size=1)
def test_an_unknown_setting_is_a_type_error_on_every_rank(comm):
    shard, _, _ = _data(comm)
    raises_everywhere(comm, TypeError, lambda: mpidp.fit(_dp(comm), shard, 1, 16, sed=1),
                      "unknown run setting")


@pytest.mark.mpi(min_size=1)
def test_a_pipeline_refuses_a_partition(comm):
    _, X, y = _data(comm)
    layers = nn.mlp(5, (8, 8, 8), 3, dtype=np.float64).layers  # 7 layers: up to 4 stages
    pipe = Pipeline(layers, 5, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                    n_stages=comm.size, micro_batches=1, dtype=np.float64)
    pipe.init_(0)
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: fit_pipeline(pipe, (X, y), 1, 16, partition=mpidp.Partition("block")),
                      "partition does not apply to a pipeline")


@pytest.mark.mpi(min_size=2)
def test_the_asynchronous_server_refuses_what_it_cannot_honour(comm):
    from mpidp.parallel.async_ps import AsyncPS, fit_async
    shard, _, _ = _data(comm)
    model = nn.mlp(5, (8,), 3, dtype=np.float64).init_(3)
    ps = AsyncPS(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm)
    raises_everywhere(comm, mpidp.MpidpError, lambda: fit_async(ps, shard, 1, 16, check_every=2),
                      "check_every does not apply to async-ps")
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: fit_async(ps, shard, 1, 16, partition=mpidp.Partition("block")),
                      "partition does not apply to async-ps")


@pytest.mark.mpi(min_size=1)
def test_on_step_gets_the_global_step_across_epochs_and_a_resume(comm, shared_tmp):
    shard, _, _ = _data(comm)  # 60 samples, batch 16: 4 steps per epoch
    seen = []
    ck = mpidp.Checkpointing(shared_tmp, every=3)
    mpidp.fit(_dp(comm), shard, 2, 16, on_step=lambda step, s: seen.append(step), checkpoint=ck)
    all_ranks(comm, seen == list(range(1, 9)), str(seen))
    dp = _dp(comm)
    _, state = dp.restore(shared_tmp)  # the end of the run: 8 steps, 2 epochs
    later = []
    mpidp.fit(dp, shard, 3, 16, resume=state, on_step=lambda step, s: later.append(step))
    all_ranks(comm, later == [9, 10, 11, 12], str(later))


@pytest.mark.mpi(min_size=1)
def test_on_step_on_one_rank_stops_every_rank_after_the_next_step(comm, shared_tmp):
    """The last rank's callback asks after step 5: the request rides in step 6's Allreduce,
    every rank ends after step 6 with its history and a checkpoint, and nothing raises."""
    shard, _, _ = _data(comm)
    dp, calls = _dp(comm), []

    def on_step(step, stats):
        calls.append(step)
        return step == 5 and comm.rank == comm.size - 1

    ck = mpidp.Checkpointing(shared_tmp, every=100)
    hist = mpidp.fit(dp, shard, 5, 16, on_step=on_step, checkpoint=ck)
    all_ranks(comm, calls == [1, 2, 3, 4, 5, 6] and dp.global_step == 6, str(calls))
    all_ranks(comm, [h["epoch"] for h in hist] == [1, 2] and hist[-1].get("stopped_at") == 6
              and "stopped_at" not in hist[0], str(hist))
    all_ranks(comm, dp.in_sync())
    again = _dp(comm)
    _, state = again.restore(shared_tmp)
    all_ranks(comm, (state.global_step, state.epoch, state.step) == (6, 1, 2),
              str((state.global_step, state.epoch, state.step)))
    all_ranks(comm, np.array_equal(again.model.params, dp.model.params))


@pytest.mark.mpi(min_size=1)
def test_on_epoch_on_one_rank_stops_every_rank_at_that_epoch(comm):
    shard, _, _ = _data(comm)
    dp = _dp(comm)
    hist = mpidp.fit(dp, shard, 6, 16, on_epoch=lambda r: r["epoch"] == 2 and comm.rank == 0)
    all_ranks(comm, len(hist) == 2 and dp.global_step == 8, f"{len(hist)} {dp.global_step}")


@pytest.mark.mpi(min_size=1)
def test_a_pipeline_stops_on_a_callback_too(comm):
    _, X, y = _data(comm)
    layers = nn.mlp(5, (8, 8, 8), 3, dtype=np.float64).layers
    pipe = Pipeline(layers, 5, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                    n_stages=comm.size, micro_batches=1, dtype=np.float64)
    pipe.init_(0)
    hist = fit_pipeline(pipe, (X, y), 3, 16,
                        on_step=lambda step, s: step == 2 and comm.rank == 0)
    all_ranks(comm, pipe.global_step == 3 and hist[-1].get("stopped_at") == 3, str(hist))


@pytest.mark.mpi(min_size=2)
def test_the_asynchronous_server_refuses_callbacks_it_would_not_call(comm):
    from mpidp.parallel.async_ps import AsyncPS, fit_async
    shard, _, _ = _data(comm)
    model = nn.mlp(5, (8,), 3, dtype=np.float64).init_(3)
    ps = AsyncPS(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm)
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: fit_async(ps, shard, 1, 16, on_step=lambda step, s: None),
                      "on_step does not apply to async-ps")


@pytest.mark.mpi(min_size=1)
def test_a_plan_for_another_set_is_refused_on_every_rank(comm):
    shard, _, _ = _data(comm)
    plan = Plan(comm, mpidp.Partition("cyclic"), shard.n_total + 30, 16, 0, True, False)
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: mpidp.fit(_dp(comm), shard, 1, 16, partition=plan),
                      f"is for {shard.n_total + 30} samples but the training set has")


@pytest.mark.mpi(min_size=1)
def test_a_partition_of_the_wrong_type_is_named(comm):
    shard, _, _ = _data(comm)
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: mpidp.fit(_dp(comm), shard, 1, 16, partition="cyclic"),
                      "partition must be a mpidp.Partition")


@pytest.mark.mpi(min_size=2)
def test_a_plan_given_again_still_partitions_as_it_says(comm):
    """A second fit with the same Plan moves the given (as loaded) rows again, as a fresh
    partition does: same owners, so the same bits."""
    shard, _, _ = _data(comm)
    a, b = _dp(comm), _dp(comm)
    plan = Plan(comm, mpidp.Partition("cyclic"), shard.n_total, 16, 0, True, False)
    for _ in range(2):
        mpidp.fit(a, shard, 1, 16, partition=plan)
        mpidp.fit(b, shard, 1, 16, partition=mpidp.Partition("cyclic"))
    all_ranks(comm, np.array_equal(a.model.params, b.model.params),
              f"rank {comm.rank}: params differ by {np.abs(a.model.params - b.model.params).max()}")


@pytest.mark.mpi(min_size=1)
def test_a_resume_from_another_world_size_starts_the_capacities_afresh(comm):
    """A checkpoint written on another number of ranks holds one capacity per old rank."""
    from mpidp.run.checkpoint import State
    shard, _, _ = _data(comm)
    for strategy in ("adaptive", "cost"):
        state = State(0, 1, 1, [0.0, 0.0, 0.0], [], {},
                      {"strategy": strategy, "capacities": [1.0] * (comm.size + 1)})
        dp = _dp(comm)
        dp.global_step = 1
        hist = mpidp.fit(dp, shard, 1, 16, partition=mpidp.Partition(strategy), resume=state)
        all_ranks(comm, len(hist) == 1 and dp.global_step == 4, f"{strategy}: {hist}")


def _pipe(comm):
    layers = nn.mlp(5, (8, 8, 8), 3, dtype=np.float64).layers
    pipe = Pipeline(layers, 5, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                    n_stages=comm.size, micro_batches=1, dtype=np.float64)
    return pipe.init_(0)


@pytest.mark.mpi(min_size=2)
def test_a_pipeline_refuses_sets_that_differ_between_ranks(comm):
    _, X, y = _data(comm)
    m = len(y) - comm.rank  # rank r holds r rows fewer: the stages would cut other batches
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: fit_pipeline(_pipe(comm), (X[:m], y[:m]), 1, 16),
                      "the train set has")
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: fit_pipeline(_pipe(comm), (X, y), 1, 16, test=(X[:m], y[:m])),
                      "the test set has")


@pytest.mark.mpi(min_size=1)
def test_a_pipeline_names_sets_it_cannot_use(comm):
    shard, X, y = _data(comm)
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: fit_pipeline(_pipe(comm), (X[:50], y), 1, 16),
                      "train: X has 50 rows but y has 60")
    raises_everywhere(comm, mpidp.MpidpError, lambda: fit_pipeline(_pipe(comm), shard, 1, 16),
                      "train must be a tuple (X, y)")
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: fit_pipeline(_pipe(comm), (X, y), 1, 16, test=(None, y)),
                      "test must be a tuple (X, y)")
    hist = fit_pipeline(_pipe(comm), (X, y), 1, 16, test=(X, None))  # (X, None): no test set
    all_ranks(comm, "test_loss" not in hist[-1], str(hist))


@pytest.mark.mpi(min_size=2)
def test_a_slow_pipeline_stage_is_slow_in_every_step(comm, monkeypatch):
    """A pipeline step's forward and backward are per-sample work: ``slowdown`` stretches
    them in every step (and the step's row is closed), never the update. The timer's
    sleeps are recorded per step, asked and taken: each asks 3x a piece of forward/backward
    work (slowdown 4), and the step's compute column holds that work and the sleep taken,
    so what was asked is at most 3x the column less the sleep; a stretched update (timed
    in its own column) asks more. No wall-clock threshold: a busy machine cannot fail it."""
    _, X, y = _data(comm)
    layers = nn.mlp(5, (64, 64, 64), 3, dtype=np.float64).layers
    pipe = Pipeline(layers, 5, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                    n_stages=comm.size, micro_batches=2, dtype=np.float64)
    pipe.init_(0)
    slow = comm.rank == comm.size - 1
    pipe.timer.slowdown = 4.0 if slow else 1.0
    asked, slept = record_timer_sleeps(monkeypatch, 8, lambda: min(pipe.timer.steps, 7))
    rows = []
    fit_pipeline(pipe, (X, y), 2, 16, on_step=lambda step, s: rows.append(pipe.timer.recent(1)))
    rows = np.concatenate(rows)
    compute = rows[:, 1]
    all_ranks(comm, len(rows) == 8 and bool(np.all(compute > 0)), f"rows {rows}")
    stretched = bool(np.all(asked > 0) and np.all(asked <= 3 * (compute - slept)))
    all_ranks(comm, stretched if slow else not asked.any(),
              f"asked {asked} slept {slept} compute {compute}")
