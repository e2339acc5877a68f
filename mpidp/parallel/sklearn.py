"""scikit-learn estimators trained by mpidp: :class:`MLPClassifier` and :class:`MLPRegressor`,
with the parameters of scikit-learn's estimators of those names where the concepts match.

Under ``mpiexec``, with the whole ``X, y`` on every rank, ``fit`` and ``partial_fit`` are
collective and train data-parallel (each rank its block of rows): the one-process fit up
to summation order. Predicting is local."""

from __future__ import annotations

import warnings

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, RegressorMixin
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import accuracy_score, r2_score
from sklearn.model_selection import train_test_split
from sklearn.utils import check_random_state, column_or_1d
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, validate_data

from .. import comm as C
from .. import nn
from ..digest import checksum
from .data_feed import fit as fit_data_parallel
from .data_parallel import DataParallel
from .elastic import whole_arrays

#: scikit-learn's activation names -> the layer after each hidden ``Dense`` (None: none).
ACTIVATIONS = {"identity": None, "logistic": nn.Sigmoid, "tanh": nn.Tanh, "relu": nn.ReLU}
SOLVERS = ("adam", "sgd")
#: scikit-learn's ``batch_size`` that means ``min(200, n_samples)``.
AUTO_BATCH = "auto"


class _MLP(BaseEstimator):
    """What the classifier and the regressor share: the model, its training and its file."""

    _loss: type[nn.Loss]
    _output = "scores"

    def __init__(self, hidden_layer_sizes=(100,), activation="relu", *, solver="adam",
                 alpha=0.0001, batch_size="auto", learning_rate_init=0.001, max_iter=200,
                 shuffle=True, random_state=None, tol=1e-4, warm_start=False, momentum=0.9,
                 nesterovs_momentum=True, early_stopping=False, validation_fraction=0.1,
                 beta_1=0.9, beta_2=0.999, epsilon=1e-8, n_iter_no_change=10, dtype="float64"):
        self.hidden_layer_sizes, self.activation = hidden_layer_sizes, activation
        self.solver, self.alpha, self.batch_size = solver, alpha, batch_size
        self.learning_rate_init, self.max_iter, self.shuffle = learning_rate_init, max_iter, shuffle
        self.random_state, self.tol, self.warm_start = random_state, tol, warm_start
        self.momentum, self.nesterovs_momentum = momentum, nesterovs_momentum
        self.early_stopping, self.validation_fraction = early_stopping, validation_fraction
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon
        self.n_iter_no_change, self.dtype = n_iter_no_change, dtype

    # ---------------------------------------------------------------- training

    def fit(self, X, y):
        """Train for up to ``max_iter`` epochs (stopping as scikit-learn's MLP does: after
        ``n_iter_no_change`` epochs without a ``tol`` improvement of the training loss, or
        of the validation score with ``early_stopping``). Collective. Returns self."""
        return self._fit(X, y, incremental=False)

    def _fit(self, X, y, incremental: bool, classes=None):
        self._check_settings()
        fresh = not hasattr(self, "model_") or not (incremental or self.warm_start)
        X, y = validate_data(self, X, y, reset=fresh, dtype=[np.float64, np.float32],
                             multi_output=not self._loss.classification,
                             y_numeric=not self._loss.classification)
        y = self._targets(y, fresh, classes)
        comm = C.world()
        C.agree_same(comm, f"{type(self).__name__}.fit (each rank passes the whole data)", {
            "the digest of X": checksum(X), "the digest of y": checksum(y),
            "classes": repr(self._meta())})
        seed = int(C.bcast_obj(comm, check_random_state(self.random_state).randint(2**31 - 1)))
        if fresh:
            self._start(X.shape[1], y, seed)
        X = np.asarray(X, self.dtype)
        X_val = y_val = None
        if self.early_stopping and not incremental:
            X, X_val, y, y_val = train_test_split(X, y, random_state=seed,
                                                  stratify=y if self._loss.classification else None,
                                                  test_size=self.validation_fraction)
        batch = min(200 if self.batch_size == AUTO_BATCH else self.batch_size, len(X))
        shard = whole_arrays(comm, (X, y), None)[0]  # this rank's block of rows
        self._stopped, n_train = False, len(X)
        self._optimizer.weight_decay = self.alpha / batch  # sklearn's L2 term, per batch
        dp = DataParallel(self.model_, self._optimizer, self._loss(), comm,
                          abort_on_error=comm.size > 1)
        epochs = 1 if incremental else self.max_iter
        try:
            history = fit_data_parallel(
                dp, shard, epochs, batch, seed=seed + self.n_iter_, shuffle=self.shuffle,
                watchdog=None if comm.size > 1 else 0,
                on_epoch=lambda record: self._epoch_done(record, dp, n_train, X_val, y_val))
        finally:
            dp.close()
            self.model_.set_context(nn.Context())  # nothing of the run stays in the model
        if X_val is not None and self._best_params is not None:
            self.model_.params[...] = self._best_params
        self._best_params = None
        if not incremental and len(history) == epochs and not self._stopped:
            warnings.warn(f"Stochastic Optimizer: Maximum iterations ({self.max_iter}) "
                          f"reached and the optimization hasn't converged yet.",
                          ConvergenceWarning, stacklevel=3)
        return self

    def _check_settings(self) -> None:
        def count(v) -> bool:
            return isinstance(v, (int, np.integer)) and v > 0

        problems = [
            (not all(count(s) for s in self._hidden()),
             f"hidden_layer_sizes must be positive integers, got {self.hidden_layer_sizes!r}"),
            (self.activation not in ACTIVATIONS,
             f"activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}"),
            (self.solver not in SOLVERS, f"solver must be one of {SOLVERS}, got {self.solver!r}"),
            (not (self.batch_size == AUTO_BATCH or count(self.batch_size)),
             f"batch_size must be 'auto' or a positive integer, got {self.batch_size!r}"),
            (not count(self.max_iter),
             f"max_iter must be a positive integer, got {self.max_iter!r}"),
            (not self.learning_rate_init > 0,
             f"learning_rate_init must be > 0, got {self.learning_rate_init!r}"),
            (not self.alpha >= 0, f"alpha must be >= 0, got {self.alpha!r}"),
            (not 0 < self.validation_fraction < 1,
             f"validation_fraction must be in (0, 1), got {self.validation_fraction!r}"),
            (not count(self.n_iter_no_change),
             f"n_iter_no_change must be a positive integer, got {self.n_iter_no_change!r}"),
            (np.dtype(self.dtype) not in (np.float32, np.float64),
             f"dtype must be float32 or float64, got {self.dtype!r}"),
        ]
        for bad, message in problems:
            if bad:
                raise ValueError(message)

    def _hidden(self) -> list:
        sizes = self.hidden_layer_sizes
        return [sizes] if np.isscalar(sizes) else list(sizes)

    def _start(self, n_features: int, y: np.ndarray, seed: int) -> None:
        """A new model, initialised from ``seed``, its optimizer and empty figures."""
        dims = [n_features, *self._hidden()]
        n_out = len(self.classes_) if self._loss.classification else int(np.prod(y.shape[1:]))
        act = ACTIVATIONS[self.activation]
        layers: list[nn.Layer] = []
        for a, b in zip(dims[:-1], dims[1:]):
            layers += [nn.Dense(a, b, init="he" if act is nn.ReLU else "xavier")]
            layers += [act()] if act else []
        layers.append(nn.Dense(dims[-1], n_out, init="xavier"))
        self.model_ = nn.Sequential(layers, n_features, self.dtype).init_(seed)
        if self.solver == "adam":
            self._optimizer = nn.Adam(self.learning_rate_init, (self.beta_1, self.beta_2),
                                      self.epsilon)
        else:
            self._optimizer = nn.SGD(self.learning_rate_init, self.momentum,
                                     nesterov=self.nesterovs_momentum and self.momentum > 0)
        self.n_iter_, self.t_, self.loss_curve_, self._no_improvement = 0, 0, [], 0
        early, self._best_params = self.early_stopping, None
        self.best_loss_ = None if early else np.inf  # early stopping watches the validation score
        self.validation_scores_, self.best_validation_score_ = ([], -np.inf) if early else (None, None)

    def _epoch_done(self, record: dict, dp: DataParallel, n_train: int, X_val, y_val) -> bool:
        """Keep the epoch's figures; True: stop (the same verdict on every rank: the
        figures are global and the replicas equal)."""
        self.n_iter_ += 1
        self.t_ += n_train
        self.loss_curve_.append(float(record["loss"]))
        if X_val is not None:
            dp.settle()
            score = self._score(y_val, self._predict(X_val))
            self.validation_scores_.append(score)
            better = score > self.best_validation_score_ + self.tol
            if score > self.best_validation_score_:
                self.best_validation_score_ = score
                self._best_params = self.model_.params.copy()
        else:
            loss = self.loss_curve_[-1]
            better = loss < self.best_loss_ - self.tol
            self.best_loss_ = min(self.best_loss_, loss)
        self._no_improvement = 0 if better else self._no_improvement + 1
        self._stopped = self._no_improvement > self.n_iter_no_change
        return self._stopped

    # ---------------------------------------------------------------- the fitted model

    def _predict(self, X, output: str | None = None) -> np.ndarray:
        return self.model_.predict(np.asarray(X, self.model_.dtype), output or self._output)

    def _checked(self, X) -> np.ndarray:
        check_is_fitted(self, "model_")
        return validate_data(self, X, reset=False, dtype=[np.float64, np.float32])

    def _dense(self, key: str) -> list[np.ndarray]:
        check_is_fitted(self, "model_")
        return [layer.params[key] for layer in self.model_.layers if isinstance(layer, nn.Dense)]

    @property
    def coefs_(self) -> list[np.ndarray]:
        """Each ``Dense`` layer's weights ``(n_in, n_out)``, as scikit-learn's ``coefs_``."""
        return self._dense("W")

    @property
    def intercepts_(self) -> list[np.ndarray]:
        """Each ``Dense`` layer's biases ``(n_out,)``."""
        return self._dense("b")

    def save(self, path) -> str:
        """Write the fitted model as a ``model.npz`` (:func:`mpidp.nn.save`; its meta says
        which estimator and, for a classifier, its classes); returns the path written."""
        check_is_fitted(self, "model_")
        return nn.save(self.model_, path, {"estimator": type(self).__name__, **self._meta()})

    def export_onnx(self, path) -> str:
        """Write the fitted model as ONNX (:func:`mpidp.nn.export_onnx`): it computes the
        raw outputs (a classifier's logits over ``classes_``)."""
        check_is_fitted(self, "model_")
        return nn.export_onnx(self.model_, path)

    def _meta(self) -> dict:
        return {}

    def __getstate__(self) -> dict:
        """Pickles the model as its spec and parameters (not as views of one vector)."""
        state = self.__dict__.copy()
        model = state.pop("model_", None)
        if model is not None:
            state["_saved_model"] = (model.spec(), model.params.copy(), str(model.dtype))
        return state

    def __setstate__(self, state: dict) -> None:
        saved = state.pop("_saved_model", None)
        self.__dict__.update(state)
        if saved is not None:
            self.model_ = nn.from_spec(saved[0], saved[2])
            self.model_.params[...] = saved[1]
            if hasattr(self, "_optimizer"):
                self._optimizer.place(nn.Segments.of(self.model_))


