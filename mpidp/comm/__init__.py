"""The only package that imports mpi4py. Everything else passes a ``comm`` in and gets
arrays out; importing it starts MPI (and installs the abort-on-error hook).

One module per concern: :mod:`~mpidp.comm.runtime` (communicators), :mod:`~.agreement`
(collective decisions, replica checksums), :mod:`~.collectives` (buffer-based collectives,
large counts), :mod:`~.hierarchy` (node-aware allreduce), :mod:`~.p2p` (point-to-point),
:mod:`~.shm` (shared-memory windows), :mod:`~.abort` (failing loudly), :mod:`~.watchdog`
(stalls), :mod:`~.measure` (latency and bandwidth for the cost model). Functions named
"Collective" must be called by every rank.
"""

import os

from .abort import abort_job, abort_on_error
from .activity import excused, set_step
from .agreement import (
    MpidpError,
    agree,
    agree_same,
    assert_in_sync,
    checksum,
    params_in_sync,
    root_decides,
    run_agreed,
)
from .collectives import (
    MAX_COUNT,
    REDUCE_SPLIT_BYTES,
    allgather_,
    allgather_counts,
    allgather_in_place,
    allgather_rows,
    allreduce_,
    allreduce_max,
    allreduce_sum_,
    alltoall_counts,
    alltoallv_rows,
    barrier,
    bcast_,
    bcast_obj,
    gather_obj,
    gather_rows,
    gatherv,
    gatherv_rows,
    iallgather_in_place,
    ialltoallv_,
    ibcast_,
    reduce_scatter_sum,
    reduce_sum_to_,
    scatterv_fill,
    scatterv_rows,
)
from .hierarchy import NodeAllreduce, node_aware_pays, node_layout
from .measure import exchange_time, pingpong, time_allreduce
from .p2p import MPI_REQUEST_NULL, irecv, isend, recv_, send, test_all, wait_all, wait_any
from .progress import BackgroundAllreduce, StartedSums, test_some, threads_supported
from .runtime import (
    SHM_DIR,
    Comm,
    companion,
    duplicate,
    fresh_tag,
    local_ranks,
    mpi_info,
    node_split,
    self_comm,
    split,
    split_off,
    world,
)
from .shm import SharedBroadcast, SharedCounter, SharedReduce, shm_room
from .watchdog import Watchdog


def install_abort_hook() -> None:
    """:func:`abort_on_error`, unless ``MPIDP_ABORT_ON_ERROR=0``: an uncaught exception on
    any rank ends the job instead of hanging it. Idempotent. Importing this package calls
    it; a trainer calls it again when built (MPI may have started after the import, or the
    hook have been removed)."""
    if os.environ.get("MPIDP_ABORT_ON_ERROR", "1") != "0":
        abort_on_error()


install_abort_hook()

__all__ = [
    "BackgroundAllreduce", "StartedSums", "test_some", "threads_supported",
    "Comm", "MAX_COUNT", "MPI_REQUEST_NULL", "MpidpError", "NodeAllreduce", "node_aware_pays",
    "node_layout", "REDUCE_SPLIT_BYTES", "SHM_DIR",
    "SharedBroadcast", "SharedCounter", "SharedReduce", "Watchdog", "abort_job", "abort_on_error",
    "install_abort_hook",
    "agree", "agree_same", "allgather_", "allgather_counts", "allgather_in_place", "allgather_rows",
    "allreduce_", "allreduce_max", "allreduce_sum_", "alltoall_counts", "alltoallv_rows",
    "assert_in_sync", "barrier", "bcast_", "bcast_obj", "checksum", "exchange_time", "excused", "gather_obj",
    "companion", "duplicate", "fresh_tag", "gather_rows", "gatherv", "gatherv_rows", "iallgather_in_place",
    "ialltoallv_", "ibcast_", "irecv", "isend",
    "local_ranks", "mpi_info", "node_split", "params_in_sync", "pingpong", "recv_",
    "reduce_scatter_sum", "reduce_sum_to_", "root_decides", "run_agreed", "scatterv_fill",
    "scatterv_rows", "self_comm", "send", "set_step", "shm_room", "split", "split_off", "test_all",
    "time_allreduce", "wait_all", "wait_any", "world",
]
