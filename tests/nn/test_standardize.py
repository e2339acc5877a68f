"""Standardize (mpidp.nn.standardize): exact global moments from uneven and empty parts,
by one Allgather-and-merge or two additive passes, the layer's forward and backward
(finite differences), and a saved model keeping the fitted state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpidp import nn
from mpidp.nn import Standardize
from mpidp.nn.standardize import (
    combine_moments,
    merge_moments,
    moments,
    pass1_mean,
    pass1_sums,
    pass2_squares,
)


def _data(n: int = 203, shape=(4,), seed: int = 0, offset: float = 5.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = rng.uniform(0.1, 10, shape)
    return offset + scale * rng.standard_normal((n, *shape))


def _parts(x: np.ndarray, rng: np.random.Generator) -> list[list[np.ndarray]]:
    """The rows of ``x`` shuffled, as 1..4 uneven parts, one of them empty where several."""
    out = [[x[rng.permutation(len(x))]]]
    for p in (2, 3, 4):
        rows = x[rng.permutation(len(x))]
        parts = np.split(rows, np.sort(rng.integers(1, len(x), p - 2)))
        parts.insert(int(rng.integers(0, len(parts) + 1)), rows[:0])
        out.append(parts)
    return out


def _check(count, mean, m2, x) -> None:
    assert count == len(x)
    np.testing.assert_allclose(mean, x.mean(axis=0), rtol=1e-12, atol=0)
    np.testing.assert_allclose(m2 / count, x.var(axis=0), rtol=1e-12, atol=0)


def _two_pass(parts):
    """The additive route: sum the parts' pass1_sums, then their pass2_squares."""
    count, mean = pass1_mean(np.sum([pass1_sums(p) for p in parts], axis=0))
    return count, mean, np.sum([pass2_squares(p, mean) for p in parts], axis=0)


@pytest.mark.parametrize("shape,offset", [((4,), 5.0), ((2, 3), 0.0), ((3,), 1e3)])
def test_moments_of_parts_equal_the_whole(shape, offset):
    """Both routes, parts in any order, to 1e-12 (|mean| / std up to 1e4 here)."""
    x = _data(shape=shape, offset=offset)
    flat = x.reshape(len(x), -1)
    whole = moments(x)
    assert whole[1].shape == shape and whole[2].shape == shape
    _check(*whole, x)
    for parts in _parts(x, np.random.default_rng(1)):
        local = [moments(p) for p in parts]
        for order in (local, local[::-1]):
            _check(*combine_moments(order), x)
        _check(*_two_pass(parts), flat)


def test_two_pass_is_exact_far_from_zero():
    """Means 1e7 times the spread: the two passes still agree with the whole to 1e-12
    (the merge's error grows with |mean| / std: see the module's notes)."""
    x = _data(shape=(3,), offset=1e7)
    for parts in _parts(x, np.random.default_rng(2)):
        _check(*_two_pass(parts), x)


def test_moments_blocks_and_edges(monkeypatch):
    """Blocked moments (a tiny block size forces many blocks), empty input, one row."""
    from mpidp.nn import standardize as S
    x = _data(n=1001, offset=100.0)
    monkeypatch.setattr(S, "_CHUNK", 13)
    _check(*moments(x), x)
    assert pass2_squares(x, x.mean(axis=0)).shape == (4,)
    np.testing.assert_allclose(pass2_squares(x, x.mean(axis=0)), len(x) * x.var(axis=0),
                               rtol=1e-12)
    n, mean, m2 = moments(np.zeros((0, 2, 3)))
    assert n == 0 and mean.shape == m2.shape == (2, 3) and not mean.any() and not m2.any()
    n, mean, m2 = moments(np.array([[1.5, -2.0]]))
    assert n == 1 and mean.tolist() == [1.5, -2.0] and m2.tolist() == [0.0, 0.0]
    assert merge_moments((0, np.zeros(2), np.zeros(2)), (0, np.zeros(2), np.zeros(2)))[0] == 0
    assert pass1_mean(np.zeros(3)) == (0, pytest.approx(np.zeros(2)))
    with pytest.raises(ValueError, match="reshape a 1-D array"):
        moments(np.ones(3))
    with pytest.raises(ValueError, match="at least one"):
        combine_moments([])


