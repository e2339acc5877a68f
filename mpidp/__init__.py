"""mpidp: data-parallel training of pure-NumPy models over MPI.

Public API::

    from mpidp import DataParallel, fit, load, nn
    from mpidp import Partition, map_reduce  # partition strategies, map/reduce
"""

import os

from ._threads import blas_threads_default

blas_threads_default()  # before numpy loads BLAS: see mpidp/_threads.py

from . import nn, partition  # noqa: E402
from .balance import Partition, Plan
from .comm import MpidpError, abort_on_error, assert_in_sync, checksum, params_in_sync
from .data import Data, Shard, load, shard_from_arrays
from .mapreduce import map_reduce
from .parallel import DataParallel, StepStats
from .train import Checkpointing, fit

if os.environ.get("MPIDP_ABORT_ON_ERROR", "1") != "0":
    abort_on_error()  # an uncaught exception on any rank ends the job instead of hanging it

__version__ = "0.1.0"

__all__ = [
    "Checkpointing", "Data", "DataParallel", "MpidpError", "Partition", "Plan", "Shard",
    "StepStats", "abort_on_error", "assert_in_sync", "checksum", "fit", "load", "map_reduce",
    "nn", "params_in_sync", "partition", "shard_from_arrays",
]
