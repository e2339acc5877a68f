"""The one module that talks to MPI. Everything else passes a ``comm`` in and gets arrays out.

All array traffic uses buffer-based (upper-case) mpi4py calls; the few pickled calls here
carry small control messages (error texts, metadata) and never run on the per-step path.
Every function named "Collective" must be called by every rank of ``comm``.
"""

from __future__ import annotations

import hashlib
import os
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

Comm = MPI.Comm


class MpidpError(ValueError):
    """A problem with the input or the job, raised with the same message on every rank."""


def world() -> Comm:
    """``MPI.COMM_WORLD``."""
    return MPI.COMM_WORLD


# --- collective decisions ---------------------------------------------------------------

def agree(comm: Comm, error: str | None) -> None:
    """Raise the same :class:`MpidpError` on every rank if ``error`` is set on any rank.

    Collective. Each rank passes its own verdict (``None`` when fine). The message names
    the lowest failing rank's problem and how many ranks failed.
    """
    flag = np.array([0 if error is None else 1], np.int32)
    comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    if not flag[0]:
        return
    errors = comm.allgather(error)  # small control message, only on the failure path
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    rank, msg = failed[0]
    where = f"rank {rank}" if len(failed) == 1 else f"ranks {[r for r, _ in failed]}"
    raise MpidpError(msg if comm.size == 1 else f"{msg} (on {where})")


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if isinstance(exc, (ValueError, OSError)) else f"{type(exc).__name__}: {text}"


def run_agreed(comm: Comm, fn, *args, **kwargs) -> Any:
    """Call ``fn`` on every rank; if it raises on any rank, every rank raises.

    Collective. Returns ``fn``'s result. A ``ValueError``/``OSError`` (bad input) becomes
    :class:`MpidpError` everywhere; any other exception is re-raised unchanged on the rank
    that hit it (a bug: the traceback matters) while the others raise :class:`MpidpError`,
    so no rank is left waiting in a later collective.
    """
    try:
        result, error, exc = fn(*args, **kwargs), None, None
    except Exception as caught:  # noqa: BLE001 - agreed on, then re-raised below
        result, error, exc = None, _describe(caught), caught
    try:
        agree(comm, error)
    except MpidpError:
        if exc is not None and not isinstance(exc, (ValueError, OSError)):
            raise exc from None
        raise
    return result


def root_decides(comm: Comm, fn, *args, root: int = 0, **kwargs) -> Any:
    """Run ``fn`` on ``root`` only; its result, or its failure, reaches every rank.

    Collective. The result is broadcast pickled, so keep it small (metadata, not arrays).
    Failures are raised as in :func:`run_agreed`.
    """
    payload: tuple[Any, str | None] = (None, None)
    exc = None
    if comm.rank == root:
        try:
            payload = (fn(*args, **kwargs), None)
        except Exception as caught:  # noqa: BLE001 - broadcast, then re-raised below
            payload, exc = (None, _describe(caught)), caught
    result, error = comm.bcast(payload, root=root)
    if error is None:
        return result
    if exc is not None and not isinstance(exc, (ValueError, OSError)):
        raise exc
    raise MpidpError(error)


# --- buffer-based data movement ---------------------------------------------------------

def bcast_(comm: Comm, buf: np.ndarray, root: int = 0) -> np.ndarray:
    """Broadcast contiguous ``buf`` from ``root`` in place. Collective. Returns ``buf``."""
    comm.Bcast(buf, root=root)
    return buf


def allreduce_sum_(comm: Comm, buf: np.ndarray) -> np.ndarray:
    """Sum contiguous ``buf`` over all ranks in place (one ``Allreduce``). Collective."""
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return buf


def allreduce_max(comm: Comm, values: Sequence[float]) -> np.ndarray:
    """Element-wise max over ranks of a few float64 values. Collective."""
    buf = np.asarray(values, np.float64).copy()
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return buf


def _row_type(dtype: np.dtype, row_size: int) -> MPI.Datatype:
    """A committed MPI datatype for one row of ``row_size`` elements (keeps counts small)."""
    base = MPI._typedict[np.dtype(dtype).char]
    return base.Create_contiguous(max(row_size, 1)).Commit()


