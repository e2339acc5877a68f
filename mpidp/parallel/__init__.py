"""Strategies that combine communication, data and models."""

from ..nonfinite import ON_NONFINITE, NonFiniteError
from ..stats import StepStats
from .data_parallel import INIT_SYNC, DataParallel

__all__ = ["INIT_SYNC", "ON_NONFINITE", "DataParallel", "NonFiniteError", "StepStats"]
from .hybrid import PARALLEL, make_trainer, model_layers  # noqa: E402
from .pipeline import Pipeline  # noqa: E402

__all__ += ["PARALLEL", "Pipeline", "make_trainer", "model_layers"]
