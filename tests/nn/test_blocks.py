"""Activations, Embedding and Residual: finite differences (float64), shapes, errors, and a
save/load round trip of nested blocks."""

from __future__ import annotations

import copy
import math
import re

import numpy as np
import pytest
from helpers import numgrad

from mpidp import nn
from mpidp.nn import (
    GELU,
    BatchNorm,
    Context,
    Dense,
    Dropout,
    Embedding,
    LeakyReLU,
    ReLU,
    Residual,
    Sigmoid,
    Softmax,
    Tanh,
)

RTOL, ATOL = 1e-6, 1e-8



def bound(layer, in_shape, rng, context=None):
    layer.output_shape(in_shape)
    shapes = layer.param_shapes()
    layer.bind({k: rng.standard_normal(s) for k, s in shapes.items()},
               {k: np.full(s, np.nan) for k, s in shapes.items()})
    layer.bind_state({k: rng.random(s) + 0.5 for k, s in layer.state_shapes().items()})
    layer.set_context(context or Context(), (0,))
    return layer


def check_gradients(layer, x, rng, input_grad=True):
    """dx (unless ``input_grad`` is False) and every parameter gradient against central
    differences; accumulate adds; need_input_grad=False returns None."""
    w = rng.standard_normal(layer.forward(x).shape)
    dx = layer.backward(w)
    f = lambda: float(np.sum(w * layer.forward(x)))
    if input_grad:
        np.testing.assert_allclose(dx, numgrad(f, x), rtol=RTOL, atol=ATOL)
    grads = {k: g.copy() for k, g in layer.grads.items()}
    for k, p in layer.params.items():
        np.testing.assert_allclose(grads[k], numgrad(f, p), rtol=RTOL, atol=ATOL, err_msg=k)
    layer.forward(x)
    base = {k: rng.standard_normal(g.shape) for k, g in layer.grads.items()}
    for k, g in layer.grads.items():
        g[...] = base[k]
    assert layer.backward(w, accumulate=True, need_input_grad=False) is None
    for k, g in layer.grads.items():
        np.testing.assert_allclose(g, base[k] + grads[k], rtol=1e-12, atol=1e-12, err_msg=k)


# ---------------------------------------------------------------------------- activations

def _away_from_zero(rng, shape):
    """Inputs at least 0.05 from the kinks of ReLU and LeakyReLU."""
    x = rng.standard_normal(shape)
    return np.where(x >= 0, x + 0.05, x - 0.05)


ACTIVATIONS = [ReLU(), LeakyReLU(0.2), Tanh(), Sigmoid(), GELU(), Softmax()]


@pytest.mark.parametrize("shape", [(4, 3), (2, 3, 4), (2, 2, 3, 3), (0, 3)])
@pytest.mark.parametrize("layer", ACTIVATIONS, ids=lambda la: type(la).__name__)
def test_activation_gradients(layer, shape):
    rng = np.random.default_rng(0)
    layer = copy.copy(layer)
    x = 2 * _away_from_zero(rng, shape)
    y = layer.forward(x)
    assert y.shape == x.shape
    w = rng.standard_normal(shape)
    dx = layer.backward(w)
    np.testing.assert_allclose(dx, numgrad(lambda: float(np.sum(w * layer.forward(x))), x),
                               rtol=RTOL, atol=ATOL)
    layer.forward(x)
    assert layer.backward(w, need_input_grad=False) is None
    assert layer.forward(x.astype(np.float32)).dtype == np.float32


def test_activation_values():
    x = np.linspace(-6, 6, 49).reshape(7, 7)
    np.testing.assert_array_equal(LeakyReLU(0.1).forward(x), np.where(x > 0, x, 0.1 * x))
    c = math.sqrt(2 / math.pi)
    np.testing.assert_allclose(GELU().forward(x), 0.5 * x * (1 + np.tanh(c * (x + 0.044715 * x ** 3))),
                               rtol=1e-14, atol=1e-15)
    exact = x * 0.5 * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
    assert np.max(np.abs(GELU().forward(x) - exact)) < 1e-3  # the tanh approximation
    s = Softmax().forward(np.array([[1000.0, 1000.0, -1000.0], [0.0, np.log(3.0), -np.inf]]))
    np.testing.assert_allclose(s, [[0.5, 0.5, 0.0], [0.25, 0.75, 0.0]], rtol=1e-14, atol=1e-300)
    z = np.random.default_rng(1).standard_normal((3, 4, 5))
    np.testing.assert_allclose(Softmax().forward(z).sum(axis=-1), 1, rtol=1e-14)


