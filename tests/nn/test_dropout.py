"""Dropout: a sample's mask depends on (seed, step, layer key, global index, position) only,
so splitting or reordering a batch over "ranks" does not change it."""

from __future__ import annotations

import numpy as np
import pytest

from mpidp import nn
from mpidp.nn import Context, Dropout


def layer_at(rate=0.5, key=(3,), **ctx) -> Dropout:
    layer = Dropout(rate)
    layer.set_context(Context(**{"training": True, "seed": 7, "step": 11, **ctx}), key)
    return layer


def mask(layer: Dropout, index, shape=(4, 5)) -> np.ndarray:
    """The scaled mask the layer applies to the samples ``index``."""
    layer.context.index = np.asarray(index, np.int64)
    return layer.forward(np.ones((len(index), *shape)))


def test_mask_does_not_depend_on_the_split_or_the_order():
    n, rng = 37, np.random.default_rng(0)
    index = rng.permutation(1000)[:n]  # global indices, not 0..n-1
    whole = mask(layer_at(), index)
    for ranks in (1, 2, 3, 4):
        cuts = np.sort(rng.choice(np.arange(n + 1), ranks - 1)).tolist()  # uneven, maybe empty
        parts = np.split(np.arange(n), cuts)
        got = np.concatenate([mask(layer_at(), index[p]) for p in parts])
        assert got.shape == whole.shape and np.array_equal(got, whole), ranks
    order = rng.permutation(n)
    assert np.array_equal(mask(layer_at(), index[order]), whole[order])


def test_mask_changes_with_step_layer_and_seed_and_between_samples():
    index = np.arange(50)
    base = mask(layer_at(), index)
    for other in (layer_at(step=12), layer_at(key=(4,)), layer_at(key=(3, 0)), layer_at(seed=8)):
        m = mask(other, index)
        assert not np.array_equal(m, base)
        assert 0.3 < np.mean((m > 0) == (base > 0)) < 0.7  # unrelated, not shifted copies
    rows = (base > 0).reshape(50, -1)
    assert len({r.tobytes() for r in rows}) == 50
    assert np.array_equal(mask(layer_at(), index), base)  # deterministic


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.9])
def test_keep_fraction_and_scale(rate):
    m = mask(layer_at(rate), np.arange(4000), (250,))  # 1e6 elements: sd of the fraction < 5e-4
    kept = m > 0
    assert abs(kept.mean() - (1 - rate)) < 3e-3
    np.testing.assert_allclose(m[kept], 1 / (1 - rate), rtol=1e-15)
    per_position = kept.mean(axis=0)  # no position is favoured
    assert np.all(np.abs(per_position - (1 - rate)) < 0.04)
    both = (1 - rate) ** 2 + rate ** 2  # P(two independent elements agree)
    assert abs(np.mean(kept[1:] == kept[:-1]) - both) < 3e-3  # neighbouring samples
    assert abs(np.mean(kept[:, 1:] == kept[:, :-1]) - both) < 3e-3  # neighbouring positions


def test_backward_is_dy_times_the_mask_and_matches_finite_differences():
    rng = np.random.default_rng(1)
    layer = layer_at(0.3)
    layer.context.index = np.arange(100, 106)
    x = rng.standard_normal((6, 2, 3))
    y = layer.forward(x)
    m = mask(layer_at(0.3), np.arange(100, 106), (2, 3))
    np.testing.assert_allclose(y, x * m, rtol=1e-15)
    layer.forward(x)
    dy = rng.standard_normal(y.shape)
    np.testing.assert_allclose(layer.backward(dy), dy * m, rtol=1e-15)
    assert layer.backward(dy, need_input_grad=False) is None
    e = 1e-6
    num = (layer.forward(x + e) - layer.forward(x - e)) / (2 * e)  # elementwise: diagonal
    np.testing.assert_allclose(num, m, rtol=1e-8, atol=1e-10)


def test_eval_and_rate_zero_are_the_identity_without_an_index():
    x = np.random.default_rng(2).standard_normal((5, 3))
    layer = layer_at(0.5, training=False)
    assert layer.forward(x) is x and layer.backward(x) is x
    layer = layer_at(0.0)
    assert layer.forward(x) is x and layer.needs == frozenset()
    assert Dropout(0.2).needs == {"sample-index"}


def test_missing_or_wrong_index_raises_clearly():
    layer = layer_at()
    with pytest.raises(ValueError, match="Dropout needs the global index"):
        layer.forward(np.ones((3, 2)))
    layer.context.index = np.arange(4)
    with pytest.raises(ValueError, match="Dropout: the batch has 3 samples"):
        layer.forward(np.ones((3, 2)))
    for bad in (-0.1, 1.0, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="Dropout rate"):
            Dropout(bad)


def test_dropout_in_a_model_float32_and_spec():
    model = nn.Sequential([nn.Dense(4, 8), Dropout(0.25), nn.Dense(8, 2)], 4).init_(0)
    assert model.needs == {"sample-index"} and model.spec()[1] == {"type": "Dropout", "rate": 0.25}
    x = np.random.default_rng(3).standard_normal((16, 4)).astype(np.float32)
    model.context.training, model.context.index = True, np.arange(16)
    y = model(x)
    assert y.dtype == np.float32 and model.backward(np.ones_like(y)).dtype == np.float32
    assert model.layers[1].key == (1,)
    np.testing.assert_array_equal(model.predict(x), model.predict(x))
    assert not np.allclose(y, model.predict(x))


def test_empty_batch():
    layer = layer_at()
    layer.context.index = np.zeros(0, np.int64)
    assert layer.forward(np.ones((0, 3))).shape == (0, 3)
