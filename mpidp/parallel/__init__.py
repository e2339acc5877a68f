"""Trainers and how they combine work: data parallelism with its gradient-exchange
strategies, parameter servers, pipelines and hybrids, map/reduce.

Names are imported on first use: importing a pure module of this package (the strategy
names in :mod:`~mpidp.parallel.strategies`, the schedules in :mod:`~.stages`) starts no MPI.
"""

from .._lazy import exports

_NAMES = {
    "DataParallel": ".data_parallel", "INIT_SYNC": ".data_parallel",
    "Pipeline": ".pipeline", "PARALLEL": ".trainers", "make_trainer": ".trainers",
    "model_layers": ".trainers", "ON_NONFINITE": "..run.nonfinite",
    "NonFiniteError": "..run.nonfinite", "StepStats": "..run.stats",
}
__getattr__, __dir__ = exports(__name__, _NAMES)
__all__ = sorted(_NAMES)
