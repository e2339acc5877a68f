"""MPI shared-memory windows within a node: a global counter, a reduction and a piece-by-piece
broadcast through memory, not MPI's message buffers; and the node-aware allreduce built on them."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from .collectives import allreduce_, allreduce_max, allreduce_sum_
from .progress import wait_yielding
from .runtime import SHM_DIR, Comm, _node, node_split, watched


def shm_room(nbytes: int, path: str | None = None) -> bool:
    """True if ``path`` (default: the shared-memory folder; True if absent) has twice ``nbytes``
    free: a window past its tmpfs kills the process with SIGBUS when touched."""
    try:
        st = os.statvfs(SHM_DIR if path is None else path)
    except OSError:
        return True  # no such mount: the MPI library keeps segments elsewhere
    return st.f_bavail * st.f_frsize >= 2 * nbytes


class SharedCounter:
    """A global counter any rank can fetch-and-add alone, in a shared-memory window on one
    node (``mpi4py.util.sync.Counter`` across nodes). Collective to create and to :meth:`free`."""

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
    """Sum a 1-D array over the ranks of one node into ``root``'s copy through shared memory
    (collective to create): :meth:`reduce` has each rank add its ``1/P`` of the elements."""

    def __init__(self, comm: Comm, n: int, dtype: np.dtype, root: int = 0) -> None:
        self.comm, self.root = comm, root
        dtype = np.dtype(dtype)
        self._win = MPI.Win.Allocate_shared(n * dtype.itemsize, dtype.itemsize, comm=comm)
        self._arrays = [np.frombuffer(self._win.Shared_query(r)[0], dtype, count=n)
                        for r in range(comm.size)]
        self.array = self._arrays[comm.rank]
        self._mine = slice(n * comm.rank // comm.size, n * (comm.rank + 1) // comm.size)
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
    """Broadcast a 1-D array from ``root`` of one node as a piece-by-piece copy out of its
    shared-memory window: ``root`` :meth:`publish`-es each piece, the others :meth:`pull` it."""

    _TAG = 1

    def __init__(self, comm: Comm, n: int, dtype: np.dtype, root: int = 0) -> None:
        self.comm, self.root = comm.Dup(), root
        dtype = np.dtype(dtype)
        self._win = MPI.Win.Allocate_shared(n * dtype.itemsize if comm.rank == root else 0,
                                            dtype.itemsize, comm=comm)
        self.array = np.frombuffer(self._win.Shared_query(root)[0], dtype, count=n)
        if comm.rank != root:
            self.array.flags.writeable = False
        self._win.Lock_all(MPI.MODE_NOCHECK)
        self._empty = np.empty(0, np.uint8)
        self._sent: list[MPI.Request] = []

    def free(self) -> None:
        """Free the window and communicator (after :meth:`finish`). Collective; idempotent."""
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


# --- node-aware allreduce (NodeAllreduce): across nodes only the leaders send, 2 (H-1)/H m
# bytes over each of H nodes' links each way (the least any allreduce moves); each element is
# summed in a fixed order (the node's ranks, then MPI's reduction over the leaders), the same on every replica


def _node_sizes(comm: Comm) -> tuple[int, bool, bool]:
    """``(most ranks on one node, several nodes, this rank leads its node)``. Collective."""
    node = _node(comm, comm.rank)
    size, leads = node.size, node.rank == 0
    node.Free()
    most = np.array([size, comm.size - size], np.int64)  # one node iff no node lacks a rank
    allreduce_(comm, most, "max")
    return int(most[0]), bool(most[1] > 0), leads


def node_layout(comm: Comm) -> tuple[int, int]:
    """``(nodes, most ranks on one node)`` of ``comm``, the same on every rank. Collective."""
    most, several, leads = _node_sizes(comm)
    if not several:
        return 1, most
    return int(allreduce_sum_(comm, np.array([float(leads)]))[0]), most


def node_aware_pays(comm: Comm) -> bool:
    """True when ranks share nodes AND there are several nodes: only then does a node-aware
    reduction take bytes off the network. Collective."""
    most, several, _ = _node_sizes(comm)
    return several and most > 1


#: A rank that waits long (for its node, or its leader's exchange) sleeps in steps of at
#: most this share of its last such wait (between 20 us and 1 ms), not polling: the wait
#: ends at most 2 % late and leaves the cores to ranks still computing.
SLEEP_SHARE, SHORTEST_SLEEP, LONGEST_SLEEP = 0.02, 2e-5, 1e-3

#: Leaders with at least this many bytes to exchange meet (a ``Barrier``) just before the
#: exchange: 7.45 MB between 2 hosts x 2 ranks (``make bench-network``, MPICH, 1 Gbit/s TCP)
#: then took 64 ms, the link's time, not 92 ms; the meeting costs one small round trip.
MEET_BYTES = 1 << 20


def _sleep_for(last_wait: float) -> float:
    """The longest sleep of the next wait after one of ``last_wait`` seconds (0: poll)."""
    s = SLEEP_SHARE * last_wait
    return 0.0 if s < SHORTEST_SLEEP else min(s, LONGEST_SLEEP)


class NodeAllreduce:
    """Sum a 1-D buffer ``(n,)`` over ``comm`` in place: the node's sum in shared memory on its leader,
    an ``Allreduce`` among the leaders, the result copied out by the others. Collective to create
    (``MemoryError`` on every rank when some node lacks shared memory); write the values into
    :attr:`array`, then :meth:`allreduce` (collective)."""

    def __init__(self, comm: Comm, n: int, dtype: np.dtype) -> None:
        dtype = np.dtype(dtype)
        self.nodes, self.most_per_node = node_layout(comm)
        self.node, self.leaders = node_split(comm)
        if allreduce_max(comm, [not shm_room(self.node.size * n * dtype.itemsize)])[0]:
            raise MemoryError(f"not enough shared memory for {self.node.size} x "
                              f"{n * dtype.itemsize / 2**20:.1f} MiB on some node")
        self._sum = SharedReduce(self.node, n, dtype, root=0)
        self.array = self._sum.array
        self.leads = self.leaders is not None and self.leaders.size > 1  # sends over MPI
        self.meets = self.leads and n * dtype.itemsize >= MEET_BYTES
        self._leader_array = self._sum.array_of(0)
        self._sleep = (0.0, 0.0)  # longest sleeps waiting for the node, for the leader
        self.exchange_s = 0.0  #: seconds of the last allreduce's exchange between leaders (0 off them)

    def free(self) -> None:
        """Release the shared-memory window (:attr:`array` with it). Collective; idempotent."""
        self._sum.free()

    def describe(self) -> str:
        """One line for people: the layout this reduction works on."""
        return (f"node-aware reduction: {self.nodes} node(s), up to {self.most_per_node} "
                "ranks each (summed in shared memory; node leaders exchange)")

    @watched("a node-aware allreduce")
    def allreduce(self) -> np.ndarray:
        """Make :attr:`array` hold the sum over every rank of ``comm``. Collective."""
        start = time.perf_counter()
        self._sum.reduce(self._sleep[0])  # the node's sum in the leader's array
        t = time.perf_counter()
        waited = t - start
        if self.meets:
            self.leaders.Barrier()  # see MEET_BYTES
        if self.leads:
            allreduce_sum_(self.leaders, self._leader_array)
        self.exchange_s = time.perf_counter() - t if self.leads else 0.0
        t = time.perf_counter()
        self._sum.fence(self._sleep[1])  # the leader's array holds the global sum
        self._sleep = (_sleep_for(waited), _sleep_for(time.perf_counter() - t))
        if self.node.rank != 0:
            self.array[...] = self._leader_array
        self._sum.fence()  # nobody reads the leader's array any more
        return self.array
