"""``Sequential.backward(on_layer_done=...)`` hears of a layer as soon as its gradients are
final: a ``Dense`` before it computes its input gradient, a block once all of it is done,
never a layer nested in a block on its own."""

from __future__ import annotations

import numpy as np

from mpidp import nn


class _Logged(np.ndarray):
    """A weight view that logs when its transpose is taken (Dense's input gradient)."""

    @property
    def T(self):  # noqa: N802 - numpy's name
        if getattr(self, "log", None) is not None:  # the weights, not arrays made from them
            self.log.append(("input-grad", self.who))
        return np.asarray(self).T


def _model():
    layers = [nn.Dense(6, 8), nn.ReLU(), nn.Residual([nn.Dense(8, 8), nn.Tanh(), nn.Dense(8, 8)]),
              nn.Dense(8, 3)]
    return nn.Sequential(layers, 6, dtype=np.float64).init_(0)


def _backward(model, log):
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((5, 6)), rng.integers(0, 3, 5)
    loss = nn.SoftmaxCrossEntropy()
    out = model.forward(x)
    seen = {}

    def done(i):
        log.append(("done", i))
        lo, hi = model.layer_ranges[i]
        seen[i] = model.grads[lo:hi].copy()

    loss.forward(out, y)
    model.backward(loss.backward(), input_grad=False, on_layer_done=done)
    return seen


def test_each_layer_is_heard_once_with_its_final_gradients():
    model, log = _model(), []
    seen = _backward(model, log)
    assert [e for e in log if e[0] == "done"] == [("done", i) for i in (3, 2, 1, 0)]
    for i, g in seen.items():  # what the listener saw is what backward left
        lo, hi = model.layer_ranges[i]
        np.testing.assert_array_equal(g, model.grads[lo:hi])
    assert model.context.grads_final(model.layers[0]) is None  # reset after backward


def test_a_dense_layer_is_heard_before_its_input_gradient():
    model, log = _model(), []
    for i in (0, 3):
        W = model.layers[i].params["W"].view(_Logged)
        W.log, W.who = log, i
        model.layers[i].params["W"] = W
    _backward(model, log)
    assert log.index(("done", 3)) < log.index(("input-grad", 3))
    assert ("input-grad", 0) not in log  # the first layer's input gradient is not needed
    # the block's inner Dense layers do not announce the block before it is done
    assert log[log.index(("done", 3)) + 1:log.index(("done", 2))] == [("input-grad", 3)]



def test_a_convolution_is_heard_before_its_input_gradient(monkeypatch):
    from mpidp.nn import conv as conv_module
    log, tap = [], conv_module.tap

    def logged_tap(*a):  # col2im, the input gradient's work
        log.append("input-grad")
        return tap(*a)

    monkeypatch.setattr(conv_module, "tap", logged_tap)
    model = nn.Sequential([nn.Conv1d(1, 2, 3, padding=1), nn.ReLU(), nn.Conv1d(2, 3, 3, padding=1),
                           nn.Flatten(), nn.Dense(None, 2)], (1, 6), dtype=np.float64).init_(0)
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((4, 1, 6)), rng.integers(0, 2, 4)
    loss = nn.SoftmaxCrossEntropy()
    loss.forward(model.forward(x), y)
    log.clear()
    model.backward(loss.backward(), input_grad=False, on_layer_done=lambda i: log.append(i))
    first = log.index("input-grad")
    assert log[:first] == [4, 3, 2]  # the second convolution, before its col2im
    assert log[first:].count("input-grad") == 3 and log[-2:] == [1, 0]


def test_a_subclass_that_overrides_backward_is_heard_only_when_it_returns():
    """It may change its gradients after the base class computed them (a frozen layer)."""

    class Frozen(nn.Dense):
        def backward(self, dy, accumulate=False, need_input_grad=True):
            dx = super().backward(dy, accumulate, need_input_grad)
            self.grads["W"][...] = 0.0
            return dx

    model = nn.Sequential([nn.Dense(6, 8), nn.ReLU(), Frozen(8, 3)], 6, dtype=np.float64).init_(0)
    seen = _backward(model, [])
    lo, hi = model.layer_ranges[2]
    np.testing.assert_array_equal(seen[2], model.grads[lo:hi])  # heard with the zeros
    assert not model.layers[2].grads["W"].any()


