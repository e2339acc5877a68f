"""Losses. Each returns the SUM over samples of the per-sample loss, so the global mean is
the ranks' sums over the global count: exact for uneven or empty shards."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class Loss(ABC):
    """``forward(pred, target) -> float`` (sum over samples); ``backward() -> dL/dpred``."""

    #: True when targets are integer class labels and accuracy is meaningful.
    classification: bool = False

    @abstractmethod
    def forward(self, pred: np.ndarray, target: np.ndarray) -> float:
        """Sum over the ``n`` samples of the per-sample loss; ``pred`` is ``(n, k)``."""

    @abstractmethod
    def backward(self) -> np.ndarray:
        """Gradient of the summed loss with respect to ``pred``, shape ``(n, k)``."""

    def n_correct(self, pred: np.ndarray, target: np.ndarray) -> int:
        """Number of samples whose ``argmax(pred)`` equals the label (or one-hot target)."""
        if len(pred) == 0:
            return 0
        labels = target if target.ndim == 1 else target.argmax(axis=1)
        return int(np.count_nonzero(pred.argmax(axis=1) == labels))


def label_problem(y: np.ndarray, k: int, classes_only: bool = True) -> str | None:
    """What is wrong with ``y`` as integer class labels ``(n,)`` in ``[0, k)``, or None
    (never raises); ``classes_only=False`` checks only integer labels ``(n,)``."""
    integer = y.dtype.kind in "iu"
    if classes_only and (y.ndim != 1 or (len(y) and not integer)):
        return (f"class labels must be integers of shape (n,), got {y.dtype} of shape "
                f"{y.shape}" + (": flatten them (y.ravel())" if y.ndim == 2 and y.shape[1] == 1
                                 and integer else ""))
    if y.ndim == 1 and integer and len(y):
        lo, hi = int(y.min()), int(y.max())
        if lo < 0 or hi >= k:
            bad = lo if lo < 0 else hi
            return f"label {bad} is outside the model's {k} classes (0 to {k - 1})"
    return None


class SoftmaxCrossEntropy(Loss):
    """Softmax over ``k`` logits then cross-entropy with integer labels ``(n,)`` in ``[0, k)``:
    per sample ``logsumexp(z) - z[y]``, gradient ``softmax(z) - onehot(y)``."""

    classification = True

    def forward(self, pred: np.ndarray, target: np.ndarray) -> float:
        if why := label_problem(target, pred.shape[1]):
            raise ValueError(why)
        z = pred - pred.max(axis=1, keepdims=True) if len(pred) else pred  # (n, k)
        e = np.exp(z)
        s = e.sum(axis=1, keepdims=True)
        self._p = e / s
        self._rows, self._y = np.arange(len(z)), target
        return float(np.sum(np.log(s[:, 0]) - z[self._rows, target]))

    def backward(self) -> np.ndarray:
        g = self._p.copy()
        g[self._rows, self._y] -= 1
        return g


class MeanSquaredError(Loss):
    """Per-sample loss ``mean_j (pred[j] - target[j])**2`` over the ``k`` outputs; ``target``
    ``(n, k)``, ``(n,)`` for ``k == 1``, or integer labels ``(n,)`` (one-hot encoded)."""

    def forward(self, pred: np.ndarray, target: np.ndarray) -> float:
        if target.ndim == 1 and np.issubdtype(target.dtype, np.integer):
            if why := label_problem(target, pred.shape[1], classes_only=False):
                raise ValueError(why)
            t = np.zeros_like(pred)
            t[np.arange(len(target)), target] = 1
        else:
            t = target.reshape(pred.shape)
        self._diff = pred - t
        return float(np.sum(self._diff * self._diff)) / pred.shape[1]

    def backward(self) -> np.ndarray:
        return self._diff * (2.0 / self._diff.shape[1])


#: What a classifier's prediction can be: raw ``scores`` (logits ``(n, k)``), ``proba``
#: (softmax probabilities ``(n, k)``, rows summing to 1) or ``label`` (``(n,)`` int64).
OUTPUTS = ("scores", "proba", "label")


def outputs(scores: np.ndarray, kind: str = "scores") -> np.ndarray:
    """A classifier's ``scores`` ``(n, k)`` as ``kind`` (see :data:`OUTPUTS`)."""
    if kind not in OUTPUTS:
        raise ValueError(f"unknown output {kind!r}; expected one of {OUTPUTS}")
    if kind == "scores":
        return scores
    if kind == "label":
        return scores.argmax(axis=1).astype(np.int64)
    e = np.exp(scores - scores.max(axis=1, keepdims=True)) if len(scores) else scores
    return e / e.sum(axis=1, keepdims=True)
