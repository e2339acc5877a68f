"""Optimizers against independent plain-NumPy reference formulas, step by step."""

from __future__ import annotations

import numpy as np
import pytest

from mpidp import nn
from mpidp.nn import SGD, Adam, make_optimizer
from mpidp.nn.optim import Optimizer

N_STEPS = 5


def _grads(n: int, steps: int = N_STEPS, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n) for _ in range(steps)]


def _reference_sgd(p0, grads, lr, momentum=0.0, weight_decay=0.0, nesterov=False):
    """Textbook SGD (PyTorch convention); velocity starts at zero. Returns every iterate."""
    p, v, out = p0.copy(), np.zeros_like(p0), []
    for g in grads:
        d = g + weight_decay * p
        if momentum:
            v = momentum * v + d
            step = d + momentum * v if nesterov else v
        else:
            step = d
        p = p - lr * step
        out.append(p.copy())
    return out


def _reference_adam(p0, grads, lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0):
    """Kingma & Ba (2015), Algorithm 1, with L2 weight decay added to the gradient."""
    p, m, v, out = p0.copy(), np.zeros_like(p0), np.zeros_like(p0), []
    for t, g in enumerate(grads, start=1):
        g = g + weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g ** 2
        m_hat = m / (1 - b1 ** t)
        v_hat = v / (1 - b2 ** t)
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
        out.append(p.copy())
    return out


def _run(opt: Optimizer, p0: np.ndarray, grads) -> list[np.ndarray]:
    params = p0.copy()
    buf = params  # the optimizer must update this very array in place
    out = []
    for t, g in enumerate(grads, start=1):
        opt.step_(params, g.copy())  # step_ may use its grad argument as scratch space
        assert params is buf
        assert opt.t == t
        out.append(params.copy())
    return out


SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.05, weight_decay=0.01),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.02, momentum=0.5, weight_decay=0.1),
    dict(lr=0.1, momentum=0.9, nesterov=True),
    dict(lr=0.03, momentum=0.7, nesterov=True, weight_decay=0.05),
]


@pytest.mark.parametrize("kw", SGD_CASES, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_sgd_matches_reference(kw):
    p0 = np.random.default_rng(1).standard_normal(7)
    grads = _grads(7)
    got = _run(SGD(**kw), p0, grads)
    want = _reference_sgd(p0, grads, **kw)
    for t, (a, b) in enumerate(zip(got, want), start=1):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=f"step {t}")
    assert not np.allclose(got[-1], p0)


def test_sgd_first_steps_by_hand():
    """Two steps of heavy-ball and Nesterov momentum on a scalar, computed by hand."""
    g1, g2 = np.array([1.0]), np.array([2.0])
    p = np.array([0.0])
    opt = SGD(lr=0.1, momentum=0.5)
    opt.step_(p, g1.copy())  # v = 1, p = -0.1
    np.testing.assert_allclose(p, [-0.1])
    opt.step_(p, g2.copy())  # v = 0.5 + 2 = 2.5, p = -0.1 - 0.25
    np.testing.assert_allclose(p, [-0.35])

    p = np.array([0.0])
    opt = SGD(lr=0.1, momentum=0.5, nesterov=True)
    opt.step_(p, g1.copy())  # v = 1, step = 1 + 0.5 = 1.5
    np.testing.assert_allclose(p, [-0.15])
    opt.step_(p, g2.copy())  # v = 2.5, step = 2 + 1.25 = 3.25
    np.testing.assert_allclose(p, [-0.475])


def test_state_does_not_alias_the_scratch_gradient():
    """step_ may overwrite its grad argument, but its state must not live in it."""
    opt = SGD(lr=0.1, momentum=0.9, weight_decay=0.1)
    p, g = np.array([3.0, 4.0]), np.array([1.0, -2.0])
    opt.step_(p, g)
    v = opt.state["velocity"].copy()
    g[...] = 1e6  # the caller reuses its gradient buffer for the next step
    np.testing.assert_array_equal(opt.state["velocity"], v)
    assert not np.shares_memory(opt.state["velocity"], g)


