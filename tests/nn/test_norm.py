"""BatchNorm and LayerNorm: finite differences, running statistics, evaluation, and
BatchNorm over P simulated replicas (threads whose ``reduce_sum`` sums through a barrier)
against one layer on the whole batch.

float64 throughout; central differences with eps = 1e-6 on O(1) functions are accurate to
~1e-9, so rtol 1e-6 / atol 1e-8 separates noise from a wrong formula by orders of magnitude.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from helpers import numgrad

from mpidp import nn
from mpidp.nn import BatchNorm, Context, LayerNorm

RTOL, ATOL = 1e-6, 1e-8



def bound(layer, in_shape, rng, context=None):
    """``layer`` set up for ``in_shape``, bound to random float64 parameters and state."""
    layer.output_shape(in_shape)
    layer.bind({k: rng.standard_normal(s) + (1.5 if k == "gamma" else 0)
                for k, s in layer.param_shapes().items()},
               {k: np.full(s, np.nan) for k, s in layer.param_shapes().items()})
    layer.bind_state({k: rng.random(s) + 0.5 for k, s in layer.state_shapes().items()})
    if context is not None:
        layer.set_context(context, (0,))
    return layer


def check_gradients(layer, x, rng):
    """dx and every parameter's gradient against central differences; accumulate adds;
    need_input_grad=False returns None and writes the same gradients."""
    w = rng.standard_normal(layer.forward(x).shape)
    dx = layer.backward(w)
    f = lambda: float(np.sum(w * layer.forward(x)))
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


# ---------------------------------------------------------------------------- BatchNorm


@pytest.mark.parametrize("shape", [(6, 3), (5, 2, 4), (3, 2, 3, 3)])
@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_gradients(shape, training):
    rng = np.random.default_rng(1)
    layer = bound(BatchNorm(), shape[1:], rng, Context(training=training))
    check_gradients(layer, 2 * rng.standard_normal(shape) + 1, rng)


@pytest.mark.parametrize("shape", [(7, 3), (4, 2, 3, 2)])
def test_batchnorm_training_output_and_running_stats(shape):
    rng = np.random.default_rng(2)
    layer = bound(BatchNorm(momentum=0.2, eps=1e-3), shape[1:], rng, Context(training=True))
    axes = (0, *range(2, len(shape)))
    bs = (shape[1],) + (1,) * (len(shape) - 2)
    mean, var = layer.state["mean"].copy(), layer.state["var"].copy()
    for step in range(3):
        x = 3 * rng.standard_normal(shape) - 2
        y = layer.forward(x)
        mu, v = x.mean(axis=axes), x.var(axis=axes)
        want = layer.params["gamma"].reshape(bs) * (x - mu.reshape(bs)) \
            / np.sqrt(v.reshape(bs) + 1e-3) + layer.params["beta"].reshape(bs)
        np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)
        mean = 0.8 * mean + 0.2 * mu
        var = 0.8 * var + 0.2 * x.var(axis=axes, ddof=1)
        np.testing.assert_allclose(layer.state["mean"], mean, rtol=1e-12, err_msg=f"step {step}")
        np.testing.assert_allclose(layer.state["var"], var, rtol=1e-12, err_msg=f"step {step}")


def _no_collective(a):
    raise AssertionError("evaluation must not call reduce_sum")


def test_batchnorm_eval_uses_running_stats_without_a_collective():
    rng = np.random.default_rng(3)
    layer = bound(BatchNorm(eps=1e-4), (2, 3), rng, Context(training=False, reduce_sum=_no_collective))
    x = rng.standard_normal((4, 2, 3))
    before = {k: v.copy() for k, v in layer.state.items()}
    y = layer.forward(x)
    m, v = layer.state["mean"][:, None], layer.state["var"][:, None]
    want = layer.params["gamma"][:, None] * (x - m) / np.sqrt(v + 1e-4) + layer.params["beta"][:, None]
    np.testing.assert_allclose(y, want, rtol=1e-13, atol=1e-13)
    layer.backward(np.ones_like(y))
    for k in before:
        assert np.array_equal(layer.state[k], before[k])


def test_batchnorm_one_sample_updates_the_mean_only():
    rng = np.random.default_rng(4)
    layer = bound(BatchNorm(momentum=0.5), (3,), rng, Context(training=True))
    var = layer.state["var"].copy()
    x = rng.standard_normal((1, 3))
    mean = 0.5 * layer.state["mean"] + 0.5 * x[0]
    y = layer.forward(x)
    np.testing.assert_allclose(y, np.broadcast_to(layer.params["beta"], (1, 3)), atol=1e-12)
    np.testing.assert_allclose(layer.state["mean"], mean, rtol=1e-14)
    assert np.array_equal(layer.state["var"], var)


def test_batchnorm_in_a_model_float32_and_init():
    model = nn.Sequential([nn.Dense(4, 3), BatchNorm(), nn.ReLU(), nn.Dense(3, 2)], 4).init_(0)
    assert model.n_state == 6 and model.needs == {"replica-sums"}
    bn = model.layers[1]
    assert np.array_equal(bn.params["gamma"], np.ones(3)) and np.array_equal(bn.state["var"], np.ones(3))
    assert np.shares_memory(bn.state["mean"], model.state)
    model.context.training = True
    y = model(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32))
    assert y.dtype == np.float32 and model.state.dtype == np.float32
    assert model.backward(np.ones_like(y)).dtype == np.float32
    assert not np.array_equal(model.state[:3], np.zeros(3))
    assert model.spec()[1] == {"type": "BatchNorm", "momentum": 0.1, "eps": 1e-5}


def test_batchnorm_refuses_bad_settings_and_shapes():
    for bad in ({"momentum": -0.1}, {"momentum": 2}, {"eps": 0}, {"eps": float("nan")}):
        with pytest.raises(ValueError, match="BatchNorm"):
            BatchNorm(**bad)
    layer = BatchNorm()
    with pytest.raises(ValueError, match="channels"):
        layer.param_shapes()
    bound(layer, (3, 4), np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"\(n, 3, \.\.\.\)"):
        layer.forward(np.zeros((2, 4, 4)))


# ---------------------------------------------------------------------------- replicas


class Group:
    """``reduce_sum`` for P threads: each posts its array, all wait, each takes the sum in
    rank order (the same on every thread), all wait again before the next call."""

    def __init__(self, size: int) -> None:
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=20)
        self.calls = [0] * size

    def reducer(self, rank: int):
        def reduce_sum(a: np.ndarray) -> np.ndarray:
            assert a.dtype == np.float64
            self.calls[rank] += 1
            self.slots[rank] = a.copy()
            self.barrier.wait()
            total = self.slots[0].copy()
            for s in self.slots[1:]:
                total += s
            self.barrier.wait()
            a[...] = total
            return a
        return reduce_sum


def run_replicas(parts, dys, params, state, steps=2):
    """One BatchNorm per part, in a thread each; returns per rank (ys, dxs, grads, state)."""
    group = Group(len(parts))
    out, errors = [None] * len(parts), []

    def work(r):
        try:
            ctx = Context(training=True, reduce_sum=group.reducer(r), group_size=len(parts))
            layer = BatchNorm(momentum=0.3)
            layer.output_shape(parts[r].shape[1:])
            layer.bind({k: v.copy() for k, v in params.items()},
                       {k: np.zeros_like(v) for k, v in params.items()})
            layer.bind_state({k: v.copy() for k, v in state.items()})
            layer.set_context(ctx, (0,))
            ys, dxs = [], []
            for _ in range(steps):
                ys.append(layer.forward(parts[r]))
                dxs.append(layer.backward(dys[r]))
            out[r] = ys, dxs, layer.grads, layer.state
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    assert len(set(group.calls)) == 1 and group.calls[0] == 3 * steps  # 2 forward + 1 backward
    return out


SPLITS = [[9], [4, 5], [9, 0], [0, 9], [1, 3, 5], [0, 4, 0, 5], [2, 2, 2, 3], [8, 1, 0, 0]]


@pytest.mark.parametrize("shape", [(9, 3), (9, 2, 2, 3)], ids=["flat", "images"])
@pytest.mark.parametrize("sizes", SPLITS, ids=["-".join(map(str, s)) for s in SPLITS])
def test_batchnorm_over_replicas_equals_one_layer_on_the_batch(shape, sizes):
    rng = np.random.default_rng(sum(sizes) * 7 + len(sizes))
    x, dy = 2 * rng.standard_normal(shape) + 1, rng.standard_normal(shape)
    c = shape[1]
    params = {"gamma": rng.standard_normal(c) + 1, "beta": rng.standard_normal(c)}
    state = {"mean": rng.standard_normal(c), "var": rng.random(c) + 0.5}
    cuts = np.cumsum([0, *sizes])
    parts = [x[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    dys = [dy[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    (ys1, dxs1, g1, s1), = run_replicas([x], [dy], params, state)
    got = run_replicas(parts, dys, params, state)
    for step in range(2):
        np.testing.assert_allclose(np.concatenate([o[0][step] for o in got]), ys1[step],
                                   rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(np.concatenate([o[1][step] for o in got]), dxs1[step],
                                   rtol=1e-10, atol=1e-10)
    for k in ("gamma", "beta"):  # what the trainer's allreduce of the local sums gives
        np.testing.assert_allclose(sum(o[2][k] for o in got), g1[k], rtol=1e-10, atol=1e-10)
    for o in got:
        for k in ("mean", "var"):
            np.testing.assert_allclose(o[3][k], s1[k], rtol=1e-10, atol=1e-10)
    assert not np.allclose(s1["mean"], state["mean"])


def test_batchnorm_global_batch_of_no_samples_changes_nothing():
    rng = np.random.default_rng(5)
    params = {"gamma": np.ones(2), "beta": np.zeros(2)}
    state = {"mean": rng.standard_normal(2), "var": rng.random(2) + 1}
    empty = [np.zeros((0, 2, 3)), np.zeros((0, 2, 3))]
    got = run_replicas(empty, empty, params, state)
    for ys, dxs, grads, st in got:
        assert ys[0].shape == (0, 2, 3) and dxs[0].shape == (0, 2, 3)
        assert np.array_equal(grads["gamma"], np.zeros(2))
        for k in state:
            assert np.array_equal(st[k], state[k])


# ---------------------------------------------------------------------------- LayerNorm


@pytest.mark.parametrize("shape", [(5, 4), (3, 2, 4), (2, 2, 3, 2), (0, 3)])
def test_layernorm_gradients_and_output(shape):
    rng = np.random.default_rng(6)
    layer = bound(LayerNorm(eps=1e-3), shape[1:], rng, Context(training=True, reduce_sum=_no_collective))
    assert layer.param_shapes() == {"gamma": shape[1:], "beta": shape[1:]}
    x = 2 * rng.standard_normal(shape) + 1
    axes = tuple(range(1, len(shape)))
    mu, v = x.mean(axis=axes, keepdims=True), x.var(axis=axes, keepdims=True)
    want = layer.params["gamma"] * (x - mu) / np.sqrt(v + 1e-3) + layer.params["beta"]
    np.testing.assert_allclose(layer.forward(x), want, rtol=1e-12, atol=1e-12)
    check_gradients(layer, x, rng)


def test_layernorm_in_a_model_and_round_trip(tmp_path):
    model = nn.Sequential([nn.Dense(3, 4), LayerNorm(), nn.Dense(4, 2)], 3, np.float64).init_(1)
    model.params[:] = np.random.default_rng(0).standard_normal(model.n_params)
    again = nn.load(nn.save(model, tmp_path / "m.npz"))
    x = np.random.default_rng(1).standard_normal((5, 3))
    assert again.spec() == model.spec() and np.array_equal(again(x), model(x))
    with pytest.raises(ValueError, match="eps"):
        LayerNorm(eps=-1)
