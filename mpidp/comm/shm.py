"""MPI shared-memory windows within a node: a global counter, a reduction and a
piece-by-piece broadcast that go through memory instead of MPI's message buffers."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from .progress import wait_yielding
from .runtime import SHM_DIR, Comm, watched


def shm_room(nbytes: int, path: str | None = None) -> bool:
    """True if ``path`` (default: the shared-memory folder; True if absent) has twice
    ``nbytes`` free: a window larger than its tmpfs (64 MiB by default in Docker) is not
    refused when allocated but kills the process with SIGBUS when touched."""
    try:
        st = os.statvfs(SHM_DIR if path is None else path)
    except OSError:
        return True  # no such mount: the MPI library keeps segments elsewhere
    return st.f_bavail * st.f_frsize >= 2 * nbytes


class SharedCounter:
    """A global counter that any rank can fetch-and-add without the others' help. Collective
    to create and to :meth:`free`: on one node in a shared-memory window (``Fetch_and_op``
    without the owner entering MPI), across nodes ``mpi4py.util.sync.Counter``."""

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

    @watched("a shared counter")
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


def _free_window(owner) -> bool:
    """Free ``owner._win`` (locked with ``Lock_all``) once; True when this call freed it."""
    win, owner._win = owner._win, None
    if win is None:
        return False
    win.Unlock_all()
    win.Free()
    return True


class SharedReduce:
    """Sum a 1-D array over the ranks of one node (see :func:`node_split`) into ``root``'s
    copy, through shared memory. Collective to create. ``array`` is this rank's ``(n,)`` array
    in the window, readable by every rank; :meth:`reduce` has each rank add up its ``1/P`` of
    the elements over all ranks (in rank order) straight into ``root``'s array."""

    def __init__(self, comm: Comm, n: int, dtype: np.dtype, root: int = 0) -> None:
        self.comm, self.root = comm, root
        dtype = np.dtype(dtype)
        self._win = MPI.Win.Allocate_shared(n * dtype.itemsize, dtype.itemsize, comm=comm)
        self._arrays = [np.frombuffer(self._win.Shared_query(r)[0], dtype, count=n)
                        for r in range(comm.size)]
        self.array = self._arrays[comm.rank]
        edges = [n * k // comm.size for k in range(comm.size + 1)]
        self._mine = slice(edges[comm.rank], edges[comm.rank + 1])
        self._win.Lock_all(MPI.MODE_NOCHECK)

    def array_of(self, rank: int) -> np.ndarray:
        """Rank ``rank``'s ``(n,)`` array (readable by every rank of the node)."""
        return self._arrays[rank]

    def free(self) -> None:
        """Release the window (its arrays must not be touched again). Collective; idempotent."""
        _free_window(self)

    def fence(self, longest_sleep: float = 0.0) -> None:
        """Make every rank's writes visible to all, and wait for the node. Collective.
        ``longest_sleep`` > 0: wait in sleeps of at most that many seconds, not polling."""
        self._win.Sync()
        wait_yielding(self.comm.Ibarrier(), longest_sleep)
        self._win.Sync()

    @watched("a shared-memory reduction")
    def reduce(self, longest_sleep: float = 0.0) -> None:
        """``root``'s ``array`` becomes the sum over ranks (the others' are left as they were).
        Collective; ``longest_sleep`` as for :meth:`fence`."""
        self.fence(longest_sleep)  # every rank's array is complete
        parts = [a[self._mine] for a in self._arrays]
        total = parts[0] if self.root == 0 else parts[0].copy()  # summed in rank order
        for part in parts[1:]:
            total += part
        if self.root:
            parts[self.root][...] = total
        self.fence()  # every slice is summed, and nobody reads the others' arrays any more


class SharedBroadcast:
    """Broadcast a 1-D array from ``root`` of one node (see :func:`node_split`) as a
    piece-by-piece copy out of its memory. Collective to create. ``array`` is ``root``'s
    ``(n,)`` array in a shared-memory window; ``root`` :meth:`publish`-es each finished piece
    (a zero-byte message to each rank) and the others :meth:`pull` it at once, copying while
    ``root`` computes the next piece."""

    _TAG = 1

    def __init__(self, comm: Comm, n: int, dtype: np.dtype, root: int = 0) -> None:
        self.comm, self.root = comm.Dup(), root
        dtype = np.dtype(dtype)
        self._win = MPI.Win.Allocate_shared(n * dtype.itemsize if comm.rank == root else 0,
                                            dtype.itemsize, comm=comm)
        mem, _ = self._win.Shared_query(root)
        self.array = np.frombuffer(mem, dtype, count=n)
        if comm.rank != root:
            self.array.flags.writeable = False
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._empty = np.empty(0, np.uint8)
        self._sent: list[MPI.Request] = []

    def free(self) -> None:
        """Release the window and its communicator (after :meth:`finish`). Collective; idempotent."""
        if _free_window(self):
            self.comm.Free()

    def publish(self) -> None:
        """On ``root``: the next piece of ``array`` is final; let every rank copy it."""
        self._win.Sync()  # make the stores visible before the message that announces them
        self._sent += [self.comm.Issend(self._empty, dest=r, tag=self._TAG)
                       for r in range(self.comm.size) if r != self.root]

    @watched("a shared-memory broadcast")
    def finish(self) -> None:
        """On ``root``: wait until every rank has received every announcement."""
        MPI.Request.Waitall(self._sent)
        self._sent = []

    @watched("a shared-memory broadcast")
    def pull(self, out: np.ndarray, edges: Sequence[int]) -> None:
        """On the other ranks: copy ``array[edges[k]:edges[k+1]]`` into ``out`` for each
        piece ``k`` as ``root`` publishes it (``root`` publishes ``len(edges) - 1`` times)."""
        for lo, hi in zip(edges[:-1], edges[1:]):
            self.comm.Recv(self._empty, source=self.root, tag=self._TAG)
            self._win.Sync()
            out[lo:hi] = self.array[lo:hi]
