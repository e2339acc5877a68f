"""One BLAS thread pool per rank that fits the node, set before numpy loads its BLAS: P
ranks of C BLAS threads each on C cores starve MPI's progress, so (as ``torchrun`` does)
each rank defaults to ``cores // ranks_on_this_node`` threads. Variables the user set are
kept. The ranks on the node come from the launcher's environment: no MPI needed."""

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
    """Set the unset BLAS/OpenMP thread-count variables when several ranks share this node;
    return the count (or None). Once numpy is imported, through threadpoolctl if installed."""
    ranks_here = ranks_on_node()
    if ranks_here <= 1 or any(v in os.environ for v in _VARS):
        return None
    n = max(1, _cores() // ranks_here)
    for v in _VARS:
        os.environ[v] = str(n)
    # once numpy has loaded BLAS the variables come too late: only threadpoolctl can limit it
    return n if "numpy" not in sys.modules or limit_blas_threads(n) is not None else None


#: What launchers set: ranks of the job on this node (MPICH's Hydra, Open MPI, PMIx, Slurm).
_LOCAL_SIZE = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE",
               "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


def ranks_on_node() -> int:
    """Ranks of this job on this node, from the launcher's environment (1 if none)."""
    for var in _LOCAL_SIZE:
        text = os.environ.get(var, "").split("(")[0].split(",")[0]
        if text.isascii() and text.isdigit() and int(text) > 0:
            return int(text)
    return 1


def limit_blas_threads(n: int):
    """Limit BLAS threads to ``n`` in this process now: threadpoolctl's limiter, or None without it."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return None
    return threadpool_limits(n, user_api="blas")
