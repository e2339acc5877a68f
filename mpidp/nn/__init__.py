"""Pure-NumPy neural networks with flat parameter buffers. Imports nothing from mpi4py."""

from .activations import GELU, LeakyReLU, ReLU, Sigmoid, Softmax, Tanh
from .blocks import Residual
from .context import Context
from .contract import check_layer
from .conv import Conv1d, Conv2d
from .dropout import Dropout
from .embedding import Embedding
from .export import export_onnx, export_safetensors, register_exporter
from .layers import Dense, Layer, register_layer, registered_layers
from .losses import OUTPUTS, Loss, MeanSquaredError, SoftmaxCrossEntropy, outputs
from .model import Sequential, from_spec, load, save
from .norm import BatchNorm, LayerNorm
from .optim import Optimizer, Segments
from .optimizers import LAMB, LARS, OPTIMIZERS, SGD, Adam, AdamW, make_optimizer
from .pool import AvgPool, GlobalAvgPool, MaxPool
from .presets import PRESETS, build, default_epochs, linear, logreg, mlp, model_layers
from .reshape import Flatten, Reshape
from .schedules import SCHEDULES, Schedule, make_schedule, scaled_lr, schedule_from_config
from .sparse import CSR, SparseDense
from .standardize import Standardize

__all__ = [
    "Adam", "AdamW", "AvgPool", "BatchNorm", "build", "Context", "Conv1d", "Conv2d", "CSR",
    "default_epochs", "Dense", "Dropout", "Embedding", "Flatten", "from_spec", "GELU",
    "GlobalAvgPool", "Layer", "LayerNorm", "LeakyReLU", "linear", "load", "logreg", "Loss",
    "make_optimizer", "MaxPool", "MeanSquaredError", "mlp", "model_layers", "Optimizer",
    "OUTPUTS", "outputs", "PRESETS", "register_layer", "registered_layers", "ReLU", "Reshape",
    "Residual", "save", "Sequential", "SGD", "Sigmoid", "Softmax", "SoftmaxCrossEntropy",
    "SparseDense", "Standardize", "Tanh",
    # writing a trained model for other runtimes
    "export_onnx", "export_safetensors", "register_exporter",
    # optimizers and learning-rate schedules
    "LAMB", "LARS", "make_schedule", "OPTIMIZERS", "scaled_lr", "Schedule",
    "schedule_from_config", "SCHEDULES", "Segments",
    # checking a layer of one's own against the layer contract
    "check_layer",
]
