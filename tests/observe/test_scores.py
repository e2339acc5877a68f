"""Evaluation figures from sufficient statistics (mpidp.observe.scores): against
scikit-learn on the whole set, and the same figures from the statistics of 1..4 uneven
parts (some empty) added or merged in any order."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from mpidp.observe.scores import (
    class_scores,
    class_stats,
    class_stats_size,
    reg_combine,
    reg_combine_all,
    reg_scores,
    reg_stats,
    top_ks,
)

skm = pytest.importorskip("sklearn.metrics")

TIGHT = dict(rtol=1e-10, atol=1e-12)


def _splits(n: int, rng: np.random.Generator) -> list[list[np.ndarray]]:
    """Row indices 0..n-1, shuffled, as 1, 2, 3 and 4 parts: uneven, one of them empty
    where there are several."""
    out = [[rng.permutation(n)]]
    for p in (2, 3, 4):
        order = rng.permutation(n)
        parts = np.split(order, np.sort(rng.integers(1, n, p - 2)))
        parts.insert(int(rng.integers(0, len(parts) + 1)), order[:0])
        out.append(parts)
    return out


def _classes(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, k, n)
    scores = 1.5 * rng.standard_normal((n, k))
    scores[np.arange(n), y] += 1.0  # better than chance, so every figure is non-trivial
    return scores, y


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _sklearn_class(scores, y, k) -> dict:
    labels = np.arange(k)
    pred = scores.argmax(axis=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p, r, f, s = skm.precision_recall_fscore_support(y, pred, labels=labels,
                                                         zero_division=0)
        pm, rm, fm, _ = skm.precision_recall_fscore_support(y, pred, labels=labels,
                                                            average="macro", zero_division=0)
        out = {"accuracy": skm.accuracy_score(y, pred), "precision": p, "recall": r, "f1": f,
               "support": s, "precision_macro": pm, "recall_macro": rm, "f1_macro": fm,
               "log_loss": skm.log_loss(y, _softmax(scores), labels=labels),
               "confusion_matrix": skm.confusion_matrix(y, pred, labels=labels)}
        assert np.isclose(fm, skm.f1_score(y, pred, labels=labels, average="macro",
                                           zero_division=0))
        for t in top_ks(k) if k > 2 else ():  # sklearn's binary case takes 1-D scores
            out[f"top{t}_accuracy"] = skm.top_k_accuracy_score(y, scores, k=t, labels=labels)
    return out


def _check_class(got: dict, want: dict) -> None:
    for key, value in want.items():
        if key in ("support", "confusion_matrix"):
            assert got[key] == np.asarray(value).tolist(), key
        else:
            np.testing.assert_allclose(got[key], value, err_msg=key, **TIGHT)


@pytest.mark.parametrize("k", [3, 4, 7])
def test_classification_matches_sklearn(k):
    scores, y = _classes(300, k, k)
    stats = class_stats(scores, y, k)
    assert stats.shape == (class_stats_size(k),) and stats.dtype == np.float64
    got = class_scores(stats, k)
    assert got["count"] == 300
    assert got["top1_accuracy"] == got["accuracy"]
    assert [f"top{t}_accuracy" in got for t in (3, 5)] == [k > 3, k > 5]
    _check_class(got, _sklearn_class(scores, y, k))
    json.dumps(got)  # JSON-able


def test_binary_and_absent_classes_follow_zero_division_0():
    """Two classes (top-1 only); a class never true nor predicted, and one predicted but
    never true: their ratios are 0, as scikit-learn's zero_division=0."""
    rng = np.random.default_rng(3)
    scores, y = _classes(80, 2, 5)
    _check_class(class_scores(class_stats(scores, y, 2), 2), _sklearn_class(scores, y, 2))
    assert top_ks(2) == (1,)
    k = 5
    y = rng.integers(0, 3, 60)  # classes 3 and 4 never true
    scores = rng.standard_normal((60, k))
    scores[:5, 3] = 10  # class 3 predicted five times (always wrongly)
    scores[:, 4] = -10  # class 4 never predicted
    got = class_scores(class_stats(scores, y, k), k)
    assert got["precision"][3] == got["recall"][3] == got["f1"][3] == 0.0
    assert got["precision"][4] == got["recall"][4] == got["f1"][4] == 0.0
    _check_class(got, _sklearn_class(scores, y, k))


def test_log_loss_is_clipped_like_sklearn_and_stable():
    """Huge logits: no overflow; a certain wrong answer costs -log(eps), as sklearn's clip."""
    scores = np.array([[1000.0, 0.0, -1000.0], [0.0, 800.0, 0.0], [5.0, 5.0, 5.0]])
    y = np.array([0, 0, 2])
    got = class_scores(class_stats(scores, y, 3), 3)
    want = skm.log_loss(y, _softmax(scores), labels=[0, 1, 2])
    np.testing.assert_allclose(got["log_loss"], want, rtol=1e-12)
    per = np.array([-np.log1p(-np.finfo(float).eps), -np.log(np.finfo(float).eps), np.log(3)])
    np.testing.assert_allclose(got["log_loss"], per.mean(), rtol=1e-12)
    f32 = class_scores(class_stats(scores.astype(np.float32), y, 3), 3)["log_loss"]
    np.testing.assert_allclose(f32, skm.log_loss(y, _softmax(scores).astype(np.float32),
                                                 labels=[0, 1, 2]), rtol=1e-6)


