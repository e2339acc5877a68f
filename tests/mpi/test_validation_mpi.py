"""Validation figures, early stopping and the plateau rule decided from global figures:
the same epochs, decisions and model at 1-4 ranks, whatever rows each rank holds."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import all_ranks

import mpidp
from mpidp import nn
from mpidp.run.early_stopping import EarlyStopping, ReduceOnPlateau

N_TRAIN, N_VAL = 203, 47


def _uneven(n: int, size: int, rank: int) -> slice:
    """This rank's rows: uneven, and rank 1 holds none from 3 ranks on."""
    w = np.arange(1, size + 1, dtype=np.float64)
    if size >= 3:
        w[1] = 0.0
    edges = np.concatenate([[0], np.floor(np.cumsum(w) / w.sum() * n).astype(int)])
    edges[-1] = n
    return slice(int(edges[rank]), int(edges[rank + 1]))


def _fit(comm, regression: bool = False):
    rng = np.random.default_rng(4)
    X = rng.standard_normal((N_TRAIN + N_VAL, 6))
    y = X @ rng.standard_normal((6, 1)) + 0.3 * rng.standard_normal((N_TRAIN + N_VAL, 1)) \
        if regression else (X[:, 0] + 0.5 * rng.standard_normal(N_TRAIN + N_VAL) > 0).astype(np.int64)
    tr, va = _uneven(N_TRAIN, comm.size, comm.rank), _uneven(N_VAL, comm.size, comm.rank)
    train = mpidp.shard_from_arrays(comm, X[:N_TRAIN][tr], y[:N_TRAIN][tr])
    val = mpidp.shard_from_arrays(comm, X[N_TRAIN:][va], y[N_TRAIN:][va])
    model, loss = nn.build("mlp", 6, 1 if regression else 2, (32,), np.float64,
                           classification=not regression)
    model.init_(1)
    dp = mpidp.DataParallel(model, nn.make_optimizer("momentum", 0.01 if regression else 0.2),
                            loss, comm)
    history = mpidp.fit(dp, train, 60, 16, seed=3, test={"val": val},
                        early_stopping=EarlyStopping(3, min_delta=1e-4),
                        plateau=ReduceOnPlateau(0.5, patience=1))
    return dp, history


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("regression", [False, True], ids=["classification", "regression"])
def test_early_stopping_and_the_plateau_rule_decide_the_same_at_any_number_of_ranks(
        comm, regression):
    ref, ref_h = _fit(MPI.COMM_SELF, regression)
    dp, h = _fit(comm, regression)
    all_ranks(comm, len(h) == len(ref_h) < 60, f"stopped after {len(h)}, not {len(ref_h)}")
    for a, b in zip(h, ref_h):
        all_ranks(comm, abs(a["val_loss"] - b["val_loss"]) <= 1e-10
                  and a["lr_scale"] == b["lr_scale"] and a["improved"] == b["improved"],
                  f"epoch {a['epoch']}: {a} vs {b}")
    key = "val_r2" if regression else "val_f1_macro"
    all_ranks(comm, abs(h[-1][key] - ref_h[-1][key]) <= 1e-10, f"{key} differs")
    err = float(np.max(np.abs(dp.model.params - ref.model.params)))
    all_ranks(comm, err <= 1e-10, f"parameters differ by {err:.3g}")
    all_ranks(comm, min(r["lr_scale"] for r in h) < 1.0, "the plateau rule never acted")


@pytest.mark.mpi(min_size=2)
def test_a_monitor_the_epoch_does_not_report_is_one_error_on_every_rank(comm):
    from mpi_helpers import raises_everywhere
    model, loss = nn.build("logreg", 4, 2, dtype=np.float64)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), loss, comm)
    X = np.random.default_rng(comm.rank).standard_normal((10, 4))
    shard = mpidp.shard_from_arrays(comm, X, (X[:, 0] > 0).astype(np.int64))
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.fit(
        dp, shard, 2, 8, early_stopping=EarlyStopping(2)), "which the epoch does not report")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("labels, message", [
    (lambda y, r: y[:, None], "class labels must be integers of shape (n,), got int64 of "
                              "shape (6, 1): flatten them"),
    (lambda y, r: y.astype(bool), "class labels must be integers of shape (n,), got bool"),
    (lambda y, r: y.astype(np.float64), "class labels must be integers of shape (n,), got float64"),
    (lambda y, r: np.where(np.arange(6) == 5, 3, y), "label 3 is outside the model's 3 "
                                                         "classes (0 to 2)"),
])
def test_labels_a_loss_cannot_take_are_refused_on_every_rank_before_training(comm, labels,
                                                                              message):
    """(n, 1) labels broadcast into an (n, n) block and bool labels act as a mask, silently
    wrong; float labels and an out-of-range label on one rank failed on that rank only."""
    rng = np.random.default_rng(comm.rank)
    X, y = rng.standard_normal((6, 4)), rng.integers(0, 3, 6)
    y = labels(y, comm.rank) if comm.rank == comm.size - 1 or message[0] == "c" else y
    model = nn.mlp(4, (5,), 3, dtype=np.float64).init_(0)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm)
    shard = mpidp.shard_from_arrays(comm, X, y)
    before = model.params.copy()
    try:
        mpidp.fit(dp, shard, 1, 4)
        err = None
    except mpidp.MpidpError as exc:
        err = str(exc)
    all_ranks(comm, err is not None and message in err, f"got {err!r}")
    all_ranks(comm, np.array_equal(model.params, before), "trained before refusing")


@pytest.mark.mpi(min_size=1)
def test_fit_with_nothing_to_train_on_or_no_shard_is_refused_on_every_rank(comm):
    """An all-empty training set, or drop_last with a batch larger than the set, used to
    return a history of NaN with no step taken; arrays in place of shards failed deep in."""
    model = nn.mlp(4, (5,), 3, dtype=np.float64).init_(0)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm)
    empty = mpidp.shard_from_arrays(comm, np.zeros((0, 4)), np.zeros(0, np.int64))
    rng = np.random.default_rng(comm.rank)
    some = mpidp.shard_from_arrays(comm, rng.standard_normal((3, 4)), rng.integers(0, 3, 3))
    cases = [(lambda: mpidp.fit(dp, empty, 1, 4), "the training set is empty on every rank"),
             (lambda: mpidp.fit(dp, some, 1, 3 * comm.size + 1, drop_last=True),
              f"drops all {3 * comm.size} samples"),
             (lambda: mpidp.fit(dp, (some.X, some.y), 1, 4), "train must be a mpidp.Shard"),
             (lambda: mpidp.fit(dp, some, 1, 4, test=some.X), "test must be a mpidp.Shard"),
             (lambda: dp.evaluate(some.X, some.y, batch_size=0), "batch_size must be a whole"),
             (lambda: dp.evaluate(some.X, some.y, batch_size=2.5), "batch_size must be a whole")]
    for call, message in cases:
        try:
            call()
            err = None
        except mpidp.MpidpError as exc:
            err = str(exc)
        all_ranks(comm, err is not None and message in err, f"{message!r}: got {err!r}")
    all_ranks(comm, dp.global_step == 0, f"{dp.global_step} steps taken")
