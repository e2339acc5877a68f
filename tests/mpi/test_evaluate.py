"""``DataParallel.evaluate`` over uneven shards (an empty rank from 3 ranks on) gives the
figures of one process on all the rows, computed here with plain NumPy (float64)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_helpers import all_ranks

import mpidp
from mpidp import nn

N, D, K = 41, 6, 4
TOL = 1e-12


def _rows(comm, n: int = N) -> slice:
    """This rank's rows of ``n``: uneven shares, growing with the rank, rank 1 empty from
    3 ranks on."""
    weights = np.arange(1, comm.size + 1, dtype=np.float64) ** 2
    if comm.size >= 3:
        weights[1] = 0
    counts = np.floor(n * weights / weights.sum()).astype(np.int64)
    counts[0] += n - counts.sum()
    stops = np.cumsum(counts)
    return slice(int(stops[comm.rank] - counts[comm.rank]), int(stops[comm.rank]))


def _model(n_out: int) -> nn.Sequential:
    return nn.Sequential([nn.Dense(D, 9), nn.ReLU(), nn.Dense(9, n_out)], D,
                         np.float64).init_(np.random.default_rng(7))


def _forward(model: nn.Sequential, X: np.ndarray) -> np.ndarray:
    """The model's outputs, from its parameters with NumPy alone."""
    first, last = model.layers[0].params, model.layers[2].params
    hidden = np.maximum(X @ first["W"] + first["b"], 0.0)
    return hidden @ last["W"] + last["b"]


def _check(comm, ev, loss: float, accuracy: float | None) -> None:
    all_ranks(comm, ev.count == N, f"count {ev.count}, expected {N}")
    all_ranks(comm, abs(ev.loss - loss) <= TOL * max(1.0, abs(loss)),
              f"loss {ev.loss!r}, expected {loss!r}")
    if accuracy is not None:
        all_ranks(comm, abs(ev.accuracy - accuracy) <= TOL,
                  f"accuracy {ev.accuracy!r}, expected {accuracy!r}")
    got = comm.allgather((ev.loss_sum, ev.count, ev.correct))
    all_ranks(comm, all(g == got[0] for g in got), f"ranks disagree: {got}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("batch_size", [4096, 3])
def test_classification_loss_and_accuracy_are_the_means_over_all_rows(comm, batch_size):
    rng = np.random.default_rng(1)  # the same rows on every rank
    X, y = rng.standard_normal((N, D)), rng.integers(0, K, N)
    model = _model(K)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm)
    mine = _rows(comm)
    ev = dp.evaluate(X[mine], y[mine], batch_size=batch_size)
    z = _forward(model, X)
    top = z.max(axis=1)
    per_row = top + np.log(np.exp(z - top[:, None]).sum(axis=1)) - z[np.arange(N), y]
    accuracy = float(np.mean(z.argmax(axis=1) == y))
    assert 0.0 < accuracy < 1.0  # a figure that a lost or doubled row would change
    _check(comm, ev, float(per_row.mean()), accuracy)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("batch_size", [4096, 3])
def test_regression_loss_is_the_mean_squared_error_over_all_rows(comm, batch_size):
    rng = np.random.default_rng(2)
    X, y = rng.standard_normal((N, D)), rng.standard_normal((N, 2))
    model = _model(2)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.MeanSquaredError(), comm)
    mine = _rows(comm)
    ev = dp.evaluate(X[mine], y[mine], batch_size=batch_size)
    err = _forward(model, X) - y
    loss = float(np.mean(err ** 2))  # per row the mean over the outputs, then over the rows
    _check(comm, ev, loss, None)
    mse, mae = ev.scores["mse"], ev.scores["mae"]
    all_ranks(comm, ev.scores["count"] == N and abs(mse - loss) <= TOL * loss and
              abs(mae - float(np.mean(np.abs(err)))) <= TOL, f"scores {ev.scores}")


@pytest.mark.mpi(min_size=1)
def test_a_least_squares_classifier_is_scored_as_a_classifier(comm):
    """Mean squared error on integer labels (one-hot targets, the ``linear`` preset): the
    loss against the one-hot rows and the classifier's scores, not a regression's."""
    rng = np.random.default_rng(3)
    X, y = rng.standard_normal((N, D)), rng.integers(0, K, N)
    model = _model(K)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.MeanSquaredError(), comm)
    mine = _rows(comm)
    ev = dp.evaluate(X[mine], y[mine], batch_size=5)
    z = _forward(model, X)
    accuracy = float(np.mean(z.argmax(axis=1) == y))
    assert 0.0 < accuracy < 1.0
    _check(comm, ev, float(np.mean((z - np.eye(K)[y]) ** 2)), accuracy)
    all_ranks(comm, ev.scores["count"] == N and ev.scores["accuracy"] == accuracy
              and "mse" not in ev.scores, f"scores {ev.scores}")


@pytest.mark.mpi(min_size=2)
def test_labels_of_two_kinds_across_ranks_are_refused_on_every_rank(comm):
    model = _model(K)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.MeanSquaredError(), comm)
    X = np.zeros((3, D))
    y = np.zeros(3, np.int64) if comm.rank == 0 else np.zeros((3, K))
    with pytest.raises(mpidp.MpidpError, match="integer class labels, others real targets"):
        dp.evaluate(X, y)


@pytest.mark.mpi(min_size=3)
def test_the_shards_are_uneven_with_an_empty_rank(comm):
    sizes = comm.allgather(_rows(comm).stop - _rows(comm).start)
    all_ranks(comm, sum(sizes) == N and sizes[1] == 0 and len(set(sizes)) == len(sizes),
              f"shard sizes {sizes}")
