"""The scikit-learn estimators in one process: scikit-learn's own estimator checks, model
selection (Pipeline, GridSearchCV, cross_val_score), parameters, and the saved model."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.datasets import load_iris
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import GridSearchCV, cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from sklearn.utils.estimator_checks import parametrize_with_checks

import mpidp
from mpidp import nn
from mpidp.parallel.sklearn import MLPClassifier, MLPRegressor

pytestmark = pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")


@parametrize_with_checks([MLPClassifier(random_state=0, learning_rate_init=0.01),
                          MLPRegressor(random_state=0, learning_rate_init=0.01)])
def test_scikit_learn_estimator_checks(estimator, check):
    check(estimator)


def _iris():
    X, y = load_iris(return_X_y=True)
    return X, np.array(["setosa", "versicolor", "virginica"])[y]


def test_grid_search_in_a_pipeline_picks_and_refits_a_classifier():
    X, y = _iris()
    pipe = make_pipeline(StandardScaler(), MLPClassifier(max_iter=60, random_state=0))
    grid = {"mlpclassifier__hidden_layer_sizes": [(4,), (16,)],
            "mlpclassifier__learning_rate_init": [0.001, 0.02]}
    search = GridSearchCV(pipe, grid, cv=3).fit(X, y)
    assert search.best_params_["mlpclassifier__learning_rate_init"] == 0.02
    assert search.score(X, y) > 0.9
    assert set(search.predict(X)) <= set(y)


def test_cross_val_score_and_the_same_seed_give_the_same_model():
    X, y = _iris()
    scores = cross_val_score(MLPClassifier((8,), learning_rate_init=0.02, max_iter=80,
                                           random_state=0), X, y, cv=3)
    assert scores.shape == (3,) and scores.min() > 0.6
    a, b = (MLPClassifier((8,), max_iter=5, random_state=3).fit(X, y) for _ in range(2))
    assert np.array_equal(a.predict_proba(X), b.predict_proba(X))


def test_parameters_follow_scikit_learn():
    model = MLPClassifier(hidden_layer_sizes=(3, 2), batch_size=8, early_stopping=True)
    params = model.get_params()
    for name in ("hidden_layer_sizes", "learning_rate_init", "batch_size", "max_iter",
                 "early_stopping", "validation_fraction", "random_state", "alpha", "solver"):
        assert name in params
    assert clone(model.set_params(max_iter=7)).get_params()["max_iter"] == 7
    with pytest.raises(ValueError, match="solver must be one of"):
        MLPClassifier(solver="lbfgs").fit(*_iris())


def test_early_stopping_keeps_the_best_validation_model():
    X, y = _iris()
    model = MLPClassifier((8,), learning_rate_init=0.05, max_iter=300, early_stopping=True,
                          n_iter_no_change=5, random_state=0).fit(X, y)
    assert model.n_iter_ < 300 and len(model.validation_scores_) == model.n_iter_
    assert model.best_validation_score_ == max(model.validation_scores_)


def test_partial_fit_trains_one_epoch_a_call():
    X, y = _iris()
    model = MLPClassifier((8,), batch_size=50, random_state=0)
    with pytest.raises(ValueError, match="classes must be passed"):
        model.partial_fit(X, y)
    for _ in range(3):
        model.partial_fit(X, y, classes=np.unique(y))
    assert model.n_iter_ == 3 and len(model.loss_curve_) == 3 and model.t_ == 3 * len(X)


def test_a_fitted_estimator_saves_pickles_and_exports(tmp_path):
    X, y = _iris()
    model = MLPClassifier((8,), max_iter=20, random_state=0).fit(X, y)
    path = model.save(tmp_path / "model.npz")
    saved = nn.load(path)
    assert saved.meta["classes"] == list(model.classes_)
    assert np.array_equal(saved.predict(X, "proba"), model.predict_proba(X))
    again = pickle.loads(pickle.dumps(model))
    assert np.array_equal(again.predict_proba(X), model.predict_proba(X))
    again.partial_fit(X, y)  # its parameters are still one vector the optimizer updates
    assert not np.array_equal(again.predict_proba(X), model.predict_proba(X))
    pytest.importorskip("onnx")
    assert model.export_onnx(tmp_path / "model.onnx").endswith("model.onnx")


def test_a_regressor_predicts_the_shape_of_its_targets():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(80, 3))
    y = X @ np.array([1.0, -1.0, 2.0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        flat = MLPRegressor((16,), learning_rate_init=0.01, max_iter=200, random_state=0)
        wide = clone(flat).fit(X, np.c_[y, -y])
    assert flat.fit(X, y).predict(X).shape == (80,) and flat.score(X, y) > 0.9
    assert wide.predict(X).shape == (80, 2)


def test_the_short_name_is_the_module():
    assert mpidp.sklearn.MLPClassifier is MLPClassifier
