"""Synchronous parameter servers, as gradient-exchange strategies of :class:`~mpidp.DataParallel`:
gradients go to a server that applies the update, parameters come back.

:class:`ParameterServer` (one central server, rank ``root``, optionally holding no data)
and :class:`ShardedParameterServer` (every rank serves ``1/P`` of the parameters). The
asynchronous server is :mod:`mpidp.parallel.async_ps`.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from .. import comm as C
from ..nn import Optimizer
from ..nn.optim import chunk_edges
from ..run.nonfinite import all_finite
from .sync import Replica, Sync


class ParameterServer(Sync):
    """Synchronous parameter server: gradient sums are reduced to the server (rank
    ``root``), which applies the optimizer and broadcasts the new parameters.

    ``dedicated=True``: the server holds no data (give it an empty shard); otherwise it
    computes like every worker. Same arithmetic as allreduce training.

    ``shared_memory=True`` (the default), where some node runs several ranks: within each
    node, gradients and the node leader's parameters live in MPI shared-memory windows.
    Each rank sums its share of the node's gradients straight into its leader's buffer
    (:class:`mpidp.comm.SharedReduce`); the leaders' sums go to the server (the leader of
    its node) by ``Reduce_scatter`` + ``Gatherv``. The server updates in pieces of
    ``chunk_bytes`` and ships each piece as soon as it is final: ``Ibcast`` to the other
    leaders, and to the ranks of each node by letting them copy it out of their leader's
    memory (:class:`mpidp.comm.SharedBroadcast`), so copying overlaps the update instead of
    following it. Otherwise (``shared_memory=False``, or one rank per node) the sums go to
    the server by ``Reduce_scatter`` + ``Gatherv`` and the parameters come back by ``Bcast``.
    """

    name = "ps"

    def __init__(self, dedicated: bool = False, shared_memory: bool = True,
                 chunk_bytes: int = 1 << 20) -> None:
        super().__init__()
        if chunk_bytes < 1:
            raise C.MpidpError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.dedicated, self.shared_memory, self.chunk_bytes = dedicated, shared_memory, chunk_bytes
        self.shared: C.SharedBroadcast | None = None
        self.gather: C.SharedReduce | None = None
        self.leaders: C.Comm | None = None

    def setup(self, dp: Replica) -> None:
        comm, params = dp.comm, dp.model.params
        if comm.size < 2:
            raise C.MpidpError("a parameter server needs at least 2 ranks (a server and a worker)")
        if not self.shared_memory:
            return
        node, leaders = C.node_split(comm, dp.root)
        need = node.size * dp.buf.nbytes + params.nbytes  # this node's windows
        crowded, no_room = C.allreduce_max(comm, [node.size, not C.shm_room(need)])
        if crowded == 1 or no_room:  # one rank per node (nothing to share), or no room
            if no_room and comm.rank == 0:
                print(f"mpidp: ps: not enough free space in {C.SHM_DIR} for {need / 2**20:.0f} "
                      "MiB of shared windows on some node; using MPI instead", file=sys.stderr)
            return
        self.shared = C.SharedBroadcast(node, params.size, params.dtype, 0)
        if node.rank == 0:  # the node leader's parameters are what its node copies
            dp.model.use_param_buffer(self.shared.array)
        self.gather = C.SharedReduce(node, dp.buf.size, dp.buf.dtype, 0)
        self.gather.array[...] = dp.buf
        dp.buf = self.gather.array
        dp.model.use_grad_buffer(dp.buf)
        self.leaders = leaders if leaders is not None and leaders.size > 1 else None
        self.edges = chunk_edges(params.size, -(-params.nbytes // self.chunk_bytes))

    def exchange(self, dp: Replica) -> tuple[float, int, int, bool]:
        comm, root, buf, n = dp.comm, dp.root, dp.buf, dp.model.n_params
        verdict = np.zeros(5, np.float64)  # loss, count, correct, skipped, error
        with dp.timer.communicate(self.name, bytes=int(dp.buf.nbytes)):
            if self.gather is None:
                C.reduce_sum_to_(comm, buf, root)
            else:
                self.gather.reduce()  # each node's sum on its leader
                if self.leaders is not None:
                    C.reduce_sum_to_(self.leaders, buf, 0)  # the server leads leaders
        if comm.rank == root:
            with dp.timer.compute():
                try:
                    verdict[:4] = dp.judge_global(buf, everywhere=False)
                except C.MpidpError:
                    verdict[:3], verdict[4] = buf[n:], 1
        with dp.timer.communicate(self.name, bytes=int(dp.buf.nbytes)):
            C.bcast_(comm, verdict, root)
            if verdict[4]:
                raise dp.policy.error(verdict[0], dp.global_step)
            if verdict[3] and comm.rank != root:
                dp.policy.skipped += 1
        count = int(verdict[1])
        if count and not verdict[3]:  # otherwise the parameters stay as they are everywhere
            if self.shared is None:
                if comm.rank == root:
                    with dp.timer.compute():
                        dp.optimizer.step_(dp.model.params, buf[:n], scale=1.0 / count)
                with dp.timer.communicate(self.name):
                    C.bcast_(comm, dp.model.params, root)
            else:
                self._update_and_ship(dp, buf[:n], count)
        # what this rank contributes: a worker its gradients, the server the parameters
        self.bytes_sent += buf.nbytes if comm.rank != root else dp.model.params.nbytes
        return float(verdict[0]), count, int(verdict[2]), bool(verdict[3])

    def _update_and_ship(self, dp: Replica, grads: np.ndarray, count: int) -> None:
        """The server updates piece by piece; each piece goes to the other node leaders
        (``Ibcast``) and to the ranks of each node (copied out of the leader's memory)."""
        params, shared, sent = dp.model.params, self.shared, []
        pieces = list(zip(self.edges[:-1], self.edges[1:]))

        def ship(lo: int, hi: int) -> None:
            if self.leaders is not None:
                sent.append(self.leaders.Ibcast(params[lo:hi], root=0))
            shared.publish()

        if dp.comm.rank == dp.root:
            with dp.timer.compute():
                dp.optimizer.step_(params, grads, scale=1.0 / count, chunks=len(pieces),
                                   on_chunk=ship)
            with dp.timer.communicate(self.name):
                C.wait_all(sent)
                shared.finish()
        elif self.leaders is not None:  # another node's leader: relay each piece
            with dp.timer.communicate(self.name):
                for lo, hi in pieces:
                    C.wait_all([self.leaders.Ibcast(params[lo:hi], root=0)])
                    shared.publish()
                shared.finish()
        else:
            with dp.timer.communicate(self.name):
                shared.pull(params, self.edges)


class ShardedParameterServer(Sync):
    """Every rank serves ``1/P`` of the parameters: ``Reduce_scatter`` the gradient sums, each
    rank updates only its slice (so optimizer state and update work are divided by ``P``),
    ``Allgather`` the slices. Same bytes as an allreduce.

    The gradient and parameter buffers are padded to ``P`` equal blocks, so the reduce-scatter
    reads the gradients where backward wrote them, the update runs in place on this rank's
    block of the parameters and the allgather fills the others in place: no copies. One
    more ``Allreduce`` of four numbers carries the loss and counts and each slice's NaN/Inf
    verdict. Checkpoints gather the sliced optimizer state to the root
    (:meth:`before_checkpoint`) and a resumed run slices it again (:meth:`after_restore`).
    """

    name = "sharded-ps"

    def __init__(self, make_optimizer) -> None:
        super().__init__()
        self.make_optimizer = make_optimizer  # () -> a fresh Optimizer for one slice

    def setup(self, dp: Replica) -> None:
        P, n, model = dp.comm.size, dp.model.n_params, dp.model
        self.k = -(-dp.buf.size // P)  # block length: the gradients and the extras, padded
        self.grads = np.zeros(self.k * P, model.dtype)
        self.grads[:dp.buf.size] = dp.buf
        dp.buf = self.grads[:dp.buf.size]
        model.use_grad_buffer(dp.buf)
        self.params = np.zeros(self.k * P, model.dtype)
        model.use_param_buffer(self.params[:n])
        self.lo = dp.comm.rank * self.k
        self.hi = max(self.lo, min(self.lo + self.k, n))  # the padding past n is never updated
        # one rank reduces nothing: its block of the sums is the buffer itself
        self.slice = self.grads if P == 1 else np.zeros(self.k, model.dtype)
        self.optimizer: Optimizer = self.make_optimizer()

    def exchange(self, dp: Replica) -> tuple[float, int, int, bool]:
        n, m, comm = dp.model.n_params, self.hi - self.lo, dp.comm
        extras = np.zeros(4, np.float64)  # loss, count, correct, slices with NaN/Inf
        with dp.timer.communicate(self.name, bytes=int(dp.buf.nbytes)):
            if comm.size > 1:
                C.reduce_scatter_sum(comm, self.grads, self.slice)
            extras[:3] = dp.buf[n:]
            extras[3] = dp.on_nonfinite != "ignore" and not all_finite(self.slice[:m])
            C.allreduce_sum_(comm, extras)  # every rank learns every slice's verdict
        with dp.timer.compute():
            count = int(round(extras[1]))
            finite = math.isfinite(extras[0]) and not extras[3]
            skipped = bool(count) and not dp.finite_or_skip(finite, extras[0])
            if count and not skipped:
                self.optimizer.step_(self.params[self.lo:self.hi], self.slice[:m],
                                     scale=1.0 / count)
        if count and not skipped and comm.size > 1:
            with dp.timer.communicate(self.name):
                C.allgather_in_place(comm, self.params)
        # the reduce-scatter and allgather together move what one ring allreduce moves
        self.bytes_sent += self.grads.nbytes + extras.nbytes
        return float(extras[0]), count, int(round(extras[2])), skipped

    def before_checkpoint(self, dp: Replica) -> None:
        gathered = {k: C.gatherv(dp.comm, v, dp.root) for k, v in self.optimizer.state.items()}
        if dp.comm.rank == dp.root:
            dp.optimizer.state, dp.optimizer.t = gathered, self.optimizer.t

    def after_checkpoint(self, dp: Replica) -> None:
        dp.optimizer.state = {}  # the whole state was only lent to the checkpoint writer

    def after_restore(self, dp: Replica) -> None:
        self.optimizer.state = {k: v[self.lo:self.hi].copy() for k, v in dp.optimizer.state.items()}
        self.optimizer.t = dp.optimizer.t
        dp.optimizer.state = {}
