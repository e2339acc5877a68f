"""The only package that imports mpi4py (importing it starts MPI and installs the
abort-on-error hook); everything else passes a ``comm`` in and gets arrays out. One module
per concern (docs/design.md); functions named "Collective" must be called by every rank.
"""

import os

from .agreement import (
    MpidpError,
    agree,
    agree_same,
    assert_in_sync,
    checksum,
    params_in_sync,
    replicas_differ,
    root_decides,
    run_agreed,
)
from .collectives import (
    MAX_COUNT,
    MPI_REQUEST_NULL,
    REDUCE_SPLIT_BYTES,
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
    exchange_time,
    gather_obj,
    gather_rows,
    gatherv,
    gatherv_rows,
    iallgather_in_place,
    ialltoallv_,
    ibcast_,
    idle_barrier,
    irecv,
    isend,
    pingpong,
    recv_,
    reduce_scatter_sum,
    reduce_sum_to_,
    scatterv_fill,
    scatterv_rows,
    send,
    test_all,
    time_allreduce,
    wait_all,
    wait_any,
)
from .progress import BackgroundAllreduce, StartedSums, test_some, threads_supported
from .runtime import (
    SHM_DIR,
    Comm,
    companion,
    duplicate,
    excused,
    fresh_tag,
    local_ranks,
    mpi_info,
    node_split,
    self_comm,
    set_step,
    split,
    split_groups,
    split_off,
    user_code,
    world,
)
from .shm import (
    NodeAllreduce,
    SharedBroadcast,
    SharedCounter,
    SharedReduce,
    node_aware_pays,
    node_layout,
    shm_room,
)
from .watchdog import Watchdog, abort_job, abort_on_error


def install_abort_hook() -> None:
    """:func:`abort_on_error` unless ``MPIDP_ABORT_ON_ERROR=0``; idempotent (a trainer calls it
    again: MPI may have started after the import)."""
    if os.environ.get("MPIDP_ABORT_ON_ERROR", "1") != "0":
        abort_on_error()


install_abort_hook()

__all__ = [
    "abort_job", "abort_on_error", "agree", "agree_same", "allgather_counts", "allgather_in_place",
    "allgather_rows", "allreduce_", "allreduce_max", "allreduce_sum_", "alltoall_counts",
    "alltoallv_rows", "assert_in_sync", "BackgroundAllreduce", "barrier", "bcast_", "bcast_obj",
    "checksum", "Comm", "companion", "duplicate", "exchange_time", "excused", "fresh_tag",
    "gather_obj", "gather_rows", "gatherv", "gatherv_rows", "iallgather_in_place", "ialltoallv_",
    "ibcast_", "idle_barrier", "install_abort_hook", "irecv", "isend", "local_ranks", "MAX_COUNT",
    "mpi_info", "MPI_REQUEST_NULL", "MpidpError", "node_aware_pays", "node_layout", "node_split",
    "NodeAllreduce", "params_in_sync", "pingpong", "recv_", "reduce_scatter_sum",
    "REDUCE_SPLIT_BYTES", "reduce_sum_to_", "replicas_differ", "root_decides", "run_agreed",
    "scatterv_fill", "scatterv_rows", "self_comm", "send", "set_step", "SharedBroadcast",
    "SharedCounter", "SharedReduce", "SHM_DIR", "shm_room", "split", "split_groups", "split_off",
    "StartedSums", "test_all", "test_some", "threads_supported", "time_allreduce", "user_code",
    "wait_all", "wait_any", "Watchdog", "world",
]
