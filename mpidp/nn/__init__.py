"""Pure-NumPy neural networks with flat parameter buffers. Imports nothing from mpi4py."""

from .layers import Dense, Layer, ReLU, Sigmoid, Tanh
from .losses import Loss, MeanSquaredError, SoftmaxCrossEntropy
from .model import Sequential
from .optim import SGD, Adam, Optimizer, make_optimizer
from .presets import build, from_spec, linear, logreg, mlp
from .sparse import CSR, SparseDense

__all__ = [
    "Adam", "CSR", "Dense", "Layer", "Loss", "MeanSquaredError", "Optimizer", "ReLU", "SGD",
    "Sequential", "Sigmoid", "SoftmaxCrossEntropy", "SparseDense", "Tanh", "build", "from_spec", "linear",
    "logreg", "make_optimizer", "mlp",
]
