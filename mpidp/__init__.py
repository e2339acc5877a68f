"""mpidp: data-parallel training of pure-NumPy models over MPI.

Public API::

    from mpidp import DataParallel, fit, load, nn
    from mpidp import Partition, map_reduce  # partition strategies, map/reduce
    mpidp.sklearn.MLPClassifier, mpidp.sklearn.MLPRegressor  # scikit-learn estimators
    from mpidp import sweep  # many trials at once, on groups of ranks

``import mpidp`` starts no MPI, nor do its pure names (``MpidpError``, ``Partition``,
``checksum``, ``partition``, ``nn``); the others are imported on first use, and MPI starts
then (with the hook that turns an uncaught exception on any rank into ``MPI_Abort``)."""

from __future__ import annotations

from ._lazy import exports
from ._threads import blas_threads_default

blas_threads_default()  # before numpy loads BLAS: see mpidp/_threads.py

__version__ = "0.2.0"

_LAZY = {
    "Checkpointing": ".run.spec", "fit": ".parallel.data_feed", "Data": ".data.distribute",
    "Shard": ".data.distribute", "load": ".data.distribute",
    "shard_from_arrays": ".data.distribute", "Partition": ".data.partition",
    "Plan": ".data.balance", "MpidpError": ".errors", "abort_on_error": ".comm",
    "assert_in_sync": ".comm", "checksum": ".digest", "params_in_sync": ".comm",
    "map_reduce": ".parallel.mapreduce", "DataParallel": ".parallel.data_parallel",
    "StepStats": ".run.stats", "RunSpec": ".run.spec", "nn": None, "partition": ".data.partition",
    "BestModel": ".observe.best", "sklearn": ".parallel.sklearn",
    "sweep": ".parallel.sweeps",
}
__getattr__, __dir__ = exports(__name__, _LAZY)
__all__ = sorted(_LAZY)
