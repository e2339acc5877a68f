"""AdamW, LARS, LAMB and gradient clipping against plain NumPy references of their published
rules (float64, several steps, per tensor), and the slice protocol: P slices of the vector
(threads whose ``reduce_sum`` sums through a barrier) and ``chunks > 1`` give the
whole-vector update.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from mpidp import nn
from mpidp.nn import LAMB, LARS, SGD, Adam, AdamW, Segments, make_optimizer
from mpidp.nn.schedules import Cosine, Warmup

STEPS = 6
TOL = dict(rtol=1e-12, atol=1e-14)
SCHEDULE = Warmup(Cosine(0.05, 8, 0.005), 3)  # warmup, decay and floor within a few steps


def _model() -> nn.Sequential:
    """W (5, 4), b (4,), LayerNorm gamma, beta (4,), W (4, 3), b (3,): 47 parameters."""
    return nn.Sequential([nn.Dense(5, 4), nn.LayerNorm(), nn.Tanh(), nn.Dense(4, 3)], 5,
                         np.float64)


SEGS = Segments.of(_model())
N = SEGS.n
SHAPES = [s for layer in _model().layers for s in layer.param_shapes().values()]


def _problem(seed: int = 0, big: float = 1.0):
    rng = np.random.default_rng(seed)
    p0 = rng.standard_normal(N)
    grads = [big * rng.standard_normal(N) * rng.uniform(0.2, 3.0) for _ in range(STEPS)]
    return p0, grads


def _split(x: np.ndarray) -> list[np.ndarray]:
    return [x[a:b].reshape(s).copy() for a, b, s in zip(SEGS.bounds[:-1], SEGS.bounds[1:], SHAPES)]


def _join(xs: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([x.reshape(-1) for x in xs])


def _lr(lr, t: int) -> float:
    return lr(t) if callable(lr) else lr


def _clipped(gs, clip_norm=None, clip_value=None):
    """The reference's clipping of the mean gradient: values first, then the global norm."""
    if clip_value is not None:
        gs = [np.clip(g, -clip_value, clip_value) for g in gs]
    norm = np.sqrt(sum(float(np.sum(g * g)) for g in gs))
    if clip_norm is not None and norm > clip_norm:
        gs = [g * (clip_norm / norm) for g in gs]
    return gs, norm


# --- plain references, one tensor at a time -------------------------------------------

