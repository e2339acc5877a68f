"""mpidp: data-parallel training of pure-NumPy models over MPI.

Public API::

    from mpidp import DataParallel, fit, load, nn
    from mpidp import Partition, map_reduce  # partition strategies, map/reduce

``import mpidp`` and ``import mpidp.nn`` do not start MPI: the names that need it are
imported on first use, and MPI starts then (with the hook that turns an uncaught exception
on any rank into ``MPI_Abort``; ``MPIDP_ABORT_ON_ERROR=0`` turns that off).
"""

from __future__ import annotations

import importlib

from ._threads import blas_threads_default

blas_threads_default()  # before numpy loads BLAS: see mpidp/_threads.py

__version__ = "0.2.0"

_LAZY = {
    "Checkpointing": "loop", "fit": "loop", "Data": "data", "Shard": "data", "load": "data",
    "shard_from_arrays": "data", "Partition": "balance", "Plan": "balance",
    "MpidpError": "comm", "abort_on_error": "comm", "assert_in_sync": "comm",
    "checksum": "comm", "params_in_sync": "comm", "map_reduce": "mapreduce",
    "DataParallel": "parallel", "StepStats": "parallel", "nn": None, "partition": None,
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mpidp' has no attribute {name!r}")
    module = importlib.import_module(f".{_LAZY[name] or name}", __name__)
    value = module if _LAZY[name] is None else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
