"""Finite-difference gradient checks for every layer, every loss and a whole ``Sequential``.

Everything here runs in float64. Tolerance: central differences ``(f(x+e) - f(x-e)) / 2e``
have a truncation error of order ``e**2 * |f'''|`` (~1e-12 for e = 1e-6 and the smooth,
O(1)-curvature functions used here) and a rounding error of order ``|f| * 2**-52 / e``
(~1e-10 * |f|; the checked functions stay below ~10 in magnitude, so < ~1e-9). Comparing
with rtol=1e-6, atol=1e-8 therefore leaves a 10x margin over the numerical noise while any
real mistake (a missing factor 2, mean instead of sum, a transposed weight, a wrong sign)
is off by orders of magnitude more.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import numgrad

from mpidp.nn import (
    Dense,
    MeanSquaredError,
    ReLU,
    Sequential,
    Sigmoid,
    SoftmaxCrossEntropy,
    Tanh,
    mlp,
)

EPS = 1e-6
RTOL, ATOL = 1e-6, 1e-8



def bound_dense(n_in: int, n_out: int, rng: np.random.Generator) -> Dense:
    """A Dense layer bound to freshly allocated float64 arrays (no Sequential involved)."""
    layer = Dense(n_in, n_out)
    params = {"W": rng.standard_normal((n_in, n_out)), "b": rng.standard_normal(n_out)}
    grads = {"W": np.full((n_in, n_out), np.nan), "b": np.full(n_out, np.nan)}
    layer.bind(params, grads)
    return layer


# ---------------------------------------------------------------------------- layers


def _projection_loss(layer, x, w):
    """Scalar ``sum(w * layer(x))``: its gradient w.r.t. the layer output is exactly ``w``."""
    return float(np.sum(w * layer.forward(x)))


@pytest.mark.parametrize("n", [1, 5])
def test_dense_gradients(n):
    rng = np.random.default_rng(1)
    layer = bound_dense(4, 3, rng)
    x = rng.standard_normal((n, 4))
    w = rng.standard_normal((n, 3))

    y = layer.forward(x)
    np.testing.assert_allclose(y, x @ layer.params["W"] + layer.params["b"], rtol=1e-14)
    dx = layer.backward(w)

    f = lambda: _projection_loss(layer, x, w)
    np.testing.assert_allclose(dx, numgrad(f, x), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(layer.grads["W"], numgrad(f, layer.params["W"]), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(layer.grads["b"], numgrad(f, layer.params["b"]), rtol=RTOL, atol=ATOL)
    # closed forms, as an independent reference too
    np.testing.assert_allclose(layer.grads["W"], x.T @ w, rtol=1e-13)
    np.testing.assert_allclose(layer.grads["b"], w.sum(axis=0), rtol=1e-13)


def _relu_input(rng, shape):
    """Values with |x| in [0.1, 2]: far from the kink at 0 compared with EPS."""
    return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.1, 2.0, shape)


@pytest.mark.parametrize("make_layer, make_x, reference", [
    (ReLU, _relu_input, lambda x: np.maximum(x, 0)),
    (Tanh, lambda rng, s: 2 * rng.standard_normal(s), np.tanh),
    (Sigmoid, lambda rng, s: 2 * rng.standard_normal(s), lambda x: 1 / (1 + np.exp(-x))),
], ids=["ReLU", "Tanh", "Sigmoid"])
def test_activation_gradients(make_layer, make_x, reference):
    rng = np.random.default_rng(2)
    layer = make_layer()
    x = make_x(rng, (6, 5))
    w = rng.standard_normal((6, 5))
    assert layer.param_shapes() == {}
    assert layer.output_dim(5) == 5

    y = layer.forward(x)
    np.testing.assert_allclose(y, reference(x), rtol=1e-14, atol=1e-300)
    dx = layer.backward(w)
    assert dx.shape == x.shape
    num = numgrad(lambda: _projection_loss(layer, x, w), x)
    np.testing.assert_allclose(dx, num, rtol=RTOL, atol=ATOL)


def test_relu_kills_negative_inputs_and_derivative_at_zero_is_zero():
    layer = ReLU()
    x = np.array([[-3.0, 0.0, 2.5]])
    np.testing.assert_array_equal(layer.forward(x), [[0.0, 0.0, 2.5]])
    np.testing.assert_array_equal(layer.backward(np.array([[7.0, 7.0, 7.0]])), [[0.0, 0.0, 7.0]])


def test_sigmoid_does_not_overflow_for_large_inputs():
    layer = Sigmoid()
    x = np.array([[-1000.0, -40.0, 0.0, 40.0, 1000.0]])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        y = layer.forward(x)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, [[0.0, 1 / (1 + np.exp(40.0)), 0.5, 1 / (1 + np.exp(-40.0)), 1.0]],
                               rtol=1e-14, atol=0)


# ---------------------------------------------------------------------------- losses


def _sce_reference(z, y):
    """Independent per-sample cross-entropy, summed (inputs are small, no shift needed)."""
    p = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    return -np.log(p[np.arange(len(y)), y]).sum()


def test_softmax_cross_entropy_value_and_gradient():
    rng = np.random.default_rng(3)
    z = rng.standard_normal((5, 4))
    y = np.array([0, 3, 1, 1, 2])
    loss = SoftmaxCrossEntropy()
    assert loss.classification
    value = loss.forward(z, y)
    assert value == pytest.approx(_sce_reference(z, y), rel=1e-13)
    g = loss.backward()
    num = numgrad(lambda: loss.forward(z, y), z)
    np.testing.assert_allclose(g, num, rtol=RTOL, atol=ATOL)
    # softmax - onehot: each row sums to zero
    np.testing.assert_allclose(g.sum(axis=1), 0, atol=1e-15)


def test_softmax_cross_entropy_is_stable_for_huge_logits():
    loss = SoftmaxCrossEntropy()
    z = np.array([[1000.0, 0.0, -1000.0], [0.0, 1000.0, 1000.0]])
    with np.errstate(over="raise", invalid="raise"):
        value = loss.forward(z, np.array([0, 1]))
    # row 0: log(1 + e^-1000 + e^-2000) ~ 0; row 1: logsumexp = 1000 + log 2, minus 1000
    assert value == pytest.approx(np.log(2), rel=1e-12)
    np.testing.assert_allclose(loss.backward(), [[0, 0, 0], [0, -0.5, 0.5]], atol=1e-15)


@pytest.mark.parametrize("k, target_kind", [
    (1, "float (n,)"), (3, "float (n,k)"), (4, "int labels"),
])
def test_mean_squared_error_value_and_gradient(k, target_kind):
    rng = np.random.default_rng(4)
    n = 6
    pred = rng.standard_normal((n, k))
    if target_kind == "float (n,)":
        target = rng.standard_normal(n)
        t = target[:, None]
    elif target_kind == "float (n,k)":
        target = rng.standard_normal((n, k))
        t = target
    else:
        target = rng.integers(0, k, n)
        t = np.eye(k)[target]  # independent one-hot encoding
    loss = MeanSquaredError()
    assert not loss.classification
    value = loss.forward(pred, target)
    assert value == pytest.approx(np.sum(np.mean((pred - t) ** 2, axis=1)), rel=1e-13)
    g = loss.backward()
    assert g.shape == pred.shape
    np.testing.assert_allclose(g, 2 * (pred - t) / k, rtol=1e-13)
    num = numgrad(lambda: loss.forward(pred, target), pred)
    np.testing.assert_allclose(g, num, rtol=RTOL, atol=ATOL)


def test_n_correct_labels_and_one_hot():
    pred = np.array([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]])
    assert SoftmaxCrossEntropy().n_correct(pred, np.array([1, 1, 1])) == 2
    assert MeanSquaredError().n_correct(pred, np.eye(2)[[1, 0, 0]]) == 2
    assert SoftmaxCrossEntropy().n_correct(pred[:0], np.zeros(0, np.int64)) == 0


@pytest.mark.parametrize("loss_cls", [SoftmaxCrossEntropy, MeanSquaredError])
def test_losses_are_sums_not_means(loss_cls):
    """Duplicating the batch doubles the loss, and the per-row gradient is unchanged."""
    rng = np.random.default_rng(5)
    z = rng.standard_normal((4, 3))
    y = rng.integers(0, 3, 4)
    loss = loss_cls()
    v1 = loss.forward(z, y)
    g1 = loss.backward()
    v2 = loss.forward(np.concatenate([z, z]), np.concatenate([y, y]))
    g2 = loss.backward()
    assert v2 == pytest.approx(2 * v1, rel=1e-14)
    np.testing.assert_allclose(g2, np.concatenate([g1, g1]), rtol=1e-14)


def test_parameter_gradients_are_sums_over_samples():
    """Duplicating the batch doubles the loss and every parameter gradient (sum, not mean)."""
    rng = np.random.default_rng(6)
    model = mlp(3, (4,), 2, activation="tanh", dtype=np.float64).init_(0)
    loss = SoftmaxCrossEntropy()
    x = rng.standard_normal((5, 3))
    y = rng.integers(0, 2, 5)

    v1 = loss.forward(model(x), y)
    model.backward(loss.backward())
    g1 = model.grads.copy()
    v2 = loss.forward(model(np.concatenate([x, x])), np.concatenate([y, y]))
    model.backward(loss.backward())
    assert v2 == pytest.approx(2 * v1, rel=1e-14)
    np.testing.assert_allclose(model.grads, 2 * g1, rtol=1e-12, atol=1e-15)
    assert np.abs(g1).max() > 1e-3  # the comparison above is not vacuous


# ---------------------------------------------------------------------------- Sequential


def _hidden_preactivations(model, x):
    """Inputs to every activation layer, for a guard against ReLU kinks."""
    out = []
    for layer in model.layers:
        if isinstance(layer, (ReLU, Tanh, Sigmoid)):
            out.append(x.copy())
        x = layer.forward(x)
    return out


@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid"])
@pytest.mark.parametrize("loss_name", ["sce", "mse"])
def test_sequential_gradients_params_and_input(activation, loss_name):
    rng = np.random.default_rng(7)
    model = mlp(4, (5, 3), 3, activation=activation, dtype=np.float64).init_(11)
    model.params += 0.1 * rng.standard_normal(model.n_params)  # non-zero biases too
    x = rng.standard_normal((5, 4))
    if loss_name == "sce":
        loss, target = SoftmaxCrossEntropy(), rng.integers(0, 3, 5)
    else:
        loss, target = MeanSquaredError(), rng.standard_normal((5, 3))
    if activation == "relu":  # finite differences are only valid away from the kink
        for a in _hidden_preactivations(model, x):
            assert np.abs(a).min() > 1e-3

    f = lambda: loss.forward(model.forward(x), target)
    f()
    model.grads[...] = np.nan
    dx = model.backward(loss.backward())
    assert model.grads.shape == (model.n_params,)
    assert np.isfinite(model.grads).all()

    np.testing.assert_allclose(model.grads, numgrad(f, model.params), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(dx, numgrad(f, x), rtol=RTOL, atol=ATOL)


def test_accumulate_adds_instead_of_overwriting():
    rng = np.random.default_rng(8)
    model = mlp(3, (4,), 2, activation="tanh", dtype=np.float64).init_(1)
    loss = SoftmaxCrossEntropy()
    xa, ya = rng.standard_normal((3, 3)), rng.integers(0, 2, 3)
    xb, yb = rng.standard_normal((4, 3)), rng.integers(0, 2, 4)

    def grads_of(x, y):
        loss.forward(model(x), y)
        model.backward(loss.backward())
        return model.grads.copy()

    ga, gb = grads_of(xa, ya), grads_of(xb, yb)
    gab = grads_of(np.concatenate([xa, xb]), np.concatenate([ya, yb]))

    model.grads[...] = 123.0
    loss.forward(model(xa), ya)
    model.backward(loss.backward())  # overwrite: the 123 is gone
    np.testing.assert_allclose(model.grads, ga, rtol=1e-14)
    loss.forward(model(xb), yb)
    model.backward(loss.backward(), accumulate=True)
    np.testing.assert_allclose(model.grads, ga + gb, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(model.grads, gab, rtol=1e-12, atol=1e-15)

    # and for a lone Dense layer, each gradient array individually
    layer = bound_dense(3, 2, rng)
    x, dy = rng.standard_normal((4, 3)), rng.standard_normal((4, 2))
    layer.grads["W"][...] = 1.0
    layer.grads["b"][...] = 2.0
    layer.forward(x)
    layer.backward(dy, accumulate=True)
    np.testing.assert_allclose(layer.grads["W"], 1.0 + x.T @ dy, rtol=1e-14)
    np.testing.assert_allclose(layer.grads["b"], 2.0 + dy.sum(axis=0), rtol=1e-14)


@pytest.mark.parametrize("loss_cls", [SoftmaxCrossEntropy, MeanSquaredError])
@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid"])
def test_float32_model_keeps_float32(loss_cls, activation):
    rng = np.random.default_rng(9)
    model = mlp(4, (5,), 3, activation=activation, dtype=np.float32).init_(0)
    assert model.params.dtype == np.float32 and model.grads.dtype == np.float32
    x = rng.standard_normal((6, 4)).astype(np.float32)
    if loss_cls is SoftmaxCrossEntropy:
        target = rng.integers(0, 3, 6)
    else:
        target = rng.standard_normal((6, 3)).astype(np.float32)
    loss = loss_cls()
    out = model(x)
    assert out.dtype == np.float32
    value = loss.forward(out, target)
    dx = model.backward(loss.backward())
    model.backward(loss.backward(), accumulate=True)  # grads now hold twice the batch gradient
    assert model.params.dtype == np.float32
    assert model.grads.dtype == np.float32
    assert dx.dtype == np.float32
    for layer in model.layers:
        for k in layer.params:
            assert layer.params[k].dtype == np.float32 and layer.grads[k].dtype == np.float32

    # and the float32 gradient agrees with a float64 copy of the same model
    m64 = mlp(4, (5,), 3, activation=activation, dtype=np.float64)
    m64.params[...] = model.params
    v64 = loss.forward(m64(x.astype(np.float64)), target)
    m64.backward(loss.backward())
    assert value == pytest.approx(v64, rel=1e-5)
    np.testing.assert_allclose(model.grads, 2 * m64.grads, rtol=1e-4, atol=1e-5)


def test_empty_batch_gives_zero_loss_and_zero_grads():
    model = Sequential([Dense(3, 4, init="xavier")], 3, np.float64).init_(0)
    loss = SoftmaxCrossEntropy()
    model.grads[...] = 5.0  # stale values must be overwritten by zeros
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        out = model(np.zeros((0, 3)))
        assert out.shape == (0, 4)
        value = loss.forward(out, np.zeros(0, np.int64))
        dx = model.backward(loss.backward())
    assert value == 0.0
    assert dx.shape == (0, 3)
    np.testing.assert_array_equal(model.grads, np.zeros(model.n_params))
    # accumulating an empty batch leaves gradients unchanged
    model.grads[...] = 1.5
    loss.forward(model(np.zeros((0, 3))), np.zeros(0, np.int64))
    model.backward(loss.backward(), accumulate=True)
    np.testing.assert_array_equal(model.grads, np.full(model.n_params, 1.5))
