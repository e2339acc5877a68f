"""Synchronous parameter servers, as gradient-exchange strategies of
:class:`~mpidp.DataParallel`: :class:`ParameterServer` (one server, rank ``root``) and
:class:`ShardedParameterServer` (every rank serves ``1/P`` of the parameters)."""

from __future__ import annotations

import math
import sys

import numpy as np

from .. import comm as C
from ..nn import Optimizer
from ..nn.optim import Segments, chunk_edges
from ..run.nonfinite import all_finite
from . import buffer
from .sync import Buffers, Exchanged, Round, Setup, Sync, global_sums


class ParameterServer(Sync):
    """Synchronous parameter server: gradient sums are reduced to the server (rank ``root``), which
    steps and broadcasts the parameters (allreduce's arithmetic). ``shared_memory``: a node's ranks
    sum into, and copy the parameters out of, their leader's shared memory, shipped in pieces of
    ``chunk_bytes`` as each is final."""

    name = "ps"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.shared: C.SharedBroadcast | None = None
        self.gather: C.SharedReduce | None = None
        self.leaders: C.Comm | None = None

    def setup(self, s: Setup) -> Buffers:
        if s.comm.size < 2:
            raise C.MpidpError("a parameter server needs at least 2 ranks (a server and a worker)")
        out = super().setup(s)
        if not self.shared_memory:
            return out
        params = s.model.params
        node, leaders = C.node_split(s.comm, s.root)
        need = node.size * self.buf.nbytes + params.nbytes  # this node's windows
        crowded, no_room = C.allreduce_max(s.comm, [node.size, not C.shm_room(need)])
        if crowded == 1 or no_room:  # one rank per node (nothing to share), or no room
            if no_room and s.comm.rank == 0:
                print(f"mpidp: ps: not enough free space in {C.SHM_DIR} for {need / 2**20:.0f} "
                      "MiB of shared windows on some node; using MPI instead", file=sys.stderr)
            return out
        self.shared = C.SharedBroadcast(node, params.size, params.dtype, 0)
        self.gather = C.SharedReduce(node, self.buf.size, self.buf.dtype, 0)
        self.buf = self.gather.array
        self.buf[...] = 0
        self.leaders = leaders if leaders is not None and leaders.size > 1 else None
        self.edges = chunk_edges(params.size, -(-params.nbytes // self.chunk_bytes))
        # the node leader's parameters are what its node copies
        return Buffers(self.buf, self.shared.array if node.rank == 0 else None)

    def free(self) -> None:
        if self.shared is not None:
            self.shared.finish()
            self.shared.free()
            self.gather.free()
            self.shared = self.gather = None
        super().free()

    def exchange(self, r: Round) -> Exchanged:
        comm, root, buf, n = self.comm, self.root, self.buf, self.n
        verdict = np.zeros(buffer.N_EXTRA + 1, np.float64)  # the extras, the server's verdict
        with self.timer.communicate(self.name, bytes=int(buf.nbytes)):
            if self.gather is None:
                C.reduce_sum_to_(comm, buf, root)
            else:
                self.gather.reduce()  # each node's sum on its leader
                if self.leaders is not None:
                    C.reduce_sum_to_(self.leaders, buf, 0)  # the server leads leaders
        if comm.rank == root:
            with self.timer.compute():  # only the server holds the sums: it checks them all
                verdict[...] = (*buf[n:], not r.checks or all_finite(buf))
        with self.timer.communicate(self.name, bytes=int(verdict.nbytes)):
            C.bcast_(comm, verdict, root)
        out = global_sums(verdict, 0)
        out.finite = bool(verdict[-1])
        # what this rank contributes: a worker its gradients, the server the parameters
        self.bytes_sent += buf.nbytes if comm.rank != root else self.model.params.nbytes
        return out

    def update(self, optimizer: Optimizer, count: int) -> None:
        """The server steps; the parameters go back to every rank (with shared memory, piece
        by piece as each is final, to the node leaders and on to their nodes). Collective."""
        comm, root, params, shared, sent = self.comm, self.root, self.model.params, self.shared, []

        def ship(lo: int, hi: int) -> None:
            if self.leaders is not None:
                sent.extend(C.ibcast_(self.leaders, params[lo:hi], 0))
            shared.publish()

        if comm.rank != root:
            optimizer.t += 1  # the server's count, so every rank knows the rate in use
        else:
            pieces = {} if shared is None else {"chunks": len(self.edges) - 1, "on_chunk": ship}
            with self.timer.compute():
                optimizer.step_(params, self.buf[:self.n], scale=1.0 / count, **pieces)
        with self.timer.communicate(self.name):
            if shared is None:
                C.bcast_(comm, params, root)
            elif comm.rank == root:
                C.wait_all(sent)
                shared.finish()
            elif self.leaders is not None:  # another node's leader: relay each piece
                for lo, hi in zip(self.edges[:-1], self.edges[1:]):
                    C.wait_all(C.ibcast_(self.leaders, params[lo:hi], 0))
                    shared.publish()
                shared.finish()
            else:
                shared.pull(params, self.edges)


class ShardedParameterServer(Sync):
    """Every rank serves ``1/P`` of the parameters: ``Reduce_scatter`` the gradient sums, each rank
    steps its slice (its own optimizer state), ``Allgather`` the slices; a small ``Allreduce``
    carries the extras and verdicts. Checkpoints gather the sliced state."""

    name = "sharded-ps"

    def __init__(self, make_optimizer) -> None:
        super().__init__()
        self.make_optimizer = make_optimizer  # () -> a fresh Optimizer for one slice

    @classmethod
    def of(cls, settings, optimizer_factory=None) -> ShardedParameterServer:
        if optimizer_factory is None:
            raise C.MpidpError("sharded-ps needs an optimizer factory (one optimizer per slice)")
        return cls(optimizer_factory)

    def allocate(self, s: Setup) -> np.ndarray:
        size = s.model.n_params + buffer.N_EXTRA
        self.k = -(-size // s.comm.size)  # block length: the gradients and the extras, padded
        self.grads = buffer.new(s.model.n_params, s.model.dtype, self.k * s.comm.size)
        return self.grads[:size]

    def setup(self, s: Setup) -> Buffers:
        out = super().setup(s)
        P, n, rank = s.comm.size, self.n, s.comm.rank
        self.params = np.zeros(self.k * P, s.model.dtype)
        self.lo = rank * self.k
        self.hi = max(self.lo, min(self.lo + self.k, n))  # the padding past n is never updated
        # one rank reduces nothing: its block of the sums is the buffer itself
        self.slice = self.grads if P == 1 else np.zeros(self.k, s.model.dtype)
        self.optimizer: Optimizer = self.make_optimizer()
        comm = s.comm  # whole tensors' norms: this block's partials summed over the blocks
        self.optimizer.place(Segments.of(s.model), min(self.lo, n),
                             None if P == 1 else lambda a: C.allreduce_sum_(comm, a))
        return Buffers(out.grads, self.params[:n])

    def exchange(self, r: Round) -> Exchanged:
        n, m, comm = self.n, self.hi - self.lo, self.comm
        with self.timer.communicate(self.name, bytes=int(self.buf.nbytes)):
            if comm.size > 1:
                C.reduce_scatter_sum(comm, self.grads, self.slice)
            # the extras, then whether this slice holds NaN/Inf (summed: how many slices do)
            extras = np.array([*self.buf[n:], r.checks and not all_finite(self.slice[:m])],
                              np.float64)
            C.allreduce_sum_(comm, extras)
        out = global_sums(extras, 0)
        out.finite = math.isfinite(out.loss_sum) and not extras[-1]
        # the reduce-scatter and allgather together move what one ring allreduce moves
        self.bytes_sent += self.grads.nbytes + extras.nbytes
        return out

    def update(self, optimizer: Optimizer, count: int) -> None:
        """Each rank steps its slice, then the slices are gathered in place. Collective."""
        with self.timer.compute():
            self.optimizer.lr_scale = optimizer.lr_scale  # a controller sets the trainer's
            self.optimizer.step_(self.params[self.lo:self.hi], self.slice[:self.hi - self.lo],
                                 scale=1.0 / count)
            optimizer.t, optimizer.last_grad_norm = self.optimizer.t, self.optimizer.last_grad_norm
        if self.comm.size > 1:
            with self.timer.communicate(self.name):
                C.allgather_in_place(self.comm, self.params)

    def before_checkpoint(self, optimizer: Optimizer) -> None:
        gathered = {k: C.gatherv(self.comm, v, self.root) for k, v in self.optimizer.state.items()}
        if self.comm.rank == self.root:
            optimizer.state, optimizer.t = gathered, self.optimizer.t

    def after_checkpoint(self, optimizer: Optimizer) -> None:
        optimizer.state = {}  # the whole state was only lent to the checkpoint writer

    def after_restore(self, optimizer: Optimizer) -> None:
        # idempotent: DataParallel.restore hands the state over, and fit may again
        if optimizer.state:
            self.optimizer.state = {k: v[self.lo:self.hi].copy()
                                    for k, v in optimizer.state.items()}
        self.optimizer.t = optimizer.t
        optimizer.state = {}
