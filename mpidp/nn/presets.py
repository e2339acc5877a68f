"""Ready-made models (linear regression, softmax (logistic) regression, MLPs, a small CNN)
and models by name or model file (:func:`model_layers`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ..errors import setting
from . import layers as L
from .activations import ReLU, Sigmoid, Tanh
from .conv import Conv1d, Conv2d
from .losses import Loss, MeanSquaredError, SoftmaxCrossEntropy
from .model import Sequential, as_shape, chain_shapes
from .modelfile import is_model_file, layers_from, read_model_file
from .pool import MaxPool
from .reshape import Flatten
from .sparse import SparseDense, input_problem

_ACTIVATIONS = {"relu": ReLU, "tanh": Tanh, "sigmoid": Sigmoid}


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


def mlp_layers(n_in: int, hidden: Sequence[int], n_out: int, activation: str = "relu") -> list[L.Layer]:
    """The layers of :func:`mlp`, not yet bound to parameters (nothing is allocated)."""
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {sorted(_ACTIVATIONS)}")
    act = (lambda: ReLU(inplace=True)) if activation == "relu" else _ACTIVATIONS[activation]
    init = "he" if activation == "relu" else "xavier"
    dims = [n_in, *hidden]
    pairs = [[L.Dense(a, b, init=init), act()] for a, b in zip(dims[:-1], dims[1:])]
    return [*sum(pairs, []), L.Dense(dims[-1], n_out, init="xavier")]


PRESETS = ("linear", "logreg", "mlp", "cnn")


def default_epochs(model: str) -> int:
    """The epochs the preset ``model`` trains for by default: 20 for ``cnn``, else 10."""
    return 20 if model == "cnn" else 10


def cnn_layers(in_shape: Sequence[int], n_out: int) -> list[L.Layer]:
    """The layers of the ``cnn`` preset (``docs/models.md``) for samples of ``in_shape``
    (signals or images), unbound."""
    shape = tuple(in_shape)
    if len(shape) == 2:
        conv, widths, kernel, head = Conv1d, (32, 32, 32), 5, []
    elif len(shape) == 3:
        conv, widths, kernel = Conv2d, (16, 32), 3
        head = [L.Dense(None, 64, init="he"), ReLU(inplace=True)]
    else:
        raise ValueError(f"model 'cnn' needs samples shaped (channels, length) or (channels, height, width), "
                         f"got per-sample shape {shape}; for flat features use {setting('model', 'mlp')}")
    layers: list[L.Layer] = []
    side = min(shape[1:])
    for i, channels in enumerate(widths):
        layers += [conv(channels, kernel, padding=kernel // 2), ReLU(inplace=True)]
        if i < 2 and side >= 4:
            layers.append(MaxPool(2))
            side //= 2
    return [*layers, Flatten(), *head, L.Dense(None, n_out, init="xavier")]


def model_layers(name: str, in_shape: int | Sequence[int], n_out: int, hidden: Sequence[int] = (128, 64),
                 classification: bool = True, sparse: bool = False) -> tuple[list[L.Layer], Loss]:
    """The layers (unbound) and loss of the model ``name``: a preset of :data:`PRESETS`
    (other than ``cnn``, behind a ``Flatten`` for samples that are not flat) or a model file
    (``.toml``/``.json``, :mod:`mpidp.nn.modelfile`). The loss is softmax cross-entropy when
    ``classification`` (``linear``: always MSE) else mean squared error. ``sparse=True`` makes
    the first layer a :class:`SparseDense` (CSR input)."""
    shape = as_shape(in_shape)
    loss: Loss = SoftmaxCrossEntropy() if classification else MeanSquaredError()
    flat = [] if len(shape) == 1 else [Flatten()]
    n_in = int(np.prod(shape))
    if is_model_file(name):
        layers = layers_from(read_model_file(name), n_out, where=f"model file {name}")
        if problem := input_problem(layers, sparse):
            raise ValueError(f"model file {name}: {problem}")
        try:
            out = chain_shapes(layers, shape)[-1]
        except ValueError:  # shapes that do not chain: the caller names the layer
            return layers, loss
        if tuple(out) != (n_out,):
            raise ValueError(f"model file {name}: the model gives outputs of shape "
                             f"{tuple(out)} per sample, but the data needs {n_out} "
                             f"({'one per class' if classification else 'one per target'}); "
                             f"give its last layer n_out = {n_out}, or leave n_out out")
        return layers, loss
    if name == "cnn":
        return cnn_layers(shape, n_out), loss
    if name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(PRESETS)}, or "
                         f"a model file (.toml or .json)")
    if name == "logreg" and not classification:
        raise ValueError("model 'logreg' needs integer class labels; use 'linear' or 'mlp' for regression")
    if name == "linear":
        loss = MeanSquaredError()
    layers = mlp_layers(n_in, hidden, n_out) if name == "mlp" else [L.Dense(n_in, n_out, init="zeros")]
    if sparse:
        layers[0] = SparseDense(layers[0].n_in, layers[0].n_out)
    return flat + layers, loss


def build(name: str, n_in: int | Sequence[int], n_out: int, hidden: Sequence[int] = (128, 64),
          dtype: npt.DTypeLike = np.float32, classification: bool = True,
          sparse: bool = False) -> tuple[Sequential, Loss]:
    """Model (parameters zero: call ``init_``) and loss by name: see :func:`model_layers`.
    ``n_in``: the per-sample input shape (or number of features)."""
    layers, loss = model_layers(name, n_in, n_out, hidden, classification, sparse)
    return Sequential(layers, n_in, dtype), loss
