"""Pure-NumPy neural networks with flat parameter buffers. Imports nothing from mpi4py."""

from .layers import Dense, Layer, ReLU, Sigmoid, Tanh, register_layer, registered_layers
from .losses import OUTPUTS, Loss, MeanSquaredError, SoftmaxCrossEntropy, outputs
from .model import Sequential, from_spec, load, save
from .optim import SGD, Adam, Optimizer, make_optimizer
from .presets import build, linear, logreg, mlp
from .sparse import CSR, SparseDense

__all__ = [
    "OUTPUTS", "Adam", "CSR", "Dense", "Layer", "Loss", "MeanSquaredError", "Optimizer", "ReLU",
    "SGD", "Sequential", "Sigmoid", "SoftmaxCrossEntropy", "SparseDense", "Tanh", "build",
    "from_spec", "linear", "load", "logreg", "make_optimizer", "mlp", "outputs",
    "register_layer", "registered_layers", "save",
]