def scatterv_rows(comm: Comm, array: np.ndarray | None, counts: Sequence[int],
                  row_shape: tuple[int, ...], dtype: np.dtype, root: int = 0) -> np.ndarray:
    """Send rank ``r`` rows ``displs[r]:displs[r]+counts[r]`` of ``array`` (held on ``root``).

    Collective. ``array`` is ``(sum(counts), *row_shape)`` on root and ignored elsewhere.
    Counts may be uneven or zero. Returns this rank's ``(counts[rank], *row_shape)`` rows.
    Counts are in rows (a contiguous row datatype), so messages beyond 2**31 elements work.
    """
    counts = np.asarray(counts, np.int64)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    row_size = int(np.prod(row_shape, dtype=np.int64))
    out = np.empty((int(counts[comm.rank]), *row_shape), dtype)
    if row_size == 0:
        return out
    rtype = _row_type(dtype, row_size)
    try:
        send = None
        if comm.rank == root:
            send = [np.ascontiguousarray(array, dtype), (counts, displs), rtype]
        comm.Scatterv(send, [out, int(counts[comm.rank]), rtype], root=root)
    finally:
        rtype.Free()
    return out


def gather_rows(comm: Comm, values: np.ndarray, root: int = 0) -> np.ndarray | None:
    """Gather one float64 row ``(k,)`` per rank into ``(size, k)`` on ``root``. Collective."""
    values = np.ascontiguousarray(values, np.float64)
    out = np.empty((comm.size, len(values))) if comm.rank == root else None
    comm.Gather(values, out, root=root)
    return out


# --- parameter consistency --------------------------------------------------------------

