"""Buffer-based collectives and point-to-point messages on NumPy arrays, and the network's latency
and bandwidth measured. Arrays travel in upper-case mpi4py calls, in pieces over :data:`MAX_COUNT`
elements (rows as a contiguous datatype); every rank of ``comm`` calls every collective."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from .agreement import MpidpError
from .runtime import Comm, watched

#: Largest element count of one MPI call (a C int); tests lower it (``MPIDP_MAX_COUNT``).
MAX_COUNT = int(os.environ.get("MPIDP_MAX_COUNT", 2**31 - 1))


def _pieces(buf: np.ndarray) -> list[np.ndarray]:
    """Contiguous ``buf`` flattened, in slices of at most :data:`MAX_COUNT` elements."""
    flat = buf.reshape(-1)
    return [flat[lo:lo + MAX_COUNT] for lo in range(0, flat.size, MAX_COUNT)] or [flat]


def _displs(counts) -> np.ndarray:
    """int64 ``displs[r] = sum(counts[:r])``."""
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)


@watched("a Bcast (control message)")
def bcast_obj(comm: Comm, obj: Any, root: int = 0) -> Any:
    """Broadcast a small picklable object (metadata, never arrays on the per-step path)."""
    return comm.bcast(obj, root=root)


@watched("a Gather (control message)")
def gather_obj(comm: Comm, obj: Any, root: int = 0) -> list[Any] | None:
    """Every rank's small picklable ``obj`` as a list (index = rank) on ``root``; None elsewhere."""
    return comm.gather(obj, root=root)


@watched("a Bcast")
def bcast_(comm: Comm, buf: np.ndarray, root: int = 0) -> np.ndarray:
    """Broadcast contiguous ``buf`` from ``root`` in place (in pieces); returns ``buf``."""
    for piece in _pieces(buf):
        comm.Bcast(piece, root=root)
    return buf


@watched("an Allreduce")
def allreduce_sum_(comm: Comm, buf: np.ndarray) -> np.ndarray:
    """Sum contiguous ``buf`` over all ranks in place (one ``Allreduce`` per piece)."""
    for piece in _pieces(buf):
        comm.Allreduce(MPI.IN_PLACE, piece, op=MPI.SUM)
    return buf


