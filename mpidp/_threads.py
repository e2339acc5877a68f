"""One BLAS thread pool per rank that fits the node, set before numpy loads its BLAS.

When several ranks share a node, each rank's BLAS would otherwise start one thread per
core: P ranks x C threads fight over C cores and spinning BLAS threads starve MPI's
progress (stalls of many milliseconds per Allreduce after an evaluation pass). Like
``torchrun``, mpidp then defaults each rank to ``cores // ranks_on_this_node`` threads.
Variables the user set are never changed. The count of ranks on the node comes from the
launcher's environment, so this runs before MPI starts (and without an MPI library).
"""

from __future__ import annotations

import os
import sys

_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def blas_threads_default() -> int | None:
    """Set BLAS/OpenMP thread-count variables that are unset; return the count (or None).

    Only acts when more than one rank runs on this node. If numpy is already imported,
    the limit is applied through threadpoolctl when that is installed.
    """
    if any(v in os.environ for v in _VARS):
        return None
    ranks_here = ranks_on_node()
    if ranks_here <= 1:
        return None
    n = max(1, _cores() // ranks_here)
    for v in _VARS:
        os.environ[v] = str(n)
    if "numpy" in sys.modules:  # BLAS already loaded: the variables come too late
        return n if limit_blas_threads(n) is not None else None
    return n


#: What launchers set: ranks of the job on this node (MPICH's Hydra, Open MPI, PMIx, Slurm).
_LOCAL_SIZE = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE",
               "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def ranks_on_node() -> int:
    """Ranks of this job on this node, from the launcher's environment (1 if not launched
    by one). Read without starting MPI, which must wait until BLAS threads are set."""
    for var in _LOCAL_SIZE:
        text = os.environ.get(var, "").split("(")[0].split(",")[0]
        if text.isascii() and text.isdigit() and int(text) > 0:
            return int(text)
    return 1


def limit_blas_threads(n: int):
    """Limit BLAS threads to ``n`` in this process now (needs threadpoolctl); returns the
    threadpoolctl limiter, or None when threadpoolctl is not installed."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(n, user_api="blas")
