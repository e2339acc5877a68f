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
    log, tap = [], conv_module._clipped_tap

    def logged_tap(*a):  # col2im, the input gradient's work
        log.append("input-grad")
        return tap(*a)

    monkeypatch.setattr(conv_module, "_clipped_tap", logged_tap)
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