def _model(shape, dtype=np.float64) -> nn.Sequential:
    layers = [Standardize(), nn.Flatten(), nn.Dense(None, 2)] if len(shape) > 1 else \
        [Standardize(), nn.Dense(None, 2)]
    return nn.Sequential(layers, shape, dtype).init_(0)


def test_fit_sets_the_state_and_constant_features_get_std_1():
    x = _data(shape=(5,))
    x[:, 2] = 7.25  # constant
    x[:, 4] = 0.0   # constant zero
    model = _model((5,))
    layer = model.layers[0]
    assert layer.state["mean"].tolist() == [0.0] * 5 and layer.state["std"].tolist() == [1.0] * 5
    assert model(x).shape == (len(x), 2)  # identity before fitting
    assert layer.fit_(*moments(x)) is layer
    std = x.std(axis=0)
    std[[2, 4]] = 1.0
    np.testing.assert_allclose(layer.state["mean"], x.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(layer.state["std"], std, rtol=1e-12)
    y = layer.forward(x)
    np.testing.assert_allclose(y.mean(axis=0), 0, atol=1e-12)
    np.testing.assert_allclose(y.std(axis=0), [1, 1, 0, 1, 0], atol=1e-12)
    with pytest.raises(ValueError, match="at least one training row"):
        layer.fit_(0, np.zeros(5), np.zeros(5))
    with pytest.raises(ValueError, match="must have 5 items"):
        layer.fit_(3, np.zeros(4), np.zeros(4))
    with pytest.raises(ValueError, match="NaN or Inf"):
        layer.fit_(3, np.full(5, np.nan), np.zeros(5))
    layer.state["std"][0] = 0.0
    with pytest.raises(ValueError, match="model.init_"):
        layer.forward(x)
    with pytest.raises(ValueError, match="samples of shape \\(5,\\)"):
        layer.forward(x[:, :4])


@pytest.mark.parametrize("shape", [(4,), (2, 3)])
def test_forward_and_backward_against_finite_differences(shape):
    rng = np.random.default_rng(2)
    layer = Standardize()
    assert layer.output_shape(shape) == shape
    layer.bind({}, {})
    layer.bind_state({"mean": rng.standard_normal(shape), "std": rng.uniform(0.5, 2, shape)})
    assert layer.param_shapes() == {} and set(layer.state_shapes()) == {"mean", "std"}
    x = rng.standard_normal((6, *shape))
    y = layer.forward(x)
    np.testing.assert_allclose(y, (x - layer.state["mean"]) / layer.state["std"], rtol=1e-15)
    w = rng.standard_normal(y.shape)
    dx = layer.backward(w)
    num, eps = np.zeros_like(x), 1e-6
    for i in np.ndindex(x.shape):  # central differences of sum(w * forward(x))
        old = x[i]
        x[i] = old + eps
        fp = float(np.sum(w * layer.forward(x)))
        x[i] = old - eps
        fm = float(np.sum(w * layer.forward(x)))
        x[i] = old
        num[i] = (fp - fm) / (2 * eps)
    np.testing.assert_allclose(dx, num, rtol=1e-6, atol=1e-8)
    assert layer.backward(w, accumulate=True, need_input_grad=False) is None


def test_float32_model_and_training_mode_change_nothing():
    x = _data(n=50, shape=(3,)).astype(np.float32)
    model = _model((3,), np.float32)
    model.layers[0].fit_(*moments(x))
    y = model.layers[0].forward(x)
    assert y.dtype == np.float32
    model.context.training = True
    assert model.layers[0].forward(x).tobytes() == y.tobytes()
    assert model.needs == frozenset()


@pytest.mark.parametrize("shape", [(4,), (2, 3)])
def test_save_and_load_keep_the_state(tmp_path, shape):
    x = _data(n=40, shape=shape, seed=3)
    model = _model(shape)
    model.layers[0].fit_(*moments(x))
    assert model.spec()[0]["type"] == "Standardize"
    json.dumps(model.spec())
    back = nn.load(model.save(tmp_path / "m.npz"))
    assert isinstance(back.layers[0], Standardize)
    assert back.state.tobytes() == model.state.tobytes() and back.n_state == 2 * x[0].size
    assert back(x).tobytes() == model(x).tobytes()
    np.testing.assert_allclose(back.layers[0].state["std"], x.std(axis=0), rtol=1e-12)
