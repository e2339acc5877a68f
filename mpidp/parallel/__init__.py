"""Strategies that combine communication, data and models."""

from .data_parallel import INIT_SYNC, DataParallel, StepStats

__all__ = ["INIT_SYNC", "DataParallel", "StepStats"]
