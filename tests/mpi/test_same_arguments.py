"""Arguments that differ between ranks are refused on every rank, naming what differs and
where, before any collective could pair with a different one (and hang)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import raises_everywhere

import mpidp
from mpidp import nn


def _shard(comm, n=64, d=4):
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((n, d)), rng.integers(0, 3, n)
    rows = np.array_split(np.arange(n), comm.size)[comm.rank]
    return mpidp.shard_from_arrays(comm, X[rows], y[rows])


def _dp(comm, act="relu", lr=0.1, sync="allreduce"):
    model = nn.mlp(4, (6,), 3, activation=act, dtype=np.float64).init_(0)
    return mpidp.DataParallel(model, nn.SGD(lr), nn.SoftmaxCrossEntropy(), comm, sync=sync)


@pytest.mark.mpi(min_size=2)
def test_fit_with_a_batch_size_per_rank(comm):
    dp, shard = _dp(comm), _shard(comm)
    err = raises_everywhere(comm, mpidp.MpidpError,
                            lambda: mpidp.fit(dp, shard, 1, 32 if comm.rank == 0 else 16),
                            "every rank must pass the same arguments")
    assert "batch_size is 32 on rank 0, 16 on ranks" in str(err) or \
        "batch_size is 32 on rank 0, 16 on rank 1" in str(err), err


@pytest.mark.mpi(min_size=2)
def test_fit_with_a_seed_per_rank(comm):
    dp, shard = _dp(comm), _shard(comm)
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.fit(dp, shard, 1, 8, seed=comm.rank),
                      "seed is 0 on rank 0, 1 on rank 1")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("what,kw", [("model", {"act": "tanh"}), ("optimizer", {"lr": 0.2}),
                                     ("sync", {"sync": "per-layer"})])
def test_a_trainer_built_differently_on_one_rank(comm, what, kw):
    raises_everywhere(comm, mpidp.MpidpError, lambda: _dp(comm, **(kw if comm.rank else {})),
                      f"DataParallel: every rank must pass the same arguments, but {what} is")


@pytest.mark.mpi(min_size=2)
def test_load_with_n_samples_per_rank(comm):
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.load(
        comm, "synthetic", n_samples=100 + comm.rank, n_features=4), "n_samples is 100 on rank 0")


@pytest.mark.mpi(min_size=2)
def test_map_reduce_with_rows_per_rank(comm):
    data = np.ones((10 + comm.rank, 3))
    raises_everywhere(comm, mpidp.MpidpError,
                      lambda: mpidp.map_reduce(comm, lambda x: x.sum(axis=1), data),
                      "rows is 10 on rank 0, 11 on rank 1")


@pytest.mark.mpi(min_size=2)
def test_a_callback_on_one_rank_only(comm):
    """``on_epoch`` adds one agreement per epoch: given on one rank only, it would pair that
    rank's agreement with the others' next step."""
    dp, shard = _dp(comm), _shard(comm)
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.fit(
        dp, shard, 1, 8, on_epoch=(lambda r: None) if comm.rank == 0 else None),
        "on_epoch is 'given' on rank 0, 'not given' on rank")


@pytest.mark.mpi(min_size=1)
def test_equal_arguments_train_as_before(comm):
    dp, shard = _dp(comm), _shard(comm)
    hist = mpidp.fit(dp, shard, 2, 8, seed=3)
    ref = _dp(MPI.COMM_SELF)
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((64, 4)), rng.integers(0, 3, 64)
    ref_hist = mpidp.fit(ref, mpidp.shard_from_arrays(MPI.COMM_SELF, X, y), 2, 8, seed=3)
    assert abs(hist[-1]["loss"] - ref_hist[-1]["loss"]) < 1e-9


@pytest.mark.mpi(min_size=1)
def test_the_library_watches_a_run_by_default_as_the_command_line_does(comm):
    from mpidp.run.loop import watched_run
    from mpidp.run.spec import RunSpec
    with watched_run(RunSpec(1, 8), comm) as spec:  # the default: "auto"
        dog = spec.watchdog
        assert isinstance(dog, mpidp.comm.Watchdog) and dog.auto and dog.timeout == 600
    assert dog.side == MPI.COMM_NULL  # closed at the end of the run
    with watched_run(RunSpec(1, 8, watchdog=2.5), comm) as spec:
        assert spec.watchdog.timeout == 2.5 and not spec.watchdog.auto
    for off in (0, False, None):
        with watched_run(RunSpec(1, 8, watchdog=off), comm) as spec:
            assert spec.watchdog is None
    with pytest.raises(mpidp.MpidpError, match="watchdog must be"):
        RunSpec(1, 8, watchdog="sometimes")



@pytest.mark.mpi(min_size=2)
def test_an_optimizer_whose_state_differs_between_ranks_is_refused(comm):
    """After a parameter server run only the server's optimizer holds the moments: reusing
    it for a replicated trainer made the replicas drift apart with no error."""
    optimizer = nn.Adam(0.01)
    with mpidp.DataParallel(nn.mlp(4, (6,), 3, dtype=np.float64).init_(0), optimizer,
                            nn.SoftmaxCrossEntropy(), comm, sync="ps") as dp:
        mpidp.fit(dp, _shard(comm), 1, 8)
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.DataParallel(
        dp.model, optimizer, nn.SoftmaxCrossEntropy(), comm), "optimizer state is")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("change, message", [
    ({"loss": nn.SoftmaxCrossEntropy}, "loss must be a loss such as"),
    ({"optimizer": None}, "optimizer must be an optimizer such as"),
    ({"model": nn.Dense(4, 3)}, "model must be a model such as"),
    ({"sync": 5}, "sync must be a strategy's name"),
    ({"root": 99}, "root must be a rank of the communicator"),
    ({"check_every": 1.5}, "check_every must be a whole number"),
])
def test_arguments_of_the_wrong_kind_name_themselves(comm, change, message):
    """They used to end in an AttributeError or TypeError from deep inside."""
    kw = {"model": nn.mlp(4, (6,), 3, dtype=np.float64).init_(0), "optimizer": nn.SGD(0.1),
          "loss": nn.SoftmaxCrossEntropy(), **change}
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.DataParallel(comm=comm, **kw),
                      message)


@pytest.mark.mpi(min_size=2)
def test_long_values_that_differ_late_name_the_field_and_each_rank_value(comm):
    from mpidp.comm.agreement import agree_same

    spec = f"Plan(capacities={[1.0] * 30}, seed={comm.rank}, shuffle=True)"
    err = raises_everywhere(comm, mpidp.MpidpError,
                            lambda: agree_same(comm, "fit", {"partition": spec}),
                            "every rank must pass the same arguments")
    msg = str(err)
    assert "partition is ...seed=0, shuffle=True)' on rank 0, ...seed=1, shuffle=True)' on " \
           "rank" in msg and msg.endswith("(they differ first at its field seed)"), msg
    assert "on ranks [0" not in msg, msg


@pytest.mark.mpi(min_size=2)
def test_a_test_set_on_one_rank_only(comm):
    """Ranks passing different arguments by name (not only by value) used to end in an MPICH
    assertion: their digest buffers had different lengths."""
    dp, shard = _dp(comm), _shard(comm)
    test = _shard(comm, n=32)
    err = raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.fit(
        dp, shard, 1, 8, test=test if comm.rank == 0 else None), "fit: every rank must pass "
        "the same arguments, but test rows is 32 on rank 0, not passed on rank")
    assert "test is not passed on rank 0, None on rank" in str(err), err
