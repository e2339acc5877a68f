"""Evaluation figures from per-rank SUFFICIENT STATISTICS: exact at any number of ranks.

Each rank turns its rows into a small float64 vector; all ranks' vectors combine (the
caller's one collective) into the whole set's, from which the figures follow::

    figures = class_scores(allreduce_sum(class_stats(scores, y, k)), k)     # additive
    figures = reg_scores(reg_combine_all(allgather(reg_stats(pred, t))))    # Chan et al.

Another order of summing changes the figures by rounding only (~1e-12 relative)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import is_whole
from ..nn.standardize import combine_moments, moments

#: The k of the top-k accuracies, of those below the number of classes (any k >= it always hits).
TOP_K = (1, 3, 5)


def top_ks(n_classes: int) -> tuple[int, ...]:
    """The k reported for ``n_classes`` classes: 1, and 3 and 5 where below n_classes."""
    return tuple(k for k in TOP_K if k == 1 or k < n_classes)


def _n_classes(n_classes: int) -> int:
    if not is_whole(n_classes, 1):
        raise ValueError(f"n_classes must be an integer >= 1, got {n_classes!r}")
    return int(n_classes)


def class_stats_size(n_classes: int) -> int:
    """Length of the :func:`class_stats` vector: ``2 + len(top_ks(k)) + k * k``."""
    k = _n_classes(n_classes)
    return 2 + len(top_ks(k)) + k * k


def class_stats(scores: np.ndarray, y: np.ndarray, n_classes: int) -> np.ndarray:
    """Additive statistics of a classifier's ``scores`` ``(n, k)`` (logits, ``k ==
    n_classes``, ``n`` may be 0) against integer labels ``y`` ``(n,)`` in ``[0, k)``: float64
    ``(class_stats_size(k),)``: ``[count, summed log-loss, top-k hits for each k of
    top_ks(k), confusion matrix (k*k, row = true class)]``; zeros for an empty batch.
    The prediction is ``argmax(scores)``. A top-k hit: the true class is among the first k
    by decreasing score, ties in class order; never for a row with a NaN score. The log-loss
    is ``-log softmax(scores)_y`` in float64, ``p_y`` clipped to ``[eps, 1 - eps]`` as
    scikit-learn does (``eps`` of the scores' float dtype, else float64's)."""
    k = _n_classes(n_classes)
    scores, y = np.asarray(scores), np.asarray(y)
    if scores.ndim != 2 or scores.shape[1] != k:
        raise ValueError(f"class_stats takes scores of shape (n, {k}), got {scores.shape}")
    if y.shape != (len(scores),):
        raise ValueError(f"class_stats takes labels of shape ({len(scores)},), got {y.shape}: "
                         f"pass integer labels, not one-hot rows")
    ks, n = top_ks(k), len(y)
    out = np.zeros(class_stats_size(k))
    if n == 0:
        return out
    if not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"class_stats takes integer labels, got dtype {y.dtype}")
    if y.min() < 0 or y.max() >= k:
        raise ValueError(f"class_stats: labels must lie in [0, {k}), got {y.min()}..{y.max()}")
    eps = np.finfo(scores.dtype if np.issubdtype(scores.dtype, np.floating) else np.float64).eps
    z = scores.astype(np.float64)
    zmax, zy = z.max(axis=1), z[np.arange(n), y]
    lse = np.log(np.exp(z - zmax[:, None]).sum(axis=1)) + zmax
    loss = np.clip(lse - zy, -np.log1p(-eps), -np.log(eps))
    ahead = z > zy[:, None]  # classes sorted before the true one
    ahead |= (z == zy[:, None]) & (np.arange(k) < y[:, None])
    rank = np.count_nonzero(ahead, axis=1)
    rank[np.isnan(z).any(axis=1)] = k
    out[:2] = n, loss.sum()
    out[2:2 + len(ks)] = [np.count_nonzero(rank < t) for t in ks]
    out[2 + len(ks):] = np.bincount(y * k + z.argmax(axis=1), minlength=k * k)
    return out


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    """``num / den``, 0 where ``den`` is 0 (scikit-learn's ``zero_division=0``)."""
    return np.divide(num, den, out=np.zeros(np.shape(num)), where=den != 0)


def class_scores(stats: np.ndarray, n_classes: int) -> dict:
    """Classification figures from a (summed) :func:`class_stats` vector, a JSON-able dict:
    ``count``, ``accuracy``, ``top{k}_accuracy`` (each k of :func:`top_ks`), ``log_loss`` (NaN
    when ``count`` is 0); per class ``precision``, ``recall``, ``f1``, ``support`` and their
    unweighted means over ALL ``n_classes`` classes (``precision_macro`` ...), a ratio over 0
    being 0 (scikit-learn's ``zero_division=0``); ``confusion_matrix`` (row = true class)."""
    k = _n_classes(n_classes)
    stats = np.asarray(stats, np.float64)
    if stats.shape != (class_stats_size(k),):
        raise ValueError(f"class_scores: a statistics vector for {k} classes has "
                         f"{class_stats_size(k)} items, got shape {stats.shape}")
    ks, n = top_ks(k), int(round(stats[0]))
    cm = np.rint(stats[2 + len(ks):]).astype(np.int64).reshape(k, k)
    tp = np.diag(cm).astype(np.float64)
    support, predicted = cm.sum(axis=1), cm.sum(axis=0)
    precision, recall = _ratio(tp, predicted), _ratio(tp, support)
    f1 = _ratio(2 * tp, support + predicted)
    per = (lambda v: float(v / n)) if n > 0 else (lambda v: float("nan"))
    return {"count": n, "accuracy": per(tp.sum()),
            **{f"top{t}_accuracy": per(h) for t, h in zip(ks, stats[2:2 + len(ks)])},
            "log_loss": per(stats[1]), "precision": precision.tolist(), "recall": recall.tolist(),
            "f1": f1.tolist(), "support": support.tolist(), "precision_macro": float(precision.mean()),
            "recall_macro": float(recall.mean()), "f1_macro": float(f1.mean()),
            "confusion_matrix": cm.tolist()}


def reg_stats(pred: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Statistics of a regression's predictions ``pred`` ``(n, t)`` against ``target`` ``(n, t)``
    (both may be ``(n,)`` when t = 1; ``n`` may be 0): float64 ``(1 + 4t,)``: ``[count, SSE (t),
    SAE (t), target mean (t), target M2 (t)]``. NOT additive: merge vectors with
    :func:`reg_combine` / :func:`reg_combine_all`."""
    pred, target = np.asarray(pred), np.asarray(target)
    if pred.ndim == 1:
        pred = pred[:, None]
    if pred.ndim != 2:
        raise ValueError(f"reg_stats takes predictions (n, t) or (n,), got {pred.shape}")
    if target.ndim == 1 and pred.shape[1] == 1:
        target = target[:, None]
    if target.shape != pred.shape:
        raise ValueError(f"reg_stats: targets of shape {target.shape} do not match predictions "
                         f"of shape {pred.shape} (targets are (n, t), or (n,) when t is 1)")
    if len(pred) == 0:
        return np.zeros(1 + 4 * pred.shape[1])
    err = np.subtract(pred, target, dtype=np.float64)
    count, mean, m2 = moments(target)
    return np.concatenate([[count], np.einsum("ij,ij->j", err, err), np.abs(err).sum(axis=0),
                           mean, m2])


def _n_outputs(stats: np.ndarray, what: str) -> int:
    if stats.ndim != 1 or stats.size < 5 or (stats.size - 1) % 4:
        raise ValueError(f"{what}: a regression statistics vector has 1 + 4t items (t >= 1), "
                         f"got shape {stats.shape}")
    return (stats.size - 1) // 4


def reg_combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The :func:`reg_stats` vector of the union of the rows of ``a`` and ``b``: counts and
    error sums add, the targets' means and centred sums of squares merge by Chan et al.'s
    formula (:func:`mpidp.nn.standardize.merge_moments`)."""
    return reg_combine_all([a, b])


def reg_combine_all(parts: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    """The :func:`reg_stats` vector of all the rows of ``parts`` (a list of vectors, or
    the ``(P, 1 + 4t)`` array an Allgather gives), merged by a pairwise tree: the result
    does not depend on their order beyond rounding."""
    parts = [np.asarray(p, np.float64) for p in parts]
    if not parts:
        raise ValueError("reg_combine_all needs at least one statistics vector")
    t = _n_outputs(parts[0], "reg_combine_all")
    if any(p.shape != parts[0].shape for p in parts):
        raise ValueError(f"reg_combine_all: vectors of different shapes "
                         f"{sorted({p.shape for p in parts})}")
    out = np.sum(parts, axis=0)
    out[0], out[1 + 2 * t:1 + 3 * t], out[1 + 3 * t:] = combine_moments(
        (int(round(p[0])), p[1 + 2 * t:1 + 3 * t], p[1 + 3 * t:]) for p in parts)
    return out


def reg_scores(stats: np.ndarray) -> dict:
    """Regression figures from a (combined) :func:`reg_stats` vector, a JSON-able dict:
    ``count``; ``mse``, ``mae``, ``r2`` (means over the outputs) and per output
    ``mse_outputs``, ``mae_outputs``, ``r2_outputs``; R^2 as scikit-learn's (``force_finite``:
    1 when SSE is 0, else 0 when M2 is 0; NaN below 2 samples)."""
    stats = np.asarray(stats, np.float64)
    t = _n_outputs(stats, "reg_scores")
    n, nan = int(round(stats[0])), np.full(t, np.nan)
    sse, sae, m2 = stats[1:1 + t], stats[1 + t:1 + 2 * t], stats[1 + 3 * t:]
    mse, mae = (sse / n, sae / n) if n > 0 else (nan, nan)
    r2 = nan if n < 2 else np.where(sse == 0, 1.0, np.where(m2 == 0, 0.0, 1 - _ratio(sse, m2)))
    return {"count": n, "mse": float(mse.mean()), "mae": float(mae.mean()),
            "r2": float(r2.mean()), "mse_outputs": mse.tolist(), "mae_outputs": mae.tolist(),
            "r2_outputs": r2.tolist()}


class ScoreSums:
    """This rank's evaluation statistics over its batches (``add`` per batch), for
    ``n_outputs`` outputs: :func:`class_stats` vectors (``additive``: ranks sum
    :attr:`vector`) or :func:`reg_stats` (merged with :func:`reg_combine_all`)."""

    def __init__(self, classification: bool, n_outputs: int) -> None:
        self.classification, self.n_outputs = bool(classification), int(n_outputs)
        self.additive = self.classification
        self.vector = (np.zeros(class_stats_size(self.n_outputs)) if self.classification
                       else reg_stats(np.zeros((0, self.n_outputs)), np.zeros((0, self.n_outputs))))

    def add(self, outputs: np.ndarray, y: np.ndarray) -> None:
        """Count one batch: ``outputs`` ``(n, n_outputs)``, ``y`` its labels or targets."""
        if self.classification:
            self.vector += class_stats(outputs, y, self.n_outputs)
        else:
            self.vector = reg_combine(self.vector, reg_stats(outputs, y))

    def scores(self, vector: np.ndarray) -> dict:
        """The figures of a global ``vector`` (summed or merged over the ranks)."""
        return class_scores(vector, self.n_outputs) if self.classification else reg_scores(vector)