def test_ties_rank_in_class_order():
    """Equal scores: the lower class comes first, so top-1 agrees with argmax."""
    scores = np.zeros((4, 4))
    y = np.array([0, 1, 2, 3])
    stats = class_stats(scores, y, 4)
    got = class_scores(stats, 4)
    assert got["accuracy"] == got["top1_accuracy"] == 0.25
    assert got["top3_accuracy"] == 0.75
    nan_row = class_stats(np.array([[np.nan, 0.0, 0.0, 0.0]]), np.array([0]), 4)
    assert class_scores(nan_row, 4)["top3_accuracy"] == 0.0


def test_classification_from_uneven_parts():
    k = 6
    scores, y = _classes(257, k, 11)
    whole = class_scores(class_stats(scores, y, k), k)
    for parts in _splits(len(y), np.random.default_rng(0)):
        stats = [class_stats(scores[i], y[i], k) for i in parts]
        for order in (stats, stats[::-1]):
            got = class_scores(np.sum(order, axis=0), k)
            assert got["confusion_matrix"] == whole["confusion_matrix"]
            _check_class(got, {key: v for key, v in whole.items() if key != "count"})


def test_empty_batch_and_bad_input():
    k = 4
    empty = class_stats(np.zeros((0, k), np.float32), np.zeros(0, np.int64), k)
    assert not empty.any() and empty.shape == (class_stats_size(k),)
    got = class_scores(empty, k)
    assert got["count"] == 0 and np.isnan(got["accuracy"]) and np.isnan(got["log_loss"])
    assert got["f1_macro"] == 0.0 and got["confusion_matrix"] == [[0] * k] * k
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 4\)"):
        class_stats(np.zeros((2, k)), np.array([0, 4]), k)
    with pytest.raises(ValueError, match="shape \\(n, 4\\)"):
        class_stats(np.zeros((2, 3)), np.array([0, 1]), k)
    with pytest.raises(ValueError, match="not one-hot"):
        class_stats(np.zeros((2, k)), np.eye(k)[:2], k)
    with pytest.raises(ValueError, match="integer labels"):
        class_stats(np.zeros((2, k)), np.array([0.0, 1.0]), k)
    with pytest.raises(ValueError, match="has 20 items"):
        class_scores(np.zeros(5), k)


# ---------------------------------------------------------------------------- regression


def _regression(n: int, t: int, seed: int, offset: float = 0.0):
    rng = np.random.default_rng(seed)
    target = offset + rng.standard_normal((n, t)) * rng.uniform(0.5, 3, t)
    pred = target + 0.4 * rng.standard_normal((n, t))
    return pred, target


def _check_reg(got: dict, pred, target, rtol=1e-10) -> None:
    for name, fn in (("mse", skm.mean_squared_error), ("mae", skm.mean_absolute_error),
                     ("r2", skm.r2_score)):
        np.testing.assert_allclose(got[name], fn(target, pred), rtol=rtol, err_msg=name)
        np.testing.assert_allclose(got[f"{name}_outputs"],
                                   fn(target, pred, multioutput="raw_values"), rtol=rtol,
                                   err_msg=name)


@pytest.mark.parametrize("t", [1, 3])
def test_regression_matches_sklearn(t):
    pred, target = _regression(200, t, t)
    got = reg_scores(reg_stats(pred, target))
    assert got["count"] == 200
    _check_reg(got, pred, target)
    json.dumps(got)
    if t == 1:  # (n,) targets and predictions
        assert reg_scores(reg_stats(pred[:, 0], target[:, 0])) == got
        assert reg_scores(reg_stats(pred, target[:, 0])) == got


@pytest.mark.parametrize("offset", [0.0, 1e6])
def test_regression_from_uneven_parts(offset):
    """Merged in any order, the parts give the whole set's figures to 1e-10, even when the
    targets' mean is far from 0 (where sum(y^2) - sum(y)^2 / n would lose R^2)."""
    pred, target = _regression(301, 2, 7, offset)
    whole = reg_scores(reg_stats(pred, target))
    _check_reg(whole, pred, target, rtol=1e-9 if offset else 1e-10)
    for parts in _splits(len(target), np.random.default_rng(1)):
        stats = [reg_stats(pred[i], target[i]) for i in parts]
        seq = stats[0]
        for s in stats[1:]:
            seq = reg_combine(seq, s)
        for got in (reg_scores(seq), reg_scores(reg_combine_all(stats[::-1])),
                    reg_scores(reg_combine_all(np.stack(stats)))):
            assert got["count"] == whole["count"]
            for key in ("mse", "mae", "r2", "mse_outputs", "mae_outputs", "r2_outputs"):
                np.testing.assert_allclose(got[key], whole[key], rtol=1e-10, err_msg=key)


def test_regression_edge_cases():
    empty = reg_stats(np.zeros((0, 2)), np.zeros((0, 2)))
    assert empty.shape == (9,) and not empty.any()
    got = reg_scores(empty)
    assert got["count"] == 0 and np.isnan(got["mse"]) and np.isnan(got["r2"])
    one = reg_scores(reg_stats(np.array([1.0]), np.array([2.0])))
    assert one["mse"] == 1.0 and np.isnan(one["r2"])  # as sklearn: undefined below 2 samples
    const = np.full((5, 2), 3.0)
    pred = const.copy()
    pred[0, 1] = 4.0
    got = reg_scores(reg_stats(pred, const))  # constant targets: force_finite convention
    assert got["r2_outputs"] == [1.0, 0.0]
    assert got["r2_outputs"] == skm.r2_score(const, pred, multioutput="raw_values").tolist()
    with pytest.raises(ValueError, match="do not match"):
        reg_stats(np.zeros((3, 2)), np.zeros(3))
    with pytest.raises(ValueError, match="1 \\+ 4t"):
        reg_scores(np.zeros(6))
    with pytest.raises(ValueError, match="different"):
        reg_combine(np.zeros(5), np.zeros(9))
