"""Pure-NumPy neural networks with flat parameter buffers. Imports nothing from mpi4py."""

from .layers import Dense, Layer, ReLU, Sigmoid, Tanh
from .losses import Loss, MeanSquaredError, SoftmaxCrossEntropy
from .model import Sequential
from .optim import SGD, Adam, Optimizer, make_optimizer
from .presets import build, from_spec, linear, logreg, mlp

__all__ = [
    "Adam", "Dense", "Layer", "Loss", "MeanSquaredError", "Optimizer", "ReLU", "SGD",
    "Sequential", "Sigmoid", "SoftmaxCrossEntropy", "Tanh", "build", "from_spec", "linear",
    "logreg", "make_optimizer", "mlp",
]
