"""Strategies that combine communication, data and models."""

from .data_parallel import INIT_SYNC, ON_NONFINITE, DataParallel, NonFiniteError, StepStats

__all__ = ["INIT_SYNC", "ON_NONFINITE", "DataParallel", "NonFiniteError", "StepStats"]
