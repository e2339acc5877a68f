"""Trainers and how they combine work: data parallelism with its gradient-exchange
strategies, parameter servers, pipelines and hybrids, map/reduce.

Names are imported on first use: importing a pure module of this package (the modes and
their settings in :mod:`~mpidp.parallel.modes`, the schedules in :mod:`~.stages`) starts no MPI.
"""

from .._lazy import exports

_NAMES = {
    "DataParallel": ".data_parallel", "INIT_SYNC": ".data_parallel",
    "Pipeline": ".pipeline", "PARALLEL": ".modes", "make_trainer": ".trainers",
    "MODES": ".modes", "make_sync": ".modes", "model_layers": "..nn.presets",
    "ON_NONFINITE": "..run.nonfinite",
    "NonFiniteError": "..run.nonfinite", "StepStats": "..run.stats",
}
__getattr__, __dir__ = exports(__name__, _NAMES)
__all__ = sorted(_NAMES)