def test_activations_registered_and_rebuilt():
    layers = [ReLU(), LeakyReLU(0.3), Tanh(), Sigmoid(), GELU(), Softmax()]
    model = nn.Sequential([Dense(3, 3), *layers], 3, np.float64)
    spec = model.spec()
    assert [d["type"] for d in spec[1:]] == ["ReLU", "LeakyReLU", "Tanh", "Sigmoid", "GELU", "Softmax"]
    assert spec[1] == {"type": "ReLU"} and spec[2] == {"type": "LeakyReLU", "slope": 0.3}
    again = nn.from_spec(spec, np.float64)
    assert [type(a) for a in again.layers] == [type(a) for a in model.layers]
    assert again.layers[2].slope == 0.3
    assert nn.ReLU is nn.activations.ReLU and nn.registered_layers()["ReLU"] is ReLU
    for bad in (float("inf"), "0.1", None):
        with pytest.raises(ValueError, match="slope"):
            LeakyReLU(bad)


def test_mlp_preset_still_uses_inplace_relu():
    model = nn.mlp(4, [5], 2)
    assert isinstance(model.layers[1], ReLU) and model.layers[1].inplace


# ---------------------------------------------------------------------------- Embedding


def test_embedding_forward_and_gradient_touches_only_used_rows():
    rng = np.random.default_rng(2)
    layer = bound(Embedding(10, 3), (2, 2), rng)
    ids = np.array([[[1, 4], [4, 7]], [[1, 1], [0, 4]]], dtype=np.float64)  # (2, 2, 2)
    y = layer.forward(ids)
    assert y.shape == (2, 2, 2, 3)
    np.testing.assert_array_equal(y, layer.params["W"][ids.astype(int)])
    np.testing.assert_array_equal(layer.forward(ids.astype(np.int32)), y)
    check_gradients(layer, ids, rng, input_grad=False)
    dy = rng.standard_normal(y.shape)
    layer.forward(ids)
    assert layer.backward(dy) is None
    want = np.zeros((10, 3))
    for i, t in enumerate(ids.astype(int).reshape(-1)):
        want[t] += dy.reshape(-1, 3)[i]
    np.testing.assert_allclose(layer.grads["W"], want, rtol=1e-14)
    unused = [2, 3, 5, 6, 8, 9]
    assert not layer.grads["W"][unused].any()
    layer.grads["W"][...] = 5.0
    layer.backward(dy, accumulate=True)
    np.testing.assert_array_equal(layer.grads["W"][unused], 5.0)
    np.testing.assert_allclose(layer.grads["W"], want + 5.0, rtol=1e-14)


@pytest.mark.parametrize("bad, value", [(10, "10.0"), (-1, "-1.0"), (2.5, "2.5"), (np.nan, "nan"),
                                        (np.inf, "inf"), (1e30, "1e+30")])
def test_embedding_refuses_bad_ids(bad, value):
    layer = bound(Embedding(10, 3), (4,), np.random.default_rng(0))
    x = np.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, bad, 7.0]])
    with pytest.raises(ValueError, match=rf"token id {re.escape(value)} at batch position \(1, 2\) is not a "
                                         rf"whole number in \[0, 10\)"):
        layer.forward(x)
    if float(bad).is_integer() and abs(bad) < 100:
        with pytest.raises(ValueError, match=rf"token id {int(bad)} at"):
            layer.forward(x.astype(np.int64))
    with pytest.raises(ValueError, match="dtype"):
        layer.forward(np.array([["a", "b"]]))


def test_embedding_in_a_model_and_settings():
    model = nn.Sequential([Embedding(20, 4, init="xavier"), nn.LayerNorm(), Tanh()], 6, np.float64)
    model.init_(0)
    assert model.out_shape == (6, 4) and model.spec()[0]["n_tokens"] == 20
    x = np.random.default_rng(3).integers(0, 20, (5, 6)).astype(np.float64)
    y = model(x)
    assert model.backward(np.ones_like(y), input_grad=False) is None
    assert np.abs(model.layers[0].params["W"]).max() <= math.sqrt(6 / 24)
    again = nn.from_spec(model.spec(), np.float64)
    assert again.layers[0].config() == {"n_tokens": 20, "dim": 4, "init": "xavier"}
    for bad in ({"n_tokens": 0, "dim": 3}, {"n_tokens": 3, "dim": 2.0},
                {"n_tokens": 3, "dim": 2, "init": "he"}):
        with pytest.raises(ValueError, match="Embedding"):
            Embedding(**bad)


# ---------------------------------------------------------------------------- Residual


def test_residual_gradients_through_the_block():
    rng = np.random.default_rng(4)
    block = Residual([Dense(4, 5), Tanh(), Dense(5, 4), GELU()])
    bound(block, (4,), rng)
    assert list(block.param_shapes()) == ["0.W", "0.b", "2.W", "2.b"]
    assert np.shares_memory(block.layers[2].params["W"], block.params["2.W"])
    check_gradients(block, rng.standard_normal((6, 4)), rng)