@pytest.mark.parametrize("kw", [
    dict(lr=1e-3),
    dict(lr=0.05, betas=(0.8, 0.99)),
    dict(lr=0.01, weight_decay=0.1),
    dict(lr=0.01, betas=(0.0, 0.5), eps=1e-4),
], ids=["default", "betas", "wd", "b1=0"])
def test_adam_matches_reference(kw):
    p0 = np.random.default_rng(2).standard_normal(9)
    grads = _grads(9, seed=3)
    got = _run(Adam(**kw), p0, grads)
    ref_kw = dict(kw)
    if "betas" in ref_kw:
        ref_kw["b1"], ref_kw["b2"] = ref_kw.pop("betas")
    want = _reference_adam(p0, grads, **ref_kw)
    for t, (a, b) in enumerate(zip(got, want), start=1):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=f"step {t}")


def test_adam_bias_correction_first_step_is_lr_times_sign():
    """With bias correction the first step is ``lr * g / (|g| + eps)``, about ``lr * sign(g)``."""
    p = np.zeros(4)
    g = np.array([1e-3, -5.0, 200.0, -0.02])
    Adam(lr=0.01).step_(p, g)
    np.testing.assert_allclose(p, -0.01 * np.sign(g), rtol=1e-4)


def test_adam_state_is_flat_and_float32_stays_float32():
    p = np.ones(6, np.float32)
    opt = Adam(lr=0.1)
    opt.step_(p, np.arange(6, dtype=np.float32))
    assert p.dtype == np.float32
    assert set(opt.state) == {"m", "v"}
    for a in opt.state.values():
        assert a.shape == (6,) and a.dtype == np.float32
    sgd = SGD(lr=0.1, momentum=0.9)
    q = np.ones(6, np.float32)
    sgd.step_(q, np.ones(6, np.float32))
    assert q.dtype == np.float32 and sgd.state["velocity"].dtype == np.float32
    assert sgd.state["velocity"].shape == (6,)


@pytest.mark.parametrize("make", [
    lambda: SGD(lr=0),
    lambda: SGD(lr=-0.1),
    lambda: SGD(lr=float("nan")),
    lambda: SGD(lr=0.1, momentum=1.0),
    lambda: SGD(lr=0.1, momentum=-0.1),
    lambda: SGD(lr=0.1, momentum=1.5),
    lambda: SGD(lr=0.1, weight_decay=-1e-4),
    lambda: SGD(lr=0.1, nesterov=True),
    lambda: SGD(lr=0.1, momentum=0.0, nesterov=True),
    lambda: Adam(lr=0),
    lambda: Adam(lr=-1e-3),
    lambda: Adam(lr=1e-3, betas=(1.0, 0.999)),
    lambda: Adam(lr=1e-3, betas=(0.9, 1.0)),
    lambda: Adam(lr=1e-3, betas=(-0.1, 0.999)),
    lambda: Adam(lr=1e-3, betas=(0.9, -0.5)),
    lambda: Adam(lr=1e-3, weight_decay=-0.1),
])
def test_invalid_hyper_parameters(make):
    with pytest.raises(ValueError):
        make()


def test_valid_edge_hyper_parameters_accepted():
    SGD(lr=1e-12, momentum=0.0, weight_decay=0.0)
    SGD(lr=0.1, momentum=0.999, nesterov=True)
    Adam(lr=1e-3, betas=(0.0, 0.0))


def test_make_optimizer():
    opt = make_optimizer("sgd", 0.1)
    assert type(opt) is SGD and opt.lr == 0.1 and opt.momentum == 0.0
    opt = make_optimizer("momentum", 0.2)
    assert type(opt) is SGD and opt.lr == 0.2 and opt.momentum == 0.9 and not opt.nesterov
    opt = make_optimizer("momentum", 0.2, momentum=0.5, weight_decay=0.01)
    assert opt.momentum == 0.5 and opt.weight_decay == 0.01
    opt = make_optimizer("adam", 1e-3, weight_decay=0.1)
    assert type(opt) is Adam and opt.lr == 1e-3 and opt.weight_decay == 0.1
    assert (opt.b1, opt.b2) == (0.9, 0.999)
    with pytest.raises(ValueError, match="rmsprop"):
        make_optimizer("rmsprop", 0.1)
    with pytest.raises(ValueError):
        make_optimizer("sgd", 0.0)

    # the named optimizers really behave like their references
    p0, grads = np.ones(3), _grads(3, seed=5)
    for name, ref in [("sgd", _reference_sgd(p0, grads, 0.1)),
                      ("momentum", _reference_sgd(p0, grads, 0.1, momentum=0.9)),
                      ("adam", _reference_adam(p0, grads, 0.1))]:
        np.testing.assert_allclose(_run(make_optimizer(name, 0.1), p0, grads)[-1], ref[-1], rtol=1e-12)


