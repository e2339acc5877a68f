"""Ready-made models: linear regression, softmax (logistic) regression and MLPs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from . import layers as L
from .losses import Loss, MeanSquaredError, SoftmaxCrossEntropy
from .model import Sequential
from .sparse import SparseDense

_ACTIVATIONS = {"relu": L.ReLU, "tanh": L.Tanh, "sigmoid": L.Sigmoid}


def linear(n_in: int, n_out: int = 1, dtype: npt.DTypeLike = np.float32) -> Sequential:
    """Linear regression ``y = x @ W + b`` (train with :class:`MeanSquaredError`)."""
    return Sequential([L.Dense(n_in, n_out, init="zeros")], n_in, dtype)


def logreg(n_in: int, n_classes: int, dtype: npt.DTypeLike = np.float32) -> Sequential:
    """Softmax (multinomial logistic) regression (train with :class:`SoftmaxCrossEntropy`)."""
    return Sequential([L.Dense(n_in, n_classes, init="zeros")], n_in, dtype)


def mlp(n_in: int, hidden: Sequence[int], n_out: int, activation: str = "relu",
        dtype: npt.DTypeLike = np.float32) -> Sequential:
    """Multi-layer perceptron ``n_in -> hidden[0] -> ... -> n_out`` with ``activation``."""
    return Sequential(mlp_layers(n_in, hidden, n_out, activation), n_in, dtype)


def mlp_layers(n_in: int, hidden: Sequence[int], n_out: int,
               activation: str = "relu") -> list[L.Layer]:
    """The layers of :func:`mlp`, not yet bound to parameters (nothing is allocated)."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {sorted(_ACTIVATIONS)}")
    act = (lambda: L.ReLU(inplace=True)) if activation == "relu" else _ACTIVATIONS[activation]
    init = "he" if activation == "relu" else "xavier"
    layers: list[L.Layer] = []
    dims = [n_in, *hidden]
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [L.Dense(a, b, init=init), act()]
    layers.append(L.Dense(dims[-1], n_out, init="xavier"))
    return layers


def build(name: str, n_in: int, n_out: int, hidden: Sequence[int] = (128, 64),
          dtype: npt.DTypeLike = np.float32, classification: bool = True,
          sparse: bool = False) -> tuple[Sequential, Loss]:
    """Model and loss by CLI name: ``linear`` (MSE), ``logreg`` or ``mlp``.

    ``mlp`` uses softmax cross-entropy when ``classification`` else mean squared error.
    ``sparse=True`` makes the first layer a :class:`SparseDense` (CSR input).
    """
    if sparse:
        model, loss = build(name, n_in, n_out, hidden, dtype, classification)
        first = model.layers[0]
        layers = [SparseDense(first.n_in, first.n_out), *model.layers[1:]]
        return Sequential(layers, n_in, dtype), loss
    if name == "linear":
        return linear(n_in, n_out, dtype), MeanSquaredError()
    if name == "logreg":
        if not classification:
            raise ValueError("model 'logreg' needs integer class labels; "
                             "use 'linear' or 'mlp' for regression")
        return logreg(n_in, n_out, dtype), SoftmaxCrossEntropy()
    if name == "mlp":
        loss = SoftmaxCrossEntropy() if classification else MeanSquaredError()
        return mlp(n_in, hidden, n_out, dtype=dtype), loss
    raise ValueError(f"unknown model {name!r}; expected 'linear', 'logreg' or 'mlp'")