@watched("an Allreduce")
def allreduce_(comm: Comm, buf: np.ndarray, op: str) -> np.ndarray:
    """Reduce contiguous ``buf`` in place with ``op`` in ``sum``, ``min``, ``max``."""
    comm.Allreduce(MPI.IN_PLACE, buf, op={"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}[op])
    return buf


@watched("an Allreduce (max)")
def allreduce_max(comm: Comm, values: Sequence[float]) -> np.ndarray:
    """Element-wise max over ranks of a few float64 values."""
    return allreduce_(comm, np.array(values, np.float64), "max")


def ialltoallv_(comm: Comm, send: np.ndarray, send_parts: tuple[np.ndarray, np.ndarray],
                recv: np.ndarray, recv_parts: tuple[np.ndarray, np.ndarray]) -> MPI.Request:
    """Start sending ``send[displs[r]:displs[r] + counts[r]]`` to each rank ``r`` and receiving into
    ``recv`` likewise (``*_parts``: int64 ``(counts, displs)`` in elements); complete with :func:`wait_all`
    or :func:`test_some`. :class:`MpidpError` past :data:`MAX_COUNT` (callers send in pieces)."""
    for what, (counts, displs) in (("send", send_parts), ("receive", recv_parts)):
        reach = int((np.asarray(counts) + np.asarray(displs)).max(initial=0))
        if reach > MAX_COUNT:
            raise MpidpError(f"an Alltoallv {what} reaching element {reach} exceeds one MPI "
                             f"call (counts and displacements are C ints, at most "
                             f"{MAX_COUNT}); send it in pieces")
    return comm.Ialltoallv([send, send_parts], [recv, recv_parts])


def iallgather_in_place(comm: Comm, buf: np.ndarray) -> MPI.Request:
    """Start :func:`allgather_in_place` of ``buf`` ``(size * k,)``."""
    return comm.Iallgather(MPI.IN_PLACE, buf)


def ibcast_(comm: Comm, buf: np.ndarray, root: int = 0) -> list[MPI.Request]:
    """Start broadcasting contiguous ``buf`` from ``root`` in place; ``buf`` stays alive, and
    unchanged on ``root``, until :func:`wait_all` completes the requests."""
    return [comm.Ibcast(piece, root=root) for piece in _pieces(buf)]


#: Buffers of at least this many bytes are summed to a root as a reduce-scatter + gather.
REDUCE_SPLIT_BYTES = 1 << 16


@watched("a Reduce")
def reduce_sum_to_(comm: Comm, buf: np.ndarray, root: int = 0) -> np.ndarray:
    """Sum 1-D ``buf`` over ranks into ``root``'s ``buf`` (others' left unspecified); from
    :data:`REDUCE_SPLIT_BYTES` on as ``Reduce_scatter`` + ``Gatherv`` (docs/benchmarks.md)."""
    if comm.size == 1:
        return buf
    if buf.nbytes < REDUCE_SPLIT_BYTES or buf.size > MAX_COUNT or not buf.flags.c_contiguous:
        mine = comm.rank == root
        comm.Reduce(MPI.IN_PLACE if mine else buf, buf if mine else None, op=MPI.SUM, root=root)
        return buf
    counts = np.full(comm.size, buf.size // comm.size, np.int64)
    counts[:buf.size % comm.size] += 1
    mine = np.empty(int(counts[comm.rank]), buf.dtype)
    comm.Reduce_scatter(buf, mine, recvcounts=counts.tolist(), op=MPI.SUM)
    comm.Gatherv(mine, [buf, (counts, _displs(counts))] if comm.rank == root else None, root=root)
    return buf


@watched("a Reduce_scatter")
def reduce_scatter_sum(comm: Comm, send: np.ndarray, recv: np.ndarray) -> np.ndarray:
    """Sum ``send`` ``(size * k,)`` over ranks; rank ``r`` gets block ``r`` ``(k,)``."""
    comm.Reduce_scatter_block(send, recv, op=MPI.SUM)
    return recv


@watched("an Allgather")
def allgather_in_place(comm: Comm, buf: np.ndarray) -> np.ndarray:
    """``buf`` ``(size * k,)``: every rank's own block ``r`` copied into the others' ``buf``."""
    comm.Allgather(MPI.IN_PLACE, buf)
    return buf


@watched("an Allgather (counts)")
def allgather_counts(comm: Comm, n: int) -> np.ndarray:
    """Every rank's ``n`` as an int64 array ``(size,)`` on every rank."""
    out = np.empty(comm.size, np.int64)
    comm.Allgather(np.array([n], np.int64), out)
    return out


@watched("an Allgather")
def allgather_rows(comm: Comm, values: np.ndarray) -> np.ndarray:
    """Every rank's float64 row ``(k,)`` (same ``k`` everywhere) as ``(size, k)``."""
    values = np.ascontiguousarray(values, np.float64)
    out = np.empty((comm.size, len(values)))
    comm.Allgather(values, out)
    return out


@watched("a Gather")
def gather_rows(comm: Comm, values: np.ndarray, root: int = 0) -> np.ndarray | None:
    """Every rank's float64 row ``(k,)`` as ``(size, k)`` on ``root``."""
    values = np.ascontiguousarray(values, np.float64)
    out = np.empty((comm.size, len(values))) if comm.rank == root else None
    comm.Gather(values, out, root=root)
    return out


@watched("a Gatherv")
def gatherv(comm: Comm, values: np.ndarray, root: int = 0) -> np.ndarray | None:
    """Every rank's 1-D ``values`` (lengths may differ) joined in rank order on ``root``; None elsewhere."""
    values = np.ascontiguousarray(values)
    counts = allgather_counts(comm, values.size)
    if counts.sum() > MAX_COUNT:
        raise MpidpError(f"gatherv of {counts.sum()} elements exceeds one MPI call")
    out = np.empty(int(counts.sum()), values.dtype) if comm.rank == root else None
    comm.Gatherv(values, None if out is None else [out, (counts, _displs(counts))], root=root)
    return out


@watched("a Gatherv")
def gatherv_rows(comm: Comm, rows: np.ndarray, root: int = 0) -> np.ndarray | None:
    """Every rank's ``(k_r, *row_shape)`` rows concatenated in rank order on ``root``; None elsewhere."""
    rows = np.ascontiguousarray(rows)
    counts = np.empty(comm.size, np.int64) if comm.rank == root else None
    comm.Gather(np.array([len(rows)], np.int64), counts, root=root)
    out = None if counts is None else np.empty((int(counts.sum()), *rows.shape[1:]), rows.dtype)
    with _row_type(rows.dtype, int(np.prod(rows.shape[1:], dtype=np.int64))) as rtype:
        recv = None if out is None else [out, (counts, _displs(counts)), rtype]
        comm.Gatherv([rows, len(rows), rtype], recv, root=root)
    return out


@contextlib.contextmanager
def _row_type(dtype: np.dtype, row_size: int):
    """A committed MPI datatype of ``row_size`` elements (keeps counts small), freed on leaving."""
    base = from_numpy_dtype(np.dtype(dtype))
    try:
        rtype = base.Create_contiguous(max(row_size, 1)).Commit()
    finally:
        base.Free()
    try:
        yield rtype
    finally:
        rtype.Free()


@watched("a Scatterv")
def scatterv_rows(comm: Comm, array: np.ndarray | None, counts: Sequence[int],
                  row_shape: tuple[int, ...], dtype: np.dtype, root: int = 0,
                  rows_per_round: int | None = None) -> np.ndarray:
    """Send rank ``r`` rows ``displs[r]:displs[r]+counts[r]`` of ``array`` ``(sum(counts),
    *row_shape)`` (on ``root``: any array-like that slices by rows, such as a memmap); returns
    this rank's ``(counts[rank], *row_shape)`` rows. Streamed by :func:`scatterv_fill`."""
    counts = np.asarray(counts, np.int64)
    displs = _displs(counts)

    def fill(rank: int, lo: int, dest: np.ndarray) -> None:
        start = int(displs[rank]) + lo
        dest[...] = array[start:start + len(dest)]

    return scatterv_fill(comm, counts, row_shape, dtype, fill, root, rows_per_round)


@watched("an Allgather (counts)")
def alltoall_counts(comm: Comm, send_counts: Sequence[int]) -> np.ndarray:
    """The ``(size, size)`` matrix ``M[src, dst]`` of rows each rank sends each rank, on every
    rank (so every rank can decide alike whether anything moves)."""
    out = np.empty((comm.size, comm.size), np.int64)
    comm.Allgather(np.ascontiguousarray(send_counts, np.int64), out)
    return out


@watched("an Alltoallv")
def alltoallv_rows(comm: Comm, rows: np.ndarray, send_counts: Sequence[int],
                   recv_counts: Sequence[int]) -> np.ndarray:
    """Send ``rows`` ``(sum(send_counts), *row_shape)`` in rank order (the first ``send_counts[0]``
    to rank 0, ...); returns the ``(sum(recv_counts), *row_shape)`` rows received, sender 0's first."""
    rows = np.ascontiguousarray(rows)
    send_counts, recv_counts = (np.asarray(c, np.int64) for c in (send_counts, recv_counts))
    row_shape = rows.shape[1:]
    out = np.empty((int(recv_counts.sum()), *row_shape), rows.dtype)
    row_size = int(np.prod(row_shape, dtype=np.int64))
    if row_size == 0:
        return out
    with _row_type(rows.dtype, row_size) as rtype:
        comm.Alltoallv([rows, (send_counts, _displs(send_counts)), rtype],
                       [out, (recv_counts, _displs(recv_counts)), rtype])
    return out


@watched("a Barrier")
def barrier(comm: Comm) -> None:
    """Wait until every rank of ``comm`` arrives."""
    comm.Barrier()


@watched("an Ibarrier (idle)")
def idle_barrier(comm: Comm, poll: float = 0.05) -> None:
    """:func:`barrier` that sleeps ``poll`` seconds between tests: a rank done long before
    the others leaves its core to them instead of spinning in MPI."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll)


#: Bytes sent to each rank per round by :func:`scatterv_fill` (when no round size is given).
ROUND_BYTES = 32 << 20


@watched("a Scatterv")
def scatterv_fill(comm: Comm, counts: Sequence[int], row_shape: tuple[int, ...],
                  dtype: np.dtype, fill: Callable[[int, int, np.ndarray], None] | None,
                  root: int = 0, rows_per_round: int | None = None) -> np.ndarray:
    """Scatterv rows that ``root`` produces round by round: rank ``r`` receives
    ``(counts[r], *row_shape)`` rows of ``dtype``. On root ``fill(r, lo, dest)`` writes rows
    ``lo .. lo+len(dest)-1`` of rank ``r``'s part into ``dest`` (root's own result, or the one
    send buffer reused every round of ``rows_per_round`` rows, default :data:`ROUND_BYTES`)."""
    counts = np.asarray(counts, np.int64)
    row_size = int(np.prod(row_shape, dtype=np.int64))
    out = np.empty((int(counts[comm.rank]), *row_shape), dtype)
    if row_size == 0 or counts.sum() == 0:
        return out
    if row_size > MAX_COUNT:
        raise MpidpError(f"one row has {row_size} elements, more than one MPI call takes")
    if rows_per_round is None:
        rows_per_round = max(1, min(ROUND_BYTES // (row_size * np.dtype(dtype).itemsize),
                                    MAX_COUNT // row_size))
    send = None
    with _row_type(dtype, row_size) as rtype:
        for lo in range(0, int(counts.max()), rows_per_round):
            take = np.clip(counts - lo, 0, rows_per_round)  # rows each rank gets this round
            if comm.rank != root:
                mine = int(take[comm.rank])
                comm.Scatterv(None, [out[lo:lo + mine], mine, rtype], root=root)
                continue
            sizes = take.tolist()
            take[root] = 0  # root's rows are written into its result directly
            displs = _displs(take)
            if send is None:  # the first round is the largest
                send = np.empty((int(take.sum()), *row_shape), dtype)
            for r, n in enumerate(sizes):
                if n:
                    fill(r, lo, out[lo:lo + n] if r == root else send[displs[r]:displs[r] + n])
            comm.Scatterv([send, (take, displs), rtype], MPI.IN_PLACE, root=root)
    return out


# --- point to point: over MAX_COUNT elements as several messages with the same tag (MPI keeps their order)


def isend(comm: Comm, buf: np.ndarray, dest: int, tag: int) -> list[MPI.Request]:
    """Start sending contiguous ``buf`` to ``dest``; returns the requests to wait on (``buf``
    stays alive and unchanged until they complete)."""
    return [comm.Isend(piece, dest=dest, tag=tag) for piece in _pieces(buf)]


@watched("a Recv")
def recv_(comm: Comm, buf: np.ndarray, source: int, tag: int) -> np.ndarray:
    """Receive into contiguous ``buf`` from ``source`` (an :func:`isend` of as many); returns ``buf``."""
    for piece in _pieces(buf):
        comm.Recv(piece, source=source, tag=tag)
    return buf


def irecv(comm: Comm, buf: np.ndarray, source: int, tag: int) -> list[MPI.Request]:
    """Start receiving into contiguous ``buf`` from ``source``; returns the requests."""
    return [comm.Irecv(piece, source=source, tag=tag) for piece in _pieces(buf)]


def test_all(requests: Sequence[MPI.Request]) -> bool:
    """True (and the requests freed) if every request is complete; never blocks (False: all pending)."""
    return bool(MPI.Request.Testall(list(requests))) if requests else True


@watched("a Waitall")
def wait_all(requests: Sequence[MPI.Request]) -> None:
    """Complete every request in ``requests``."""
    if requests:
        MPI.Request.Waitall(list(requests))


@watched("a Waitany")
def wait_any(requests: list) -> int:
    """Index of a completed request among ``requests`` (blocking)."""
    return MPI.Request.Waitany(requests)


MPI_REQUEST_NULL = MPI.REQUEST_NULL


@watched("a Send")
def send(comm: Comm, buf: np.ndarray, dest: int, tag: int) -> None:
    """Send contiguous ``buf`` to ``dest`` (blocking; matches :func:`recv_`)."""
    for piece in _pieces(buf):
        comm.Send(piece, dest=dest, tag=tag)


# --- measuring the network: the cost model's inputs


def pingpong(comm: Comm, nbytes: int, reps: int = 50, peer: int = 1) -> float | None:
    """One-way seconds of an ``nbytes`` message between rank 0 and ``peer`` (the median of
    ``reps`` round trips, halved) on rank 0; None elsewhere. Collective over the pair."""
    buf = np.zeros(max(nbytes, 1), np.uint8)[:nbytes]
    calls = (comm.Send, comm.Recv) if comm.rank == 0 else (comm.Recv, comm.Send)  # rank 0 asks

    def round_trip(other: int) -> None:
        for call in calls:
            call(buf, other, 5)
    t = _pair_median(comm, peer, round_trip, reps)
    return None if t is None else t / 2


def time_allreduce(comm: Comm, n: int, dtype=np.float32, reps: int = 20,
                   evict: np.ndarray | None = None) -> float:
    """Median seconds of an in-place ``Allreduce`` of ``n`` elements (the slowest rank's).
    Collective. ``evict``: read before each, to push the buffer out of the caches."""
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
    """Median seconds for rank 0 and ``peer`` to ``Sendrecv`` ``nbytes`` to each other (both
    directions busy, as in a ring), on rank 0; None elsewhere. Collective over the pair."""
    out, back = (np.zeros(max(nbytes, 1), np.uint8)[:nbytes] for _ in range(2))
    return _pair_median(comm, peer, lambda other: comm.Sendrecv(
        out, dest=other, sendtag=6, recvbuf=back, source=other, recvtag=6), reps)


def _pair_median(comm: Comm, peer: int, once: Callable[[int], None], reps: int) -> float | None:
    """Median seconds of ``once(the other rank of the pair)`` over ``reps`` runs after 3 warm-ups,
    on rank 0; None elsewhere (``once`` runs on rank 0 and ``peer`` only)."""
    if comm.rank not in (0, peer):
        return None
    other = peer if comm.rank == 0 else 0
    times = []
    for _ in range(reps + 3):
        t = MPI.Wtime()
        once(other)
        times.append(MPI.Wtime() - t)
    return float(np.median(times[3:])) if comm.rank == 0 else None