@pytest.mark.parametrize("make", [lambda: SGD(0.1), lambda: SGD(0.1, momentum=0.9, weight_decay=0.01),
                                  lambda: SGD(0.1, momentum=0.9, nesterov=True),
                                  lambda: Adam(0.01, weight_decay=0.1)])
def test_scale_equals_prescaled_gradient(make):
    """step_(p, g, scale=s) == step_(p, s * g): how a trainer folds 1/count into the update."""
    p0 = np.random.default_rng(3).standard_normal(9)
    a, b, oa, ob = p0.copy(), p0.copy(), make(), make()
    for g in _grads(9):
        oa.step_(a, g * 7.0, scale=1 / 7.0)
        ob.step_(b, g.copy())
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14)
    assert not np.allclose(a, p0)


@pytest.mark.parametrize("make", [lambda: SGD(0.1), lambda: SGD(0.1, momentum=0.9, weight_decay=0.01),
                                  lambda: SGD(0.1, momentum=0.9, nesterov=True),
                                  lambda: Adam(0.01, weight_decay=0.1)])
@pytest.mark.parametrize("chunks", [2, 7, 50])
def test_chunked_step_is_bit_identical_and_reports_each_piece(make, chunks):
    """step_(chunks=k) gives exactly the whole-array update (float32; also with more chunks
    than elements), calling on_chunk once per piece, in order, when that piece is final."""
    p0 = np.random.default_rng(4).standard_normal(23).astype(np.float32)
    a, b, oa, ob = p0.copy(), p0.copy(), make(), make()
    for g in _grads(23):
        g = g.astype(np.float32)
        before, seen = a.copy(), []

        def on_chunk(lo, hi, seen=seen, before=before):
            seen.append((lo, hi))
            np.testing.assert_array_equal(a[:hi], b[:hi])  # done so far: final
            np.testing.assert_array_equal(a[hi:], before[hi:])  # the rest: not touched yet

        ob.step_(b, g.copy(), scale=0.5)
        oa.step_(a, g.copy(), scale=0.5, chunks=chunks, on_chunk=on_chunk)
        np.testing.assert_array_equal(a, b)
        assert seen[0][0] == 0 and seen[-1][1] == 23 and len(seen) == min(chunks, 23)
        assert all(x[1] == y[0] for x, y in zip(seen, seen[1:]))
        assert oa.t == ob.t
        assert oa.state.keys() == ob.state.keys()
        for k in ob.state:
            np.testing.assert_array_equal(oa.state[k], ob.state[k])


@pytest.mark.parametrize("make", [
    lambda: nn.Adam(0.1, eps=float("nan")), lambda: nn.AdamW(0.1, eps=-1e-8),
    lambda: nn.LAMB(0.1, eps=float("inf")), lambda: nn.Adam(0.1, eps=0.0),
    lambda: nn.SGD(0.1, weight_decay=float("inf")), lambda: nn.LARS(0.1, eta=float("inf")),
    lambda: nn.LARS(0.1, eta=float("nan")),
], ids=["adam-eps-nan", "adamw-eps-negative", "lamb-eps-inf", "adam-eps-0", "sgd-wd-inf",
        "lars-eta-inf", "lars-eta-nan"])
def test_settings_that_would_make_every_parameter_nan_are_refused(make):
    """Each of these turned every parameter into NaN at the first update, and the next
    step's error then blamed the gradient."""
    with pytest.raises(ValueError, match="must be a finite number"):
        make()
