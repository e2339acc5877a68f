"""Node-aware allreduce: sum inside each node through shared memory, across nodes between
node leaders only, then copy back inside each node.

With ``H`` nodes the leaders' allreduce moves ``2 (H-1)/H m`` bytes of an ``m``-byte buffer
over each node's link each way, the least any allreduce can (a flat ring placed by node:
``2 (P-1)/P m``). Each element is summed in a fixed order (the node's ranks in order, then
MPI's reduction over the leaders), so every replica gets the same values.
"""

from __future__ import annotations

import time

import numpy as np

from .collectives import allreduce_, allreduce_sum_
from .runtime import Comm, _node, node_split, watched
from .shm import SharedReduce, shm_room


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
    """Sum a 1-D buffer ``(n,)`` over ``comm`` in place: the node's sum formed in shared
    memory on its leader (each node rank adds up ``1/k`` of the elements), an ``Allreduce``
    among the leaders (meeting first from :data:`MEET_BYTES`), and the result copied out of
    the leader's memory by the others.

    Collective to create; raises ``MemoryError`` on every rank when some node's
    shared-memory folder has no room. :attr:`array` is this rank's buffer in the window:
    write the values there, then call :meth:`allreduce` (collective). :attr:`exchange_s`:
    the seconds of the last meeting and exchange between leaders (0 off the leaders)."""

    def __init__(self, comm: Comm, n: int, dtype: np.dtype) -> None:
        dtype = np.dtype(dtype)
        self.nodes, self.most_per_node = node_layout(comm)
        self.node, self.leaders = node_split(comm)
        short = np.array([not shm_room(self.node.size * n * dtype.itemsize)], np.float64)
        allreduce_(comm, short, "max")
        if short[0]:
            raise MemoryError(f"not enough shared memory for {self.node.size} x "
                              f"{n * dtype.itemsize / 2**20:.1f} MiB on some node")
        self._sum = SharedReduce(self.node, n, dtype, root=0)
        self.array = self._sum.array
        self.leads = self.leaders is not None and self.leaders.size > 1  # sends over MPI
        self.meets = self.leads and n * dtype.itemsize >= MEET_BYTES
        self._leader_array = self._sum.array_of(0)
        self._sleep = (0.0, 0.0)  # longest sleeps waiting for the node, for the leader
        self.exchange_s = 0.0  # seconds of the last allreduce's exchange between leaders

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