class MLPClassifier(ClassifierMixin, _MLP):
    """A multi-layer perceptron classifier (softmax cross-entropy) trained by mpidp,
    with the parameters of :class:`sklearn.neural_network.MLPClassifier` (solvers
    ``adam`` and ``sgd``; ``dtype``: the model's float type). See the module's note."""

    _loss = nn.SoftmaxCrossEntropy

    def partial_fit(self, X, y, classes=None):
        """One epoch over ``X, y`` (``classes``, every label to expect, on the first call).
        Collective. Returns self."""
        if not hasattr(self, "model_") and classes is None:
            raise ValueError("classes must be passed on the first call to partial_fit.")
        return self._fit(X, y, incremental=True, classes=classes)

    def _targets(self, y, fresh: bool, classes) -> np.ndarray:
        y = column_or_1d(y, warn=True)
        check_classification_targets(y)
        if fresh:
            self.classes_ = np.unique(y if classes is None else classes)
        elif not np.isin(y, self.classes_).all():
            raise ValueError(f"y has classes not in self.classes_ {self.classes_.tolist()}: "
                             f"{sorted(set(np.unique(y)) - set(self.classes_))}")
        return np.searchsorted(self.classes_, y).astype(np.int64)

    def _score(self, y_true, scores) -> float:
        return accuracy_score(y_true, scores.argmax(axis=1))

    def predict(self, X) -> np.ndarray:
        """The most likely class of each row of ``X``, among ``classes_``."""
        X = self._checked(X)  # first: unfitted, there is no classes_
        return self.classes_[self._predict(X, "label")]

    def predict_proba(self, X) -> np.ndarray:
        """Each class's probability ``(n, len(classes_))``, rows summing to 1."""
        return self._predict(self._checked(X), "proba")

    def predict_log_proba(self, X) -> np.ndarray:
        """The log of :meth:`predict_proba`."""
        with np.errstate(divide="ignore"):
            return np.log(self.predict_proba(X))

    def _meta(self) -> dict:
        return {"classes": self.classes_.tolist()}


class MLPRegressor(RegressorMixin, _MLP):
    """A multi-layer perceptron regressor (mean squared error) trained by mpidp, with the
    parameters of :class:`sklearn.neural_network.MLPRegressor` (solvers ``adam`` and
    ``sgd``; ``dtype``: the model's float type). See the module's note."""

    _loss = nn.MeanSquaredError

    def partial_fit(self, X, y):
        """One epoch over ``X, y``. Collective. Returns self."""
        return self._fit(X, y, incremental=True)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True
        return tags

    def _targets(self, y, fresh: bool, classes) -> np.ndarray:
        y = np.asarray(y, self.dtype)
        if fresh:
            self._flat = y.ndim == 1
        return y

    def _score(self, y_true, pred) -> float:
        return r2_score(y_true, pred.ravel() if self._flat else pred)

    def predict(self, X) -> np.ndarray:
        """The predicted targets: ``(n,)`` when trained on ``y`` of shape ``(n,)``, else
        ``(n, n_outputs)``."""
        pred = self._predict(self._checked(X))
        return pred.ravel() if self._flat else pred
