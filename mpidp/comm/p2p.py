"""Point-to-point messages (pipelines, the asynchronous parameter server) on NumPy buffers:
over :data:`~mpidp.comm.collectives.MAX_COUNT` elements, as several messages with the same
tag (MPI keeps their order)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from .activity import watched
from .collectives import _pieces
from .runtime import Comm


def isend(comm: Comm, buf: np.ndarray, dest: int, tag: int) -> list[MPI.Request]:
    """Start sending contiguous ``buf`` to ``dest``; returns the requests to wait on (``buf``
    stays alive and unchanged until they complete)."""
    flat = buf.reshape(-1)
    return [comm.Isend(flat[lo:hi], dest=dest, tag=tag) for lo, hi in _pieces(flat.size)]


@watched("a Recv")
def recv_(comm: Comm, buf: np.ndarray, source: int, tag: int) -> np.ndarray:
    """Receive into contiguous ``buf`` (matching :func:`isend` of as many elements) from
    ``source``; returns ``buf``."""
    flat = buf.reshape(-1)
    for lo, hi in _pieces(flat.size):
        comm.Recv(flat[lo:hi], source=source, tag=tag)
    return buf


def irecv(comm: Comm, buf: np.ndarray, source: int, tag: int) -> list[MPI.Request]:
    """Start receiving into contiguous ``buf`` from ``source``; returns the requests."""
    flat = buf.reshape(-1)
    return [comm.Irecv(flat[lo:hi], source=source, tag=tag) for lo, hi in _pieces(flat.size)]


def test_all(requests: Sequence[MPI.Request]) -> bool:
    """True (and the requests freed) if every request is complete; never blocks (False
    leaves them all pending)."""
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
    flat = buf.reshape(-1)
    for lo, hi in _pieces(flat.size):
        comm.Send(flat[lo:hi], dest=dest, tag=tag)