def ref_adamw(p0, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
    """Loshchilov & Hutter (2019), Algorithm 2 with the schedule multiplier folded into lr:
    p <- p - lr_t (m_hat / (sqrt(v_hat) + eps) + wd p)."""
    b1, b2 = betas
    p, m, v, out = p0.copy(), np.zeros(N), np.zeros(N), []
    for t, g in enumerate(grads, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
        p = p - _lr(lr, t - 1) * (mh / (np.sqrt(vh) + eps) + weight_decay * p)
        out.append(p.copy())
    return out


def ref_lars(p0, grads, lr, momentum=0.9, weight_decay=0.0, eta=0.001, exclude_1d=True,
             clip_norm=None, clip_value=None):
    """You, Gitman & Ginsburg (2017), Algorithm 1, per tensor:
    local_lr = eta ||w|| / (||g|| + wd ||w||); v = m v + lr local_lr (g + wd w); w -= v."""
    ws, vs, out, norms = _split(p0), [np.zeros(s) for s in SHAPES], [], []
    for t, g in enumerate(grads):
        gs, norm = _clipped(_split(g), clip_norm, clip_value)
        norms.append(norm)
        for i, (w, gi) in enumerate(zip(ws, gs)):
            if exclude_1d and w.ndim == 1:
                ratio, d = 1.0, gi
            else:
                wn, gn = np.linalg.norm(w), np.linalg.norm(gi)
                ratio = eta * wn / (gn + weight_decay * wn) if wn > 0 and gn > 0 else 1.0
                d = gi + weight_decay * w
            vs[i] = momentum * vs[i] + _lr(lr, t) * ratio * d
            ws[i] = w - vs[i]
        out.append(_join(ws))
    return out, norms


def ref_lamb(p0, grads, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, exclude_1d=True,
             clip_norm=None, clip_value=None):
    """You et al. (2019), Algorithm 2, per tensor: r = m_hat / (sqrt(v_hat) + eps);
    w -= lr ||w|| / ||r + wd w|| (r + wd w)."""
    b1, b2 = betas
    ws, ms, vs = _split(p0), [np.zeros(s) for s in SHAPES], [np.zeros(s) for s in SHAPES]
    out, norms = [], []
    for t, g in enumerate(grads, start=1):
        gs, norm = _clipped(_split(g), clip_norm, clip_value)
        norms.append(norm)
        for i, (w, gi) in enumerate(zip(ws, gs)):
            ms[i] = b1 * ms[i] + (1 - b1) * gi
            vs[i] = b2 * vs[i] + (1 - b2) * gi * gi
            r = (ms[i] / (1 - b1 ** t)) / (np.sqrt(vs[i] / (1 - b2 ** t)) + eps)
            if exclude_1d and w.ndim == 1:
                u, ratio = r, 1.0
            else:
                u = r + weight_decay * w
                wn, un = np.linalg.norm(w), np.linalg.norm(u)
                ratio = wn / un if wn > 0 and un > 0 else 1.0
            ws[i] = w - _lr(lr, t - 1) * ratio * u
        out.append(_join(ws))
    return out, norms


def ref_clipped_sgd(p0, grads, lr, momentum=0.0, weight_decay=0.0, clip_norm=None,
                    clip_value=None):
    """Clip the mean gradient (PyTorch's clip_grad_norm_/clip_grad_value_ on .grad), then
    heavy-ball SGD with L2 weight decay (not clipped)."""
    p, v, out, norms = p0.copy(), np.zeros(N), [], []
    for t, g in enumerate(grads):
        (g,), norm = _clipped([g], clip_norm, clip_value)
        norms.append(norm)
        d = g + weight_decay * p
        v = momentum * v + d
        p = p - _lr(lr, t) * (v if momentum else d)
        out.append(p.copy())
    return out, norms


def _run(opt, p0, grads, scale=1.0, chunks=1, place=True):
    if place:
        opt.place(SEGS)
    p, out, norms = p0.copy(), [], []
    for g in grads:
        opt.step_(p, g / scale, scale=scale, chunks=chunks)  # the trainer folds 1/count in
        out.append(p.copy())
        norms.append(opt.last_grad_norm)
    return out, norms


def _same(got, want):
    for t, (a, b) in enumerate(zip(got, want), start=1):
        np.testing.assert_allclose(a, b, **TOL, err_msg=f"step {t}")


# --- against the references -------------------------------------------------------------

@pytest.mark.parametrize("kw", [dict(lr=1e-2), dict(lr=SCHEDULE, weight_decay=0.1),
                                dict(lr=0.03, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.0)],
                         ids=["default-wd", "schedule", "no-wd"])
def test_adamw_matches_reference(kw):
    p0, grads = _problem(1)
    got, _ = _run(AdamW(**kw), p0, grads, scale=1 / 7)
    _same(got, ref_adamw(p0, grads, **kw))
    assert not np.allclose(got[-1], p0)


def test_adamw_decay_is_decoupled_not_l2():
    """The same settings as Adam's L2 decay give another model (so the test above can fail)."""
    p0, grads = _problem(1)
    a, _ = _run(AdamW(0.01, weight_decay=0.1), p0, grads)
    b, _ = _run(Adam(0.01, weight_decay=0.1), p0, grads)
    assert np.max(np.abs(a[-1] - b[-1])) > 1e-4


LARS_CASES = [dict(lr=2.0), dict(lr=SCHEDULE, weight_decay=5e-3, eta=0.02),
              dict(lr=1.0, momentum=0.0, weight_decay=1e-2, exclude_1d=False),
              dict(lr=SCHEDULE, eta=0.01, clip_norm=3.0), dict(lr=1.5, clip_value=0.5)]


@pytest.mark.parametrize("kw", LARS_CASES, ids=["plain", "wd-schedule", "no-momentum-all-layers",
                                                "clip-norm", "clip-value"])
def test_lars_matches_reference(kw):
    p0, grads = _problem(2)
    got, norms = _run(LARS(**kw), p0, grads, scale=1 / 5)
    want, want_norms = ref_lars(p0, grads, **kw)
    _same(got, want)
    np.testing.assert_allclose(norms, want_norms, rtol=1e-12)  # LARS always knows the norm


@pytest.mark.parametrize("wd, ratio", [(0.0, 1.0), (0.01, 0.02 / 0.01)])
def test_lars_trust_ratio_with_a_zero_gradient_is_what_its_docstring_says(wd, ratio):
    """1 only when the whole denominator is 0; with weight decay eta / weight_decay (optax)."""
    assert "a zero gradient with weight decay gives ``eta / weight_decay``" in LARS.__doc__
    p0 = np.random.default_rng(3).standard_normal(N)
    got, _ = _run(LARS(0.5, momentum=0.0, weight_decay=wd, eta=0.02, exclude_1d=False), p0,
                  [np.zeros(N)])
    want = p0 - 0.5 * ratio * wd * p0  # w -= lr * ratio * (0 + wd * w)
    np.testing.assert_allclose(got[0], want, **TOL)


LAMB_CASES = [dict(lr=1e-2), dict(lr=SCHEDULE, weight_decay=0.1),
              dict(lr=0.02, betas=(0.5, 0.9), eps=1e-8, weight_decay=0.05, exclude_1d=False),
              dict(lr=SCHEDULE, clip_norm=2.0), dict(lr=0.01, clip_value=0.3, clip_norm=1.0)]


@pytest.mark.parametrize("kw", LAMB_CASES, ids=["plain", "wd-schedule", "all-layers", "clip-norm",
                                                "clip-both"])
def test_lamb_matches_reference(kw):
    p0, grads = _problem(3)
    got, norms = _run(LAMB(**kw), p0, grads, scale=1 / 3)
    want, want_norms = ref_lamb(p0, grads, **kw)
    _same(got, want)
    if "clip_norm" in kw:
        np.testing.assert_allclose(norms, want_norms, rtol=1e-12)


def test_layerwise_trust_ratios_matter():
    """Per-tensor norms, not one norm of the whole vector: an unplaced optimizer (the vector
    as one tensor) trains another model, and LAMB is not Adam."""
    p0, grads = _problem(3)
    per_tensor, _ = _run(LAMB(0.01, exclude_1d=False), p0, grads)
    whole, _ = _run(LAMB(0.01, exclude_1d=False), p0, grads, place=False)
    adam, _ = _run(AdamW(0.01, eps=1e-6), p0, grads)
    assert np.max(np.abs(per_tensor[-1] - whole[-1])) > 1e-4
    assert np.max(np.abs(per_tensor[-1] - adam[-1])) > 1e-4
    one = Segments.whole(N)
    placed_whole, _ = _run(LAMB(0.01, exclude_1d=False).place(one), p0, grads, place=False)
    assert all(np.array_equal(a, b) for a, b in zip(whole, placed_whole))


@pytest.mark.parametrize("kw", [dict(clip_norm=2.0), dict(clip_norm=1e6), dict(clip_value=0.4),
                                dict(clip_value=0.4, clip_norm=1.5), dict(clip_norm=1.0, momentum=0.9,
                                                                          weight_decay=0.1)],
                         ids=["norm", "norm-not-reached", "value", "both", "momentum-wd"])
def test_clipping_matches_reference(kw):
    p0, grads = _problem(4, big=2.0)
    got, norms = _run(SGD(SCHEDULE, **kw), p0, grads, scale=1 / 9)
    want, want_norms = ref_clipped_sgd(p0, grads, SCHEDULE, **kw)
    _same(got, want)
    if "clip_norm" in kw:  # the pre-clip norm of the mean gradient (after value clipping)
        np.testing.assert_allclose(norms, want_norms, rtol=1e-12)
    else:
        assert norms == [None] * STEPS  # not computed: no reduction was needed


def test_clipping_really_clips_and_reports_the_norm_before():
    p = np.zeros(N)
    g = np.full(N, 2.0)
    opt = SGD(1.0, clip_norm=1.0).place(SEGS)
    opt.step_(p, g.copy() * 4, scale=0.25)
    np.testing.assert_allclose(np.linalg.norm(p), 1.0, rtol=1e-12)
    assert opt.last_grad_norm == pytest.approx(2.0 * np.sqrt(N))
    opt.track_grad_norm = True
    opt.clip_norm = None
    opt.step_(p, g.copy())
    assert opt.last_grad_norm == pytest.approx(2.0 * np.sqrt(N))
    q = np.zeros(N)
    Adam(0.1, clip_value=0.5).step_(q, g.copy())
    np.testing.assert_allclose(q, -0.1, rtol=1e-6)  # Adam's first step: lr * sign(clipped g)


def test_adam_clip_norm_matches_reference():
    from test_optim import _reference_adam
    p0, grads = _problem(5, big=3.0)
    got, norms = _run(Adam(0.02, weight_decay=0.1, clip_norm=1.0), p0, grads)
    clipped = [_clipped([g], 1.0)[0][0] for g in grads]
    _same(got, _reference_adam(p0, clipped, 0.02, weight_decay=0.1))


# --- slices: threads with a barrier reduce ----------------------------------------------

class Group:
    """``reduce_sum`` for P threads: each posts its array, all wait, each takes the sum in
    rank order (the same on every thread), all wait again before the next call."""

    def __init__(self, size: int) -> None:
        self.size, self.slots = size, [None] * size
        self.barrier = threading.Barrier(size, timeout=20)
        self.calls = [0] * size

    def reducer(self, rank: int):
        def reduce_sum(a: np.ndarray) -> np.ndarray:
            assert a.dtype == np.float64 and a.ndim == 1 and a.size <= 2 * len(SEGS)
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


def _sliced(make, p0, grads, cuts, reduce=True, chunks=1):
    """Each thread updates ``p[cuts[r]:cuts[r + 1]]`` with its own optimizer placed there.
    Returns the joined parameters after each step, every thread's norms, reduce calls."""
    P = len(cuts) - 1
    group, errors = Group(P), []
    out = [[None] * STEPS for _ in range(P)]
    norms = [[None] * STEPS for _ in range(P)]

    def work(r):
        try:
            lo, hi = cuts[r], cuts[r + 1]
            opt = make().place(SEGS, lo, group.reducer(r) if reduce else None)
            p = p0[lo:hi].copy()
            for t, g in enumerate(grads):
                opt.step_(p, g[lo:hi] * 4.0, scale=0.25, chunks=chunks)
                out[r][t], norms[r][t] = p.copy(), opt.last_grad_norm
        except Exception as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=work, args=(r,)) for r in range(P)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    joined = [np.concatenate([out[r][t] for r in range(P)]) for t in range(STEPS)]
    return joined, norms, group.calls


FACTORIES = {
    "lars": (lambda: LARS(SCHEDULE, weight_decay=1e-2, eta=0.02), 1),
    "lars-clip": (lambda: LARS(2.0, clip_norm=1.0, exclude_1d=False), 1),
    "lamb": (lambda: LAMB(SCHEDULE, weight_decay=0.05), 1),
    "lamb-clip": (lambda: LAMB(0.01, clip_norm=1.0), 2),  # the moments need the clipped g
    "sgd-clip": (lambda: SGD(SCHEDULE, momentum=0.9, clip_norm=1.0), 1),
    "adamw-clip-both": (lambda: AdamW(0.01, clip_norm=1.0, clip_value=0.3), 1),
}
#: cuts of the 47 parameters: inside tensors, an empty slice, one element
CUTS = [[0, 10, 47], [0, 22, 22, 36, 47], [0, 1, 2, 19, 26, 40, 47]]


@pytest.mark.parametrize("name", list(FACTORIES))
@pytest.mark.parametrize("cuts", CUTS, ids=lambda c: f"P{len(c) - 1}")
def test_slices_with_one_reduction_equal_the_whole_vector(name, cuts):
    make, reductions = FACTORIES[name]
    p0, grads = _problem(6, big=2.0)
    want, want_norms = _run(make(), p0, grads, scale=0.25)
    got, norms, calls = _sliced(make, p0, grads, cuts)
    _same(got, want)
    assert calls == [reductions * STEPS] * (len(cuts) - 1)  # ONE small reduction per update
    for r in range(len(cuts) - 1):
        if want_norms[0] is not None:
            np.testing.assert_allclose(norms[r], want_norms, rtol=1e-12)
            assert norms[r] == norms[0]  # bit-identical on every rank: the same sums


def test_slices_without_the_reduction_would_give_another_model():
    """The slice test can fail: norms of each slice's parts (no reduce_sum) are wrong."""
    make, _ = FACTORIES["lamb"]
    p0, grads = _problem(6, big=2.0)
    want, _ = _run(make(), p0, grads, scale=0.25)
    got, _, _ = _sliced(make, p0, grads, CUTS[1], reduce=False)
    assert np.max(np.abs(got[-1] - want[-1])) > 1e-6


# --- chunks -----------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(FACTORIES))
@pytest.mark.parametrize("chunks", [2, 5, 100])
def test_chunks_are_bit_identical_to_one_piece(name, chunks):
    """The norms are taken over the whole vector before the first piece is updated; each
    piece is final when on_chunk reports it and the rest is untouched."""
    make, _ = FACTORIES[name]
    p0, grads = _problem(7, big=2.0)
    a, b = p0.copy(), p0.copy()
    oa, ob = make().place(SEGS), make().place(SEGS)
    for g in grads:
        before, seen = a.copy(), []

        def on_chunk(lo, hi, seen=seen, before=before):
            seen.append((lo, hi))
            np.testing.assert_array_equal(a[:hi], b[:hi])
            np.testing.assert_array_equal(a[hi:], before[hi:])

        ob.step_(b, g.copy(), scale=0.5)
        oa.step_(a, g.copy(), scale=0.5, chunks=chunks, on_chunk=on_chunk)
        np.testing.assert_array_equal(a, b)
        assert len(seen) == min(chunks, N) and seen[-1][1] == N
        assert oa.last_grad_norm == ob.last_grad_norm
        for k in ob.state:
            np.testing.assert_array_equal(oa.state[k], ob.state[k])


def test_chunks_on_a_slice_equal_the_whole_vector():
    make, _ = FACTORIES["lamb-clip"]
    p0, grads = _problem(8, big=2.0)
    want, _ = _run(make(), p0, grads, scale=0.25)
    got, _, _ = _sliced(make, p0, grads, CUTS[2], chunks=3)
    _same(got, want)


# --- the rest -----------------------------------------------------------------------------

def test_segments_follow_the_model_layout():
    model = _model()
    assert SEGS.bounds.tolist() == [0, 20, 24, 28, 32, 44, 47] and SEGS.ndim.tolist() == [2, 1, 1,
                                                                                          1, 2, 1]
    edges = set(SEGS.bounds.tolist())
    assert all(lo in edges and hi in edges for lo, hi in model.layer_ranges)
    assert len(SEGS) == 6 and SEGS.n == model.n_params == N
    with pytest.raises(ValueError, match="rise from 0"):
        Segments([1, 5])
    with pytest.raises(ValueError, match="ndim"):
        Segments([0, 3, 5], [2])


def test_a_vector_that_does_not_fit_the_placement_is_refused():
    opt = LAMB(0.01).place(SEGS, offset=40)
    with pytest.raises(ValueError, match="place"):
        opt.step_(np.zeros(10), np.zeros(10))
    assert opt.t == 0  # refused before counting an update
    with pytest.raises(ValueError, match="offset"):
        LAMB(0.01).place(SEGS, offset=48)


def test_float32_stays_float32():
    for opt in (LARS(1.0), LAMB(0.01, clip_norm=1.0), AdamW(0.01)):
        p, g = np.ones(N, np.float32), np.linspace(-1, 1, N, dtype=np.float32)
        opt.place(SEGS).step_(p, g)
        assert p.dtype == np.float32 and all(v.dtype == np.float32 for v in opt.state.values())
        assert all(v.shape == (N,) for v in opt.state.values())  # flat: sliceable, checkpointable


def test_make_optimizer_knows_the_new_names():
    assert nn.OPTIMIZERS == ("sgd", "momentum", "adam", "adamw", "lars", "lamb")
    opt = make_optimizer("lars", SCHEDULE, momentum=0.8, weight_decay=1e-4, eta=0.01, clip_norm=5.0)
    assert type(opt) is LARS and (opt.momentum, opt.weight_decay, opt.eta) == (0.8, 1e-4, 0.01)
    assert opt.clip_norm == 5.0 and opt.schedule is SCHEDULE
    opt = make_optimizer("lamb", 1e-3, weight_decay=0.01, exclude_1d=False, clip_value=1.0)
    assert type(opt) is LAMB and not opt.exclude_1d and opt.clip_value == 1.0
    assert type(make_optimizer("adamw", 1e-3, weight_decay=0.05)) is AdamW
    with pytest.raises(ValueError, match="'lamb'"):
        make_optimizer("lion", 0.1)


@pytest.mark.parametrize("make", [
    lambda: LARS(0.1, momentum=1.0), lambda: LARS(0.1, eta=0), lambda: LARS(0.1, weight_decay=-1),
    lambda: LAMB(0.1, betas=(1.0, 0.9)), lambda: AdamW(0.0), lambda: SGD(0.1, clip_norm=0),
    lambda: SGD(0.1, clip_value=-1.0), lambda: Adam(0.1, clip_norm=float("inf")),
])
def test_invalid_settings(make):
    with pytest.raises(ValueError):
        make()
