"""Measuring the network: point-to-point latency and bandwidth, and Allreduce times (the
cost model's inputs)."""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .runtime import Comm


def pingpong(comm: Comm, nbytes: int, reps: int = 50, peer: int = 1) -> float | None:
    """One-way seconds of an ``nbytes`` message between rank 0 and ``peer`` (the median of
    ``reps`` round trips, halved) on rank 0; None elsewhere. Collective over the pair."""
    if comm.rank not in (0, peer):
        return None
    buf = np.zeros(max(nbytes, 1), np.uint8)[:nbytes]
    times = []
    for _ in range(reps + 3):
        t = MPI.Wtime()
        if comm.rank == 0:
            comm.Send(buf, dest=peer, tag=5)
            comm.Recv(buf, source=peer, tag=5)
        else:
            comm.Recv(buf, source=0, tag=5)
            comm.Send(buf, dest=0, tag=5)
        times.append((MPI.Wtime() - t) / 2)
    return float(np.median(times[3:])) if comm.rank == 0 else None


def time_allreduce(comm: Comm, n: int, dtype=np.float32, reps: int = 20,
                   evict: np.ndarray | None = None) -> float:
    """Median seconds of an in-place ``Allreduce`` of ``n`` elements (the slowest rank's,
    between barriers). Collective. ``evict``: an array read before each repetition to push the
    buffer out of the caches, as a training step's other memory traffic does."""
    buf = np.ones(n, dtype)
    times = []
    for _ in range(reps + 2):
        if evict is not None:
            evict.sum()
        comm.Barrier()
        t = MPI.Wtime()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        times.append(comm.allreduce(MPI.Wtime() - t, op=MPI.MAX))
    return float(np.median(times[2:]))


def exchange_time(comm: Comm, nbytes: int, reps: int = 20, peer: int = 1) -> float | None:
    """Seconds for rank 0 and ``peer`` to ``Sendrecv`` ``nbytes`` to each other (the median
    of ``reps``: a link with both directions busy, as in a ring's steps) on rank 0; None
    elsewhere. Collective over the pair."""
    if comm.rank not in (0, peer):
        return None
    other = peer if comm.rank == 0 else 0
    out, back = (np.zeros(max(nbytes, 1), np.uint8)[:nbytes] for _ in range(2))
    times = []
    for _ in range(reps + 3):
        t = MPI.Wtime()
        comm.Sendrecv(out, dest=other, sendtag=6, recvbuf=back, source=other, recvtag=6)
        times.append(MPI.Wtime() - t)
    return float(np.median(times[3:])) if comm.rank == 0 else None
