"""``Sequential.forward(on_layer_params=...)`` reads a parameter only after it was asked for:
a ``Dense`` larger than the piece in leading row blocks, every other layer (a block, a
subclass) whole, before it runs. And an update applied piece by piece, in any order, is
the very update ``step_`` makes."""

from __future__ import annotations

import numpy as np
import pytest

from mpidp import nn


class _Slow(nn.Dense):
    """A Dense with a forward of its own: it cannot promise to read in parts."""

    def forward(self, x):
        return super().forward(x) * 1.0


def _model():
    layers = [nn.Dense(7, 9), nn.ReLU(),
              nn.Residual([nn.Dense(9, 9), nn.Tanh(), nn.Dense(9, 9)]),
              _Slow(9, 6), nn.Dense(6, 4)]
    return nn.Sequential(layers, 7, dtype=np.float64).init_(3)


def _arriving(model, final, log):
    """A hook that writes the asked-for values of ``final`` into the model (NaN before)."""
    def ready(i, upto):
        lo, hi = model.layer_ranges[i]
        log.append((i, upto))
        end = hi if upto is None else lo + upto
        assert lo <= end <= hi
        model.params[lo:end] = final[lo:end]
    return ready


@pytest.mark.parametrize("piece", [1, 9, 20, 1000])
def test_forward_reads_only_what_it_asked_for(piece):
    model = _model()
    x = np.random.default_rng(0).standard_normal((5, 7))
    final = model.params.copy()
    want = model.forward(x)
    model.params[...] = np.nan  # a value read before it was asked for poisons the output
    log = []
    got = model.forward(x, on_layer_params=_arriving(model, final, log), piece=piece)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
    assert np.array_equal(model.params, final)
    for i in range(len(model.layers)):  # every layer is made whole, the last call says so
        calls = [u for j, u in log if j == i]
        assert calls[-1] is None
        parts = calls[:-1]
        assert parts == sorted(parts)
    first = [u for j, u in log if j == 0]
    rows = -(-piece // 9)  # the first layer's weights are 7 rows of 9
    assert first[:-1] == ([] if piece >= 63 else [min(r + rows, 7) * 9 for r in range(0, 7, rows)])
    assert [u for j, u in log if j in (2, 3)] == [None, None]  # a block, a subclass: whole


def test_without_a_hook_nothing_is_asked_and_the_numbers_are_the_products():
    model = _model()
    x = np.random.default_rng(2).standard_normal((4, 7))
    plain = model.forward(x)
    parts = model.forward(x, on_layer_params=lambda i, upto: None, piece=9)
    np.testing.assert_allclose(parts, plain, rtol=1e-13, atol=1e-13)
    assert model.context.params_piece == 0  # reset after the pass
    layer = model.layers[0]
    assert not layer.reads_params_in_parts


OPTIMIZERS = [
    lambda: nn.SGD(0.1),
    lambda: nn.SGD(0.05, momentum=0.9, nesterov=True, weight_decay=1e-2, clip_value=0.3),
    lambda: nn.Adam(0.01, weight_decay=1e-3),
    lambda: nn.AdamW(nn.schedules.Warmup(nn.schedules.Cosine(0.02, 6), 2), weight_decay=0.1),
]


@pytest.mark.parametrize("make", OPTIMIZERS)
def test_an_update_in_pieces_in_any_order_is_step(make):
    rng = np.random.default_rng(4)
    p0 = rng.standard_normal(50)
    a, b = make(), make()
    pa, pb = p0.copy(), p0.copy()
    for step in range(4):
        g = rng.standard_normal(50)
        a.step_(pa, g.copy(), scale=0.5)
        apply = b.update_in_pieces_(pb, scale=0.5)
        edges = [0, 7, 8, 30, 50]
        order = rng.permutation(len(edges) - 1)
        gb = g.copy()
        for k in order:
            apply(gb, edges[k], edges[k + 1])
        assert np.array_equal(pa, pb), step
        assert a.t == b.t == step + 1
        for key in a.state:
            assert np.array_equal(a.state[key], b.state[key])


@pytest.mark.parametrize("make,why", [
    (lambda: nn.SGD(0.1, clip_norm=1.0), "clip_norm"),
    (lambda: nn.LARS(0.1), "LARS"),
    (lambda: nn.LAMB(0.01), "LAMB"),
])
def test_updates_that_need_whole_norms_refuse_pieces(make, why):
    opt = make()
    assert why in opt.refuses_pieces()
    t = opt.t
    with pytest.raises(ValueError, match=why):
        opt.update_in_pieces_(np.zeros(4))
    assert opt.t == t  # nothing counted
    tracked = nn.SGD(0.1)
    tracked.track_grad_norm = True
    assert "norm" in tracked.refuses_pieces()
    assert nn.Adam(0.1, clip_value=1.0).refuses_pieces() is None
