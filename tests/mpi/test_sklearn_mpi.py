"""The scikit-learn estimators under mpiexec: the same script on every rank fits, data
parallel, the model one process fits (float64, to 1e-10), inside GridSearchCV too."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import all_ranks, raises_everywhere
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import GridSearchCV

import mpidp
from mpidp import comm as C
from mpidp.parallel.sklearn import MLPClassifier, MLPRegressor

pytestmark = [pytest.mark.mpi(min_size=1),
              pytest.mark.filterwarnings("ignore", category=ConvergenceWarning)]


def _data(n=90, d=4, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, d))
    return X, np.array(["a", "b", "c"])[(X[:, 0] + X[:, 1] > 0).astype(int) + (X[:, 2] > 1)]


def _alone(monkeypatch, make):
    """What ``make()`` gives in a world of this rank alone: the one-process result."""
    with monkeypatch.context() as m:
        m.setattr(C, "world", lambda: MPI.COMM_SELF)
        return make()


def _same(comm, a, b, what):
    diff = max(float(np.max(np.abs(p - q))) for p, q in zip(a.coefs_ + a.intercepts_,
                                                           b.coefs_ + b.intercepts_))
    all_ranks(comm, diff <= 1e-10, f"rank {comm.rank}: {what} differs by {diff}")


def test_grid_search_over_the_ranks_fits_the_one_process_model(comm, monkeypatch):
    X, y = _data()

    def search():
        grid = {"hidden_layer_sizes": [(6,), (8, 4)], "learning_rate_init": [0.01, 0.03]}
        return GridSearchCV(MLPClassifier(max_iter=15, batch_size=16, random_state=1), grid,
                            cv=3).fit(X, y)

    ours, alone = search(), _alone(monkeypatch, search)
    scores = np.abs(ours.cv_results_["mean_test_score"] - alone.cv_results_["mean_test_score"])
    all_ranks(comm, ours.best_params_ == alone.best_params_ and scores.max() <= 1e-10,
              f"{ours.best_params_} vs {alone.best_params_}")
    _same(comm, ours.best_estimator_, alone.best_estimator_, "the best estimator")
    proba = ours.predict_proba(X)
    all_ranks(comm, np.abs(proba - alone.predict_proba(X)).max() <= 1e-10)


@pytest.mark.parametrize("settings", [{"solver": "sgd", "alpha": 0.01},
                                      {"early_stopping": True, "activation": "tanh"}])
def test_a_regressor_fits_the_one_process_model(comm, monkeypatch, settings):
    X, _ = _data(seed=2)
    y = X @ np.array([1.0, -2.0, 0.5, 0.0]) + np.sin(X[:, 0])
    make = lambda: MLPRegressor((7,), max_iter=12, batch_size=20, random_state=3,
                                **settings).fit(X, y)
    ours, alone = make(), _alone(monkeypatch, make)
    all_ranks(comm, ours.n_iter_ == alone.n_iter_
              and np.allclose(ours.loss_curve_, alone.loss_curve_, rtol=0, atol=1e-10))
    _same(comm, ours, alone, "the regressor")


def test_partial_fit_over_the_ranks_is_the_one_process_one(comm, monkeypatch):
    X, y = _data(seed=4)

    def make():
        model = MLPClassifier((5,), batch_size=32, random_state=0)
        for _ in range(3):
            model.partial_fit(X, y, classes=["a", "b", "c"])
        return model

    _same(comm, make(), _alone(monkeypatch, make), "partial_fit")


@pytest.mark.mpi(min_size=2)
def test_different_data_on_the_ranks_is_refused_on_every_rank(comm):
    X, y = _data()
    X = X + (comm.rank == 1)
    raises_everywhere(comm, mpidp.MpidpError, lambda: MLPClassifier(max_iter=1).fit(X, y),
                      "the digest of X is")
