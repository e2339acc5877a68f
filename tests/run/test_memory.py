"""The memory estimate counts what the models really allocate."""

from __future__ import annotations

import numpy as np
import pytest

from mpidp import nn
from mpidp.run import memory


@pytest.mark.parametrize("model, hidden", [("mlp", (16, 8)), ("mlp", (5,)), ("logreg", (16, 8)),
                                           ("linear", ())])
def test_parameter_count_equals_the_built_model(model, hidden):
    built, _ = nn.build(model, 7, 3, hidden, np.float32, model != "linear")
    layers, _ = nn.model_layers(model, 7, 3, hidden, model != "linear")
    assert memory.model_size(layers, (7,))[0] == built.n_params


def test_estimate_is_copies_of_the_parameters_plus_activations():
    widths = [10, 20, 4]
    p = 10 * 20 + 20 + 20 * 4 + 4
    adam = memory.estimate_counts(p, sum(widths), np.float64, "adam", 32)
    assert adam == (memory.BASE_COPIES + 2) * p * 8 + 3 * 32 * sum(widths) * 8
    half = memory.estimate_counts(p, sum(widths), np.float32, "sgd", 0, share=0.5)
    assert half == int(p * 0.5 * memory.BASE_COPIES * 4)