def checksum(array: np.ndarray) -> int:
    """A 63-bit digest of ``array``'s bytes: equal arrays (bit for bit) give equal digests."""
    digest = hashlib.blake2b(np.ascontiguousarray(array).view(np.uint8), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def params_in_sync(comm: Comm, params: np.ndarray) -> bool:
    """True on every rank iff all ranks hold bit-identical ``params``. Collective, 1 Allreduce."""
    h = checksum(params)
    buf = np.array([h, -h], np.int64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return bool(buf[0] == -buf[1])


def assert_in_sync(comm: Comm, params: np.ndarray, root: int = 0) -> None:
    """Raise :class:`MpidpError` on every rank, naming the ranks whose ``params`` differ from
    ``root``'s, unless all are bit-identical. Collective."""
    if params_in_sync(comm, params):
        return
    hashes = comm.allgather(checksum(params))  # failure path only
    bad = [r for r, h in enumerate(hashes) if h != hashes[root]]
    raise MpidpError(f"parameters differ from rank {root}'s on ranks {bad}: replicas are out of sync")


# --- failing loudly ---------------------------------------------------------------------

def _abort_hook(exc_type, exc, tb) -> None:
    comm = MPI.COMM_WORLD
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(f"[mpidp] rank {comm.rank}/{comm.size} failed; aborting the job.\n{text}")
    sys.stderr.flush()
    sys.stdout.flush()
    if comm.size > 1:
        comm.Abort(1)
    os._exit(1)


def abort_on_error() -> None:
    """Install a ``sys.excepthook`` that prints the rank and traceback, then ``MPI_Abort``s.

    Without it an uncaught exception on one rank leaves the others waiting in their next
    collective forever. Idempotent. (``python -m mpi4py script.py`` gives the same effect.)
    """
    if MPI.Is_initialized() and not MPI.Is_finalized():
        sys.excepthook = _abort_hook


def mpi_info(comm: Comm | None = None) -> dict[str, Any]:
    """MPI vendor, version, library string, world size and processor names (rank 0's view)."""
    comm = comm or MPI.COMM_WORLD
    vendor, version = MPI.get_vendor()
    return {
        "vendor": vendor,
        "vendor_version": ".".join(map(str, version)),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "library": MPI.Get_library_version().strip().splitlines()[0],
        "mpi4py": __import__("mpi4py").__version__,
        "world_size": comm.size,
        "processor": MPI.Get_processor_name(),
    }


def allgather_counts(comm: Comm, n: int) -> np.ndarray:
    """Every rank's ``n`` as an int64 array ``(size,)`` on every rank. Collective."""
    out = np.empty(comm.size, np.int64)
    comm.Allgather(np.array([n], np.int64), out)
    return out


# --- moving rows between ranks, shared counters (partitioning and map/reduce) ------------

def barrier(comm: Comm) -> None:
    """``Barrier``. Collective."""
    comm.Barrier()


def allgather_rows(comm: Comm, values: np.ndarray) -> np.ndarray:
    """Every rank's float64 row ``(k,)`` (same ``k`` everywhere) as ``(size, k)`` on every
    rank. Collective (one ``Allgather``)."""
    values = np.ascontiguousarray(values, np.float64)
    out = np.empty((comm.size, len(values)))
    comm.Allgather(values, out)
    return out


def alltoall_counts(comm: Comm, send_counts: Sequence[int]) -> np.ndarray:
    """The full ``(size, size)`` matrix ``M[src, dst]`` of rows each rank sends each rank.
    Collective (one ``Allgather``), so every rank can decide alike whether anything moves."""
    out = np.empty((comm.size, comm.size), np.int64)
    comm.Allgather(np.ascontiguousarray(send_counts, np.int64), out)
    return out


def alltoallv_rows(comm: Comm, rows: np.ndarray, send_counts: Sequence[int],
                   recv_counts: Sequence[int]) -> np.ndarray:
    """Exchange rows: this rank's ``rows`` ``(sum(send_counts), *row_shape)`` are sent in
    rank order (the first ``send_counts[0]`` to rank 0, ...); returns the received
    ``(sum(recv_counts), *row_shape)`` rows, sender 0's first. Collective (one buffer-based
    ``Alltoallv`` with a contiguous row datatype; ``row_shape`` and dtype equal everywhere)."""
    rows = np.ascontiguousarray(rows)
    send_counts, recv_counts = (np.asarray(c, np.int64) for c in (send_counts, recv_counts))
    row_shape = rows.shape[1:]
    out = np.empty((int(recv_counts.sum()), *row_shape), rows.dtype)
    row_size = int(np.prod(row_shape, dtype=np.int64))
    if row_size == 0:
        return out
    sdispl = np.concatenate([[0], np.cumsum(send_counts)[:-1]]).astype(np.int64)
    rdispl = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(np.int64)
    rtype = _row_type(rows.dtype, row_size)
    try:
        comm.Alltoallv([rows, (send_counts, sdispl), rtype], [out, (recv_counts, rdispl), rtype])
    finally:
        rtype.Free()
    return out


class SharedCounter:
    """A global counter that any rank can fetch-and-add without the others' help.

    Collective to create and to :meth:`free`. On one node (the usual case here) it lives in
    an MPI shared-memory window (``Win.Allocate_shared``) and ``Fetch_and_op`` completes
    without the owner entering MPI; across nodes it falls back to
    ``mpi4py.util.sync.Counter`` (passive-target RMA, which may wait for progress on rank 0).
    """

    def __init__(self, comm: Comm, start: int = 0) -> None:
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        one_node = local.size == comm.size
        local.Free()
        self._counter = None
        if not one_node:
            from mpi4py.util.sync import Counter
            self._counter = Counter(start, comm=comm)
            return
        self._win = MPI.Win.Allocate_shared(8 if comm.rank == 0 else 0, 8, comm=comm)
        if comm.rank == 0:
            np.frombuffer(self._win.tomemory(), np.int64)[0] = start
        comm.Barrier()
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._one, self._got = np.ones(1, np.int64), np.zeros(1, np.int64)

    def next(self, incr: int = 1) -> int:
        """Add ``incr`` and return the value before (atomic across ranks). Not collective."""
        if self._counter is not None:
            return int(self._counter.next(incr))
        self._one[0] = incr
        self._win.Fetch_and_op(self._one, self._got, 0, 0, MPI.SUM)
        self._win.Flush(0)
        return int(self._got[0])

    def free(self, comm: Comm) -> None:
        """Release the window. Collective."""
        if self._counter is not None:
            self._counter.free()
            return
        self._win.Unlock_all()
        comm.Barrier()
        self._win.Free()


def gatherv_rows(comm: Comm, rows: np.ndarray, root: int = 0) -> np.ndarray | None:
    """Concatenate every rank's ``(k_r, *row_shape)`` rows, rank order, on ``root``; None
    elsewhere. Collective (one ``Gather`` of counts, one buffer-based ``Gatherv``)."""
    rows = np.ascontiguousarray(rows)
    counts = np.empty(comm.size, np.int64) if comm.rank == root else None
    comm.Gather(np.array([len(rows)], np.int64), counts, root=root)
    row_size = max(int(np.prod(rows.shape[1:], dtype=np.int64)), 1)
    rtype = _row_type(rows.dtype, row_size)
    try:
        out = None
        recv = None
        if comm.rank == root:
            out = np.empty((int(counts.sum()), *rows.shape[1:]), rows.dtype)
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
            recv = [out, (counts, displs), rtype]
        comm.Gatherv([rows, len(rows), rtype], recv, root=root)
    finally:
        rtype.Free()
    return out


def allreduce_(comm: Comm, buf: np.ndarray, op: str) -> np.ndarray:
    """Reduce contiguous ``buf`` in place over all ranks with ``op`` in ``sum``, ``min``,
    ``max``. Collective (one ``Allreduce``)."""
    ops = {"sum": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}
    comm.Allreduce(MPI.IN_PLACE, buf, op=ops[op])
    return buf
