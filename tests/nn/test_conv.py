"""Convolution, pooling and reshaping layers (``mpidp.nn.conv``, ``pool``, ``reshape``).

Gradients are checked in float64 against central finite differences (tolerances as in
test_gradients.py: rtol=1e-6, atol=1e-8, a 10x margin over the numerical noise for the
O(1) functions checked here); forward passes against naive references written here with
explicit loops over output positions, independent of the layers' im2col / strided code.
"""

from __future__ import annotations

import copy
import itertools
import json

import numpy as np
import pytest
from helpers import numgrad

from mpidp import nn
from mpidp.nn import (
    AvgPool,
    Conv1d,
    Conv2d,
    Dense,
    Flatten,
    GlobalAvgPool,
    MaxPool,
    ReLU,
    Reshape,
    Sequential,
    SoftmaxCrossEntropy,
    Tanh,
)

EPS = 1e-6
RTOL, ATOL = 1e-6, 1e-8



def bound(layer, in_shape, rng, dtype=np.float64):
    """``layer`` with its shapes inferred from ``in_shape`` and random parameters bound
    (gradients NaN, so a gradient left unwritten shows); returns the output shape."""
    out = layer.output_shape(tuple(in_shape))
    shapes = layer.param_shapes()
    layer.bind({k: rng.standard_normal(s).astype(dtype) for k, s in shapes.items()},
               {k: np.full(s, np.nan, dtype) for k, s in shapes.items()})
    return out


def assert_close(a, b):
    np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


# ---------------------------------------------------------------------------- references


def _pair(v, nd):
    return (v,) * nd if isinstance(v, int) else tuple(v)


