"""A classifier's outputs as scores, probabilities or labels, against plain formulas."""

from __future__ import annotations

import numpy as np
import pytest

from mpidp.nn.losses import OUTPUTS, SoftmaxCrossEntropy, outputs


def test_each_output_kind_against_a_plain_formula():
    rng = np.random.default_rng(0)
    z = rng.normal(size=(7, 4)) * 30  # large logits: the softmax must not overflow
    assert outputs(z) is z and outputs(z, "scores") is z
    p = outputs(z, "proba")
    ref = np.exp(z - z.max(1, keepdims=True))
    ref /= ref.sum(1, keepdims=True)
    assert np.allclose(p, ref, rtol=1e-12, atol=0) and np.allclose(p.sum(1), 1)
    labels = outputs(z, "label")
    assert labels.dtype == np.int64 and list(labels) == [int(np.argmax(r)) for r in z]


def test_probabilities_are_what_the_loss_uses():
    z = np.array([[1.0, 2.0, -1.0], [0.0, 0.0, 0.0]])
    loss = SoftmaxCrossEntropy()
    loss.forward(z, np.array([1, 2]))
    g = loss.backward()  # softmax - onehot
    g[[0, 1], [1, 2]] += 1
    assert np.allclose(outputs(z, "proba"), g)


def test_no_rows_and_an_unknown_kind():
    empty = np.zeros((0, 3))
    assert outputs(empty, "proba").shape == (0, 3) and outputs(empty, "label").shape == (0,)
    with pytest.raises(ValueError, match="unknown output 'probs'"):
        outputs(empty, "probs")
    assert OUTPUTS == ("scores", "proba", "label")