def _parts(model, piece, fill=np.nan):
    """Backward with ``on_layer_part``: what each call saw of its layer's range, and the
    order of every call. The gradient buffer starts as ``fill``."""
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((7, model.n_in)), rng.integers(0, 3, 7)
    loss = nn.SoftmaxCrossEntropy()
    loss.forward(model.forward(x), y)
    model.grads[...] = fill
    log, seen = [], []

    def part(i, done):
        log.append(("part", i, done))
        lo, hi = model.layer_ranges[i]
        seen.append((i, done, model.grads[lo:hi].copy()))

    model.backward(loss.backward(), input_grad=False, on_layer_done=lambda i: log.append(("done", i)),
                   on_layer_part=part, piece=piece)
    return log, seen


def test_a_large_dense_layer_announces_its_gradient_in_leading_parts():
    """With ``piece`` = 20 values, ``Dense(9, 8)`` computes dW 3 rows at a time (24
    values; ``Dense(8, 3)`` 7 rows, 21 values) and says after each part but the last how
    many leading values are final; the rest of its range is not computed yet then; the
    gradients are those of one product."""
    model = nn.Sequential([nn.Dense(9, 8), nn.ReLU(), nn.Dense(8, 3)], 9, dtype=np.float64).init_(0)
    whole = nn.Sequential([nn.Dense(9, 8), nn.ReLU(), nn.Dense(8, 3)], 9, dtype=np.float64).init_(0)
    log, seen = _parts(model, piece=20)
    _parts(whole, piece=0)
    assert log == [("part", 2, 21), ("done", 2), ("done", 1), ("part", 0, 24), ("part", 0, 48), ("done", 0)]
    for i, done, g in seen:
        lo, hi = model.layer_ranges[i]
        np.testing.assert_array_equal(g[:done], model.grads[lo:lo + done])  # final already
        assert np.isnan(g[done:hi - lo - model.layers[i].n_out]).all()  # later rows: not yet
    np.testing.assert_allclose(model.grads, whole.grads, rtol=1e-13, atol=1e-15)


def test_parts_are_announced_only_when_asked_for_and_not_by_a_subclass():
    class Frozen(nn.Dense):
        def backward(self, dy, accumulate=False, need_input_grad=True):
            dx = super().backward(dy, accumulate, need_input_grad)
            self.grads["W"][...] = 0.0
            return dx

    model = nn.Sequential([nn.Dense(9, 8), nn.ReLU(), Frozen(8, 30)], 9, dtype=np.float64).init_(0)
    log, _ = _parts(model, piece=20)
    assert [e for e in log if e[0] == "part"] == [("part", 0, 24), ("part", 0, 48)]  # not Frozen
    log, _ = _parts(model, piece=0)  # none asked for
    assert log == [("done", 2), ("done", 1), ("done", 0)]
    log, _ = _parts(model, piece=10 ** 6)  # larger than every layer: whole layers
    assert log == [("done", 2), ("done", 1), ("done", 0)]


def test_parts_are_heard_without_a_layer_hook():
    model = nn.Sequential([nn.Dense(9, 8), nn.ReLU(), nn.Dense(8, 3)], 9, dtype=np.float64).init_(0)
    rng = np.random.default_rng(3)
    loss = nn.SoftmaxCrossEntropy()
    loss.forward(model.forward(rng.standard_normal((7, 9))), rng.integers(0, 3, 7))
    log = []
    model.backward(loss.backward(), input_grad=False, on_layer_part=lambda i, d: log.append((i, d)),
                   piece=20)
    assert log == [(2, 21), (0, 24), (0, 48)]
    assert model.context.grads_piece == 0  # reset after backward