def test_residual_with_batchnorm_and_nested_block_gradients():
    rng = np.random.default_rng(5)
    inner = Residual([Dense(3, 3), Sigmoid()])
    block = Residual([BatchNorm(), Dense(3, 3), inner, LeakyReLU(0.1)])
    bound(block, (3,), rng, Context(training=True))
    assert list(block.param_shapes()) == ["0.gamma", "0.beta", "1.W", "1.b", "2.0.W", "2.0.b"]
    assert list(block.state_shapes()) == ["0.mean", "0.var"]
    assert inner.layers[0].key == (0, 2, 0) and block.layers[0].context is block.context
    check_gradients(block, rng.standard_normal((7, 3)), rng)


def test_residual_output_is_x_plus_f_x_and_does_not_touch_inputs():
    rng = np.random.default_rng(6)
    block = bound(Residual([Dropout(0.5), Tanh()]), (3,), rng)  # eval: Dropout returns x itself
    x = rng.standard_normal((4, 3))
    keep = x.copy()
    np.testing.assert_allclose(block.forward(x), x + np.tanh(x), rtol=1e-15)
    dy = rng.standard_normal((4, 3))
    dcopy = dy.copy()
    np.testing.assert_allclose(block.backward(dy), dy + dy * (1 - np.tanh(x) ** 2), rtol=1e-14)
    assert np.array_equal(x, keep) and np.array_equal(dy, dcopy)
    block = bound(Residual([Dense(3, 3), ReLU(inplace=True)]), (3,), rng)  # overwrites dy
    block.forward(x)
    g = block.backward(dy)
    assert np.array_equal(dy, dcopy) and g.shape == dy.shape


def test_residual_refuses_what_it_cannot_add():
    with pytest.raises(ValueError, match=r"keep the per-sample shape: they map \(4,\) to \(3,\)"):
        nn.Sequential([Residual([Dense(4, 3)])], 4)
    with pytest.raises(ValueError, match="layer 1"):
        Residual([Dense(4, 3), Dense(4, 4)]).output_shape((4,))
    with pytest.raises(ValueError, match="overwrites its input"):
        Residual([ReLU(inplace=True), Dense(4, 4)])
    for bad in ([], [Dense(2, 2), "relu"]):
        with pytest.raises(ValueError, match="non-empty list of layers"):
            Residual(bad)


def test_residual_save_load_round_trip_with_state(tmp_path):
    layers = [Dense(5, 6), Residual([Dense(6, 6), BatchNorm(momentum=0.3), Tanh(),
                                     Residual([Dense(6, 6), GELU(), Dropout(0.2)])]),
              nn.LayerNorm(), Dense(6, 2)]
    model = nn.Sequential(layers, 5, np.float64).init_(7)
    assert model.needs == {"replica-sums", "sample-index"} and model.n_state == 12
    rng = np.random.default_rng(8)
    model.context.training, model.context.index = True, np.arange(9)
    model(rng.standard_normal((9, 5)))  # moves BatchNorm's running statistics
    model.context.training = False
    assert not np.array_equal(model.state[:6], np.zeros(6))
    spec = model.spec()
    assert spec[1]["layers"][3] == {"type": "Residual", "layers": [
        {"type": "Dense", "n_in": 6, "n_out": 6}, {"type": "GELU"}, {"type": "Dropout", "rate": 0.2}]}
    again = nn.load(nn.save(model, tmp_path / "m.npz"))
    assert again.spec() == spec
    assert again.params.tobytes() == model.params.tobytes()
    assert again.state.tobytes() == model.state.tobytes()
    x = rng.standard_normal((4, 5))
    np.testing.assert_array_equal(again.predict(x), model.predict(x))
    bn = again.layers[1].layers[1]
    assert np.shares_memory(bn.state["var"], again.state) and bn.momentum == 0.3
    with pytest.raises(ValueError, match="Residual settings"):
        Residual.from_config({"layers": [], "extra": 1})


def test_residual_from_a_model_file_style_spec_infers_sizes():
    block = Residual.from_config({"layers": [{"type": "Dense", "n_out": 4}, {"type": "ReLU"},
                                             {"type": "Dense", "n_out": 4}]})
    model = nn.Sequential([block], 4, np.float64)
    assert model.n_params == 2 * (4 * 4 + 4) and block.layers[0].n_in == 4
    with pytest.raises(ValueError, match="Residual: layer 2"):
        Residual.from_config({"layers": [{"type": "Dense", "n_out": 4}, {"type": "NoSuchLayer"}]})
    with pytest.raises(ValueError, match="'type' string"):
        Residual.from_config({"layers": [{"n_out": 4}]})


def test_residual_copy_has_its_own_inner_layers():
    block = bound(Residual([Dense(2, 2), Tanh()]), (2,), np.random.default_rng(9))
    twin = copy.copy(block)
    assert twin.layers[0] is not block.layers[0]
    assert twin.layers[0].params["W"] is block.layers[0].params["W"]
    x = np.ones((3, 2))
    twin.forward(x)
    block.forward(2 * x)
    assert twin.layers[1]._y.shape == (3, 2) and not np.allclose(twin.layers[1]._y, block.layers[1]._y)