def conv_ref(x, W, b, stride, padding):
    """Cross-correlation by explicit loops over output positions."""
    nd = x.ndim - 2
    stride, padding = _pair(stride, nd), _pair(padding, nd)
    k = W.shape[2:]
    xp = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in padding])
    out = [(xp.shape[2 + d] - k[d]) // stride[d] + 1 for d in range(nd)]
    y = np.empty((x.shape[0], W.shape[0], *out))
    axes = list(range(1, 2 + nd))  # channels and kernel
    for pos in itertools.product(*map(range, out)):
        window = xp[(slice(None), slice(None),
                     *(slice(o * s, o * s + kk) for o, s, kk in zip(pos, stride, k)))]
        y[(slice(None), slice(None), *pos)] = np.tensordot(window, W, axes=(axes, axes)) + b
    return y


def pool_ref(x, size, stride, reduce):
    """Max or mean over windows by explicit loops over output positions."""
    nd = x.ndim - 2
    size = _pair(size, nd)
    stride = size if stride is None else _pair(stride, nd)
    out = [(x.shape[2 + d] - size[d]) // stride[d] + 1 for d in range(nd)]
    y = np.empty((*x.shape[:2], *out))
    axes = tuple(range(2, 2 + nd))
    for pos in itertools.product(*map(range, out)):
        window = x[(slice(None), slice(None),
                    *(slice(o * s, o * s + k) for o, s, k in zip(pos, stride, size)))]
        y[(slice(None), slice(None), *pos)] = reduce(window, axis=axes)
    return y


# (class, in_channels, out_channels, spatial, kernel, stride, padding)
CONV_CASES = [
    (Conv1d, 2, 3, (7,), 3, 1, 0),
    (Conv1d, 1, 2, (8,), 3, 2, 1),
    (Conv1d, 3, 2, (5,), 5, 3, 2),
    (Conv1d, 2, 2, (9,), 2, 3, 0),        # stride > kernel: inputs no window reads
    (Conv1d, 2, 1, (4,), 1, 1, 0),
    (Conv2d, 2, 3, (5, 6), 3, 1, 0),
    (Conv2d, 1, 2, (6, 5), (2, 3), (2, 1), (1, 0)),
    (Conv2d, 3, 2, (5, 5), 3, 2, 1),
    (Conv2d, 2, 2, (4, 7), (3, 2), (1, 3), (2, 1)),
    (Conv2d, 1, 1, (3, 3), 3, 1, 2),        # padding wider than the overlap
]
CONV_IDS = [f"{c[0].__name__}-C{c[1]}F{c[2]}-{c[3]}-k{c[4]}-s{c[5]}-p{c[6]}" for c in CONV_CASES]


# ---------------------------------------------------------------------------- conv


@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_conv_forward_matches_naive_loops(case):
    cls, C, F, spatial, k, s, p = case
    rng = np.random.default_rng(0)
    layer = cls(F, k, stride=s, padding=p)
    out = bound(layer, (C, *spatial), rng)
    x = rng.standard_normal((4, C, *spatial))
    y = layer.forward(x)
    assert y.shape == (4, *out) and y.flags.c_contiguous
    ref = conv_ref(x, layer.params["W"], layer.params["b"], s, p)
    np.testing.assert_allclose(y, ref, rtol=1e-12, atol=1e-12)
    # a non-contiguous input gives the same values
    xf = np.asfortranarray(x)
    np.testing.assert_allclose(layer.forward(xf), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", CONV_CASES, ids=CONV_IDS)
def test_conv_gradients(case):
    cls, C, F, spatial, k, s, p = case
    rng = np.random.default_rng(1)
    layer = cls(F, k, stride=s, padding=p)
    out = bound(layer, (C, *spatial), rng)
    x = rng.standard_normal((3, C, *spatial))
    w = rng.standard_normal((3, *out))
    layer.forward(x)
    dx = layer.backward(w)
    f = lambda: float(np.sum(w * layer.forward(x)))
    assert_close(dx, numgrad(f, x))
    for name in ("W", "b"):
        assert_close(layer.grads[name], numgrad(f, layer.params[name]))


@pytest.mark.parametrize("case", [CONV_CASES[1], CONV_CASES[8]], ids=[CONV_IDS[1], CONV_IDS[8]])
def test_conv_accumulate_and_no_input_grad(case):
    cls, C, F, spatial, k, s, p = case
    rng = np.random.default_rng(2)
    layer = cls(F, k, stride=s, padding=p)
    out = bound(layer, (C, *spatial), rng)
    x = rng.standard_normal((3, C, *spatial))
    w = rng.standard_normal((3, *out))
    layer.forward(x)
    dx = layer.backward(w)
    fresh = {k: v.copy() for k, v in layer.grads.items()}
    # need_input_grad=False: None back, the same parameter gradients written
    for v in layer.grads.values():
        v[...] = np.nan
    assert layer.backward(w, need_input_grad=False) is None
    for name, g in fresh.items():
        np.testing.assert_array_equal(layer.grads[name], g)
    # accumulate=True adds to what is there
    before = {k: rng.standard_normal(v.shape) for k, v in layer.grads.items()}
    for name, v in layer.grads.items():
        v[...] = before[name]
    dx2 = layer.backward(w, accumulate=True)
    np.testing.assert_array_equal(dx2, dx)
    for name in fresh:
        np.testing.assert_allclose(layer.grads[name], before[name] + fresh[name], rtol=1e-13, atol=1e-13)


def test_conv_shapes_params_init_and_config():
    layer = Conv2d(4, (3, 2), stride=(2, 1), padding=1)
    assert layer.output_shape((3, 9, 8)) == (4, 5, 9)
    assert layer.in_channels == 3
    assert layer.param_shapes() == {"W": (4, 3, 3, 2), "b": (4,)}
    cfg = layer.config()
    assert cfg == {"out_channels": 4, "kernel": [3, 2], "stride": [2, 1], "padding": 1,
                   "in_channels": 3, "init": "he"}
    assert Conv2d(**json.loads(json.dumps(cfg))).config() == cfg
    assert Conv1d(2, 3).output_shape((5, 10)) == (2, 8)
    assert Conv1d(2, 3, stride=2, padding=1).output_shape((1, 10)) == (2, 5)  # floor((10+2-3)/2)+1

    big = Conv2d(64, 3, in_channels=32)
    shapes = big.param_shapes()
    big.bind({k: np.full(s, np.nan) for k, s in shapes.items()}, {})
    big.init_(np.random.default_rng(0))
    std = big.params["W"].std()
    assert abs(std / np.sqrt(2.0 / (32 * 9)) - 1) < 0.02  # He: fan-in = C * kh * kw
    assert not big.params["b"].any()
    with pytest.raises(ValueError, match="in_channels is not known"):
        Conv2d(3, 3).param_shapes()


def test_conv_stays_float32():
    rng = np.random.default_rng(3)
    model = Sequential([Conv2d(3, 3, padding=1), MaxPool(2), AvgPool(2),
                        GlobalAvgPool(), Dense(None, 2)], (2, 8, 8), np.float32).init_(0)
    for x in (rng.standard_normal((5, 2, 8, 8)).astype(np.float32),
              rng.standard_normal((5, 2, 8, 8))):  # a float64 input is cast, not upcast to
        h = x
        for layer in model.layers:
            h = layer.forward(h)
            assert h.dtype == np.float32, layer
        d = np.ones_like(h)
        for layer in reversed(model.layers):
            d = layer.backward(d)
            assert d.dtype == np.float32, layer
    conv = model.layers[0]
    y = conv.forward(rng.standard_normal((2, 2, 8, 8)))
    dx = conv.backward(np.ones(y.shape))  # a float64 dy too
    assert y.dtype == dx.dtype == conv.grads["W"].dtype == np.float32


# ---------------------------------------------------------------------------- pools

POOL_CASES = [  # (in per-sample shape, size, stride)
    ((2, 8), 2, None),
    ((3, 9), 3, 2),           # overlapping windows
    ((2, 10), 2, 3),          # gaps
    ((2, 6, 6), 2, None),
    ((1, 7, 5), (3, 2), (2, 1)),
    ((2, 5, 7), 3, 2),
    ((2, 6, 9), (2, 3), None),
]
POOL_IDS = [f"{s}-k{k}-s{st}" for s, k, st in POOL_CASES]


@pytest.mark.parametrize("case", POOL_CASES, ids=POOL_IDS)
@pytest.mark.parametrize("cls,reduce", [(MaxPool, np.max), (AvgPool, np.mean)], ids=["max", "avg"])
def test_pool_forward_matches_naive_loops(case, cls, reduce):
    shape, size, stride = case
    layer = cls(size, stride)
    x = np.random.default_rng(4).standard_normal((3, *shape))
    y = layer.forward(x)
    assert y.shape == (3, *layer.output_shape(shape))
    np.testing.assert_allclose(y, pool_ref(x, size, stride, reduce), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("case", POOL_CASES, ids=POOL_IDS)
@pytest.mark.parametrize("cls", [MaxPool, AvgPool])
def test_pool_gradients(case, cls):
    shape, size, stride = case
    rng = np.random.default_rng(5)
    layer = cls(size, stride)
    x = rng.standard_normal((2, *shape))  # distinct values: the argmax is stable under EPS
    w = rng.standard_normal((2, *layer.output_shape(shape)))
    layer.forward(x)
    dx = layer.backward(w)
    assert_close(dx, numgrad(lambda: float(np.sum(w * layer.forward(x))), x))
    layer.forward(x)
    assert layer.backward(w, need_input_grad=False) is None
    np.testing.assert_array_equal(layer.backward(w, accumulate=True), dx)  # no params: same


def test_maxpool_ties_route_to_the_first_maximum_only():
    x = np.zeros((1, 1, 4, 4))
    pool = MaxPool(2)
    pool.forward(x)
    dx = pool.backward(np.full((1, 1, 2, 2), 3.0))
    want = np.zeros((1, 1, 4, 4))
    want[0, 0, ::2, ::2] = 3.0
    np.testing.assert_array_equal(dx, want)
    # overlapping windows (size 3, stride 1) on a constant signal: each window's first
    # element gets its gradient; the sum is the sum of dy
    x = np.ones((2, 3, 7))
    pool = MaxPool(3, 1)
    dy = np.random.default_rng(6).standard_normal((2, 3, 5))
    pool.forward(x)
    dx = pool.backward(dy)
    np.testing.assert_allclose(dx.sum(axis=2), dy.sum(axis=2), rtol=1e-13)
    np.testing.assert_array_equal(dx[..., :5], dy)
    np.testing.assert_array_equal(dx[..., 5:], 0)
    # a tie between a later and an earlier element of the window: the earlier wins
    x = np.array([[[1.0, 5.0, 5.0, 2.0]]])
    pool = MaxPool(4)
    pool.forward(x)
    np.testing.assert_array_equal(pool.backward(np.ones((1, 1, 1))), [[[0, 1, 0, 0]]])


@pytest.mark.parametrize("shape", [(3, 5), (2, 4, 3), (2, 3, 2, 2)])
def test_global_avg_pool(shape):
    rng = np.random.default_rng(7)
    layer = GlobalAvgPool()
    assert layer.output_shape(shape) == (shape[0],)
    x = rng.standard_normal((3, *shape))
    y = layer.forward(x)
    np.testing.assert_allclose(y, x.reshape(3, shape[0], -1).mean(axis=2), rtol=1e-13)
    w = rng.standard_normal(y.shape)
    assert_close(layer.backward(w), numgrad(lambda: float(np.sum(w * layer.forward(x))), x))
    assert layer.backward(w, need_input_grad=False) is None


# ---------------------------------------------------------------------------- reshape


def test_flatten_and_reshape():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 2, 3, 4))
    flat = Flatten()
    assert flat.output_shape((2, 3, 4)) == (24,)
    y = flat.forward(x)
    assert y.shape == (3, 24) and np.shares_memory(y, x)  # a view
    np.testing.assert_array_equal(y, x.reshape(3, 24))
    w = rng.standard_normal(y.shape)
    assert_close(flat.backward(w), numgrad(lambda: float(np.sum(w * flat.forward(x))), x))
    assert flat.backward(w, need_input_grad=False) is None

    r = Reshape((4, -1))
    assert r.output_shape((2, 3, 4)) == (4, 6)
    y = r.forward(x)
    np.testing.assert_array_equal(y, x.reshape(3, 4, 6))
    np.testing.assert_array_equal(r.backward(y), x)
    assert Reshape([1, 28, 28]).output_shape((784,)) == (1, 28, 28)
    assert Reshape(24).output_shape((2, 3, 4)) == (24,)
    assert Reshape(**json.loads(json.dumps(r.config()))).config() == {"shape": [4, -1]}


# ---------------------------------------------------------------------------- empty shards


EMPTY = [
    (lambda: Conv1d(3, 2, padding=1), (2, 6)),
    (lambda: Conv2d(3, (2, 3), stride=2), (2, 6, 7)),
    (lambda: MaxPool(2), (2, 6)),
    (lambda: MaxPool((2, 3), 1), (2, 6, 7)),
    (lambda: AvgPool(3, 2), (2, 6, 7)),
    (lambda: GlobalAvgPool(), (2, 6, 7)),
    (lambda: Flatten(), (2, 6, 7)),
    (lambda: Reshape((7, -1)), (2, 6, 7)),
]


@pytest.mark.parametrize("make,shape", EMPTY, ids=[f"{i}" for i in range(len(EMPTY))])
def test_empty_batch(make, shape):
    layer = make()
    out = bound(layer, shape, np.random.default_rng(9))
    y = layer.forward(np.zeros((0, *shape)))
    assert y.shape == (0, *out)
    dx = layer.backward(np.zeros((0, *out)))
    assert dx.shape == (0, *shape)
    for g in layer.grads.values():  # a sum over no samples
        np.testing.assert_array_equal(g, 0)
    assert layer.backward(np.zeros((0, *out)), need_input_grad=False) is None


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize("make,match", [
    (lambda: Conv2d(0, 3), "out_channels >= 1"),
    (lambda: Conv2d(2, 0), "kernel must be >= 1"),
    (lambda: Conv2d(2, (3, 3, 3)), "kernel must be an int or a sequence of 2 ints"),
    (lambda: Conv2d(2, 3, padding=-1), "padding must be >= 0"),
    (lambda: Conv1d(2, (3, 3)), "kernel must be an int"),
    (lambda: Conv1d(2, 3, stride=True), "stride must be an int"),
    (lambda: Conv2d(2, 3, init="ones"), "unknown init"),
    (lambda: MaxPool(0), "size must be >= 1"),
    (lambda: AvgPool((2, 2, 2)), "int or a pair"),
    (lambda: Reshape((-1, -1)), "at most one -1"),
    (lambda: Reshape((2, 0)), "sizes >= 1"),
])
def test_bad_settings(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("layer,shape,match", [
    (Conv2d(2, 5), (1, 4, 9), "input height 4 is smaller than the window 5"),
    (Conv2d(2, 5, padding=(0, 1)), (1, 9, 2), r"input width 2 \+ 2\*1 padding is smaller"),
    (Conv1d(2, 3), (1, 2), "input length 2 is smaller"),
    (Conv2d(2, 3, in_channels=3), (1, 9, 9), "expects 3 input channels, got 1"),
    (Conv2d(2, 3), (1, 9), r"samples of shape \(channels, height, width\)"),
    (Conv1d(2, 3), (9,), r"samples of shape \(channels, length\)"),
    (MaxPool(3), (2, 2), "input length 2 is smaller than the window 3"),
    (MaxPool((2, 2)), (2, 8), r"needs \(n, C, H, W\) inputs"),
    (AvgPool(2), (8,), r"\(C, L\) or \(C, H, W\)"),
    (GlobalAvgPool(), (8,), "at least one spatial axis"),
    (Reshape((5, -1)), (2, 3, 4), "not a multiple of 5"),
    (Reshape((5, 5)), (2, 3, 4), "hold 24 values, but shape"),
])
def test_shape_errors(layer, shape, match):
    with pytest.raises(ValueError, match=match):
        layer.output_shape(shape)


def test_shape_errors_in_forward_and_in_a_model():
    conv = Conv2d(2, 3, in_channels=3)
    bound(conv, (3, 5, 5), np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"takes a batch of shape \(n, 3, height, width\)"):
        conv.forward(np.zeros((2, 1, 5, 5)))
    with pytest.raises(ValueError, match="smaller than the window"):
        conv.forward(np.zeros((2, 3, 2, 5)))
    conv.forward(np.zeros((2, 3, 5, 5)))
    with pytest.raises(ValueError, match="dy has shape"):
        conv.backward(np.zeros((2, 2, 4, 3)))
    with pytest.raises(ValueError, match="layer 2 .*input height 2 is smaller"):
        Sequential([Conv2d(2, 3), MaxPool(2), Conv2d(2, 3)], (1, 6, 6))
    with pytest.raises(ValueError, match="put a Flatten in front"):
        Sequential([Conv2d(2, 3), Dense(None, 3)], (1, 6, 6))


# ---------------------------------------------------------------------------- models


def small_cnn(dtype=np.float64) -> Sequential:
    return Sequential([Conv2d(3, 3, padding=1), Tanh(), MaxPool(2), Conv2d(4, (2, 3), stride=(1, 2)),
                       ReLU(), AvgPool((2, 1)), Flatten(), Dense(None, 5), Tanh(), Dense(None, 3)],
                      (2, 8, 10), dtype)


def small_cnn_1d(dtype=np.float64) -> Sequential:
    return Sequential([Reshape((2, -1)), Conv1d(3, 3, stride=2, padding=1), Tanh(), MaxPool(3, 2),
                       Conv1d(4, 2), GlobalAvgPool(), Dense(None, 3)], (24,), dtype)


@pytest.mark.parametrize("build", [small_cnn, small_cnn_1d], ids=["2d", "1d"])
def test_whole_cnn_gradient(build):
    rng = np.random.default_rng(10)
    model = build().init_(11)
    model.params += 0.1 * rng.standard_normal(model.n_params)  # non-zero biases too
    x = rng.standard_normal((4, *model.in_shape))
    y = rng.integers(0, 3, 4)
    loss = SoftmaxCrossEntropy()
    f = lambda: loss.forward(model.forward(x), y)
    f()
    dx = model.backward(loss.backward())
    assert_close(model.grads, numgrad(f, model.params))
    assert_close(dx, numgrad(f, x))


@pytest.mark.parametrize("build", [small_cnn, small_cnn_1d], ids=["2d", "1d"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_spec_round_trip_and_save_load(tmp_path, build, dtype):
    model = build(dtype).init_(12)
    model.params += np.random.default_rng(13).standard_normal(model.n_params).astype(dtype) * 0.1
    spec = model.spec()
    again = nn.from_spec(json.loads(json.dumps(spec)), dtype)
    assert again.spec() == spec and again.n_params == model.n_params
    assert [type(a) for a in again.layers] == [type(a) for a in model.layers]
    path = nn.save(model, tmp_path / "cnn.npz")
    back = nn.load(path)
    assert back.spec() == spec and back.dtype == np.dtype(dtype)
    x = np.random.default_rng(14).standard_normal((6, *model.in_shape)).astype(dtype)
    assert back.predict(x).tobytes() == model.predict(x).tobytes()
    assert back.predict(x, "label").tolist() == model.predict(x, "label").tolist()


def test_lenet_shapes():
    model = Sequential([Conv2d(6, 5), ReLU(), MaxPool(2), Conv2d(16, 5), ReLU(), MaxPool(2), Flatten(),
                        Dense(None, 120), ReLU(), Dense(None, 84), ReLU(), Dense(None, 10)],
                       (1, 28, 28))
    assert model.shapes[1:4] == [(6, 24, 24), (6, 24, 24), (6, 12, 12)]
    assert model.shapes[6:8] == [(16, 4, 4), (256,)]
    assert model.n_params == 6 * 25 + 6 + 16 * 6 * 25 + 16 + 256 * 120 + 120 + 120 * 84 + 84 + 84 * 10 + 10


@pytest.mark.parametrize("make,shape", [(lambda: Conv2d(2, 3, stride=2, padding=1), (2, 7, 6)),
                                        (lambda: MaxPool(3, 2), (2, 7, 6)),
                                        (lambda: AvgPool(2), (2, 7, 6))], ids=["conv", "max", "avg"])
def test_shallow_copies_keep_private_caches(make, shape):
    """A pipeline runs micro-batches through shallow copies of a layer (shared parameters,
    private caches): forward of the second copy must not change what the first back-propagates."""
    rng = np.random.default_rng(15)
    layer = make()
    out = bound(layer, shape, rng)
    x1, x2 = rng.standard_normal((2, 3, *shape))
    w = rng.standard_normal((3, *out))
    layer.forward(x1)
    want = layer.backward(w)
    grads = {k: v.copy() for k, v in layer.grads.items()}
    a, b = copy.copy(layer), copy.copy(layer)
    a.forward(x1)
    b.forward(x2)
    np.testing.assert_array_equal(a.backward(w), want)
    for k, v in grads.items():
        np.testing.assert_array_equal(a.grads[k], v)
