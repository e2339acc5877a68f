"""How replicas combine gradients: one strategy object per way, behind ``make_sync(name)``.

Every strategy turns each rank's gradient SUMS (plus loss sum, sample count and correct
count, appended to the same flat buffer) into an update that leaves all replicas equal.
``bytes_sent`` counts the payload this rank contributes to MPI per step (a buffer of
``m`` bytes reduced or gathered counts ``m``; on the wire a ring allreduce sends
``2 (P-1)/P m``, as do a reduce-scatter plus an allgather).
"""

from __future__ import annotations

import math
import sys
from typing import Protocol

import numpy as np

from .. import comm as C
from .. import compress
from ..metrics import StepTimer
from ..nn import Optimizer, Sequential
from ..nn.optim import chunk_edges
from ..nonfinite import Policy, all_finite
from . import buffer


class Replica(Protocol):
    """What a strategy uses of the data-parallel trainer (:class:`~.Replica`)."""

    comm: C.Comm
    root: int
    buf: np.ndarray  # gradients | loss | count | correct (mpidp.parallel.buffer)
    model: Sequential
    optimizer: Optimizer
    timer: StepTimer
    policy: Policy
    global_step: int
    last_of_epoch: bool

    def apply_global(self, buf: np.ndarray) -> tuple[float, int, int, bool]: ...

    def judge_global(self, buf: np.ndarray, everywhere: bool = True) -> tuple[float, int, int, bool]: ...

    def finite_or_skip(self, finite: bool, loss_sum: float) -> bool: ...

SYNCS = ("allreduce", "per-layer", "overlapped", "compressed", "ps", "sharded-ps",
         "accumulate", "local-sgd")


class Sync:
    """Fused allreduce: ONE in-place ``Allreduce`` of the whole buffer, then the same update
    on every rank. The default, and the base of the others."""

    name = "allreduce"

    def __init__(self) -> None:
        self.bytes_sent = 0

    def setup(self, dp: Replica) -> None:
        """Called once by ``DataParallel`` after its buffers exist. Collective."""

    def on_layer_done(self, dp: Replica):
        """A backward hook (``Sequential.backward(on_layer_done=...)``), or None."""
        return None

    def reduce(self, dp: Replica) -> None:
        """Make ``dp.buf`` hold the global sums on every rank."""
        buf = dp.buf
        C.allreduce_sum_(dp.comm, buf)
        self.bytes_sent += buf.nbytes

    def at_boundary(self) -> bool:
        """True when nothing is pending between synchronisations (a checkpoint may be taken)."""
        return True

    def accumulating(self) -> bool:
        """True when this step's backward must ADD to the gradient sums already in the buffer
        (and its loss and counts to theirs) instead of overwriting them."""
        return False

    def before_checkpoint(self, dp: Replica) -> None:
        """Collective, before the root writes a checkpoint: make ``dp.optimizer`` hold the
        whole optimizer state on the root (a strategy that shards it gathers it here)."""

    def after_checkpoint(self, dp: Replica) -> None:
        """After the checkpoint is written (every rank)."""

    def after_restore(self, dp: Replica) -> None:
        """After :func:`mpidp.checkpoint.restore` filled ``dp.optimizer`` on every rank."""

    def exchange(self, dp: Replica) -> tuple[float, int, int, bool]:
        """Communicate and update; returns the global ``(loss_sum, count, correct, skipped)``."""
        with dp.timer.communicate():
            self.reduce(dp)
        with dp.timer.compute():
            return dp.apply_global(dp.buf)


class PerLayer(Sync):
    """One ``Allreduce`` per parameter array (and one for the loss and counts): the naive
    way, for comparison — more messages, each paying the latency."""

    name = "per-layer"

    def reduce(self, dp: Replica) -> None:
        n = dp.model.n_params
        for layer in dp.model.layers:
            for g in layer.grads.values():
                C.allreduce_sum_(dp.comm, g)
        C.allreduce_sum_(dp.comm, dp.buf[n:])
        self.bytes_sent += dp.buf.nbytes


class Overlapped(Sync):
    """Bucketed non-blocking ``Iallreduce``s started during backward, as soon as a bucket's
    layers are done (last layers first); all are completed before the update.

    Whether communication really overlaps computation depends on the MPI library making
    progress in the background: MPICH does so only inside MPI calls unless its progress
    thread is enabled (``MPIR_CVAR_ASYNC_PROGRESS=1``); ``make bench-sync`` measures both.
    """

    name = "overlapped"

    def __init__(self, bucket_bytes: int = 1 << 20) -> None:
        super().__init__()
        if bucket_bytes <= 0:
            raise C.MpidpError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
        self.bucket_bytes = int(bucket_bytes)

    def setup(self, dp: Replica) -> None:
        # buckets of whole layers, from the last layer back; the first one also carries the
        # loss and counts at the end of the buffer (known before backward starts)
        self.buckets: list[tuple[int, int]] = []  # (first layer, hi) in buffer order
        self.starts: dict[int, tuple[int, int]] = {}  # layer index -> (lo, hi) to launch
        hi, size = dp.buf.size, 0
        ranges = dp.model.layer_ranges
        for i in range(len(ranges) - 1, -1, -1):
            size += (ranges[i][1] - ranges[i][0]) * dp.buf.itemsize
            if size >= self.bucket_bytes or i == 0:
                self.starts[i] = (ranges[i][0], hi)
                hi, size = ranges[i][0], 0
        self.requests: list = []

    def on_layer_done(self, dp: Replica):
        def launch(i: int) -> None:
            if i in self.starts:
                lo, hi = self.starts[i]
                self.requests.append(C.iallreduce_sum_(dp.comm, dp.buf[lo:hi]))
        return launch

    def reduce(self, dp: Replica) -> None:
        C.wait_all(self.requests)
        self.requests = []
        self.bytes_sent += dp.buf.nbytes


class Compressed(Sync):
    """Gradients sent in 16 bits (``float16`` or ``bfloat16``) with error feedback: what
    rounding lost this step is added back next step. Half the gradient bytes per rank.

    The 16-bit codes are ``Allgather``ed and every rank decodes and adds them in rank order
    in float32, so all replicas get the same sum (and no 16-bit rounding of partial sums).
    A value beyond float16's 65504 is detected on every rank and raised, never turned
    into Inf.
    """

    name = "compressed"

    def __init__(self, codec: str = "bfloat16", error_feedback: bool = True) -> None:
        super().__init__()
        if codec not in compress.CODECS:
            raise C.MpidpError(f"unknown compression {codec!r}; expected one of {compress.CODECS}")
        self.codec, self.error_feedback = codec, error_feedback

    def setup(self, dp: Replica) -> None:
        n = dp.model.n_params
        # what rounding lost: the residual in use and the next one, kept apart so that a
        # skipped (non-finite) step leaves the residual as it was instead of poisoning it
        self.residual, self._next = np.zeros(n, np.float32), np.zeros(n, np.float32)
        self.gathered = np.empty((dp.comm.size, n), np.uint16)

    def exchange(self, dp: Replica) -> tuple[float, int, int, bool]:
        out = super().exchange(dp)
        if self.error_feedback and not out[3]:  # the step was applied: its residual counts
            self.residual, self._next = self._next, self.residual
        return out

    def reduce(self, dp: Replica) -> None:
        n, g = dp.model.n_params, dp.model.grads
        target = np.add(g, self.residual, out=self._next) if self.error_feedback \
            else g.astype(np.float32)
        big = float(np.max(np.abs(target), initial=0))
        overflow = self.codec == "float16" and not big <= compress.FLOAT16_MAX  # NaN: policy
        codes = compress.encode(target, self.codec)
        if self.error_feedback:
            target -= compress.decode(codes, self.codec)
        extras = np.append(dp.buf[n:].astype(np.float64), float(overflow and np.isfinite(big)))
        C.allgather_(dp.comm, codes, self.gathered.reshape(-1))
        C.allreduce_sum_(dp.comm, extras)
        if extras[-1]:
            raise C.MpidpError(
                f"float16 gradient compression overflowed at step {dp.global_step}: a gradient "
                f"exceeds {compress.FLOAT16_MAX:g}; use bfloat16 or no compression")
        total = compress.decode(self.gathered[0], self.codec)
        for codes_r in self.gathered[1:]:
            total += compress.decode(codes_r, self.codec)
        g[...] = total
        dp.buf[n:] = extras[:-1]
        self.bytes_sent += codes.nbytes + extras.nbytes


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
        with dp.timer.communicate():
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
        with dp.timer.communicate():
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
                with dp.timer.communicate():
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
            with dp.timer.communicate():
                C.wait_all(sent)
                shared.finish()
        elif self.leaders is not None:  # another node's leader: relay each piece
            with dp.timer.communicate():
                for lo, hi in pieces:
                    C.wait_all([self.leaders.Ibcast(params[lo:hi], root=0)])
                    shared.publish()
                shared.finish()
        else:
            with dp.timer.communicate():
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
        with dp.timer.communicate():
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
            with dp.timer.communicate():
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


class _Periodic(Sync):
    """A strategy that synchronises every ``k`` steps and at the end of each epoch."""

    what = "synchronisation period"

    def __init__(self, k: int) -> None:
        super().__init__()
        if k < 1:
            raise C.MpidpError(f"{self.what} must be >= 1, got {k}")
        self.k, self.pending = int(k), 0

    def at_boundary(self) -> bool:
        return self.pending == 0

    def due(self, dp: Replica) -> bool:
        """Count this step; True (and restart the count) when it is time to synchronise."""
        self.pending += 1
        if self.pending < self.k and not dp.last_of_epoch:
            return False
        self.pending = 0
        return True


class Accumulate(_Periodic):
    """Gradient accumulation: sum gradients over ``k`` global batches locally, then ONE
    ``Allreduce`` and one update — exactly training with global batch ``k * B`` (a group
    is cut short at an epoch's end). ``1/k`` of the synchronisations.

    Backward adds each batch's gradients into the buffer it reduces (BLAS ``gemm`` with
    ``beta = 1`` where SciPy is installed), so accumulating costs no pass of its own."""

    name, what = "accumulate", "accumulation steps"

    def accumulating(self) -> bool:
        return self.pending > 0  # the first batch of a group overwrites the last group's sums

    def exchange(self, dp: Replica) -> tuple[float, int, int, bool]:
        if not self.due(dp):
            return 0.0, 0, 0, False  # no communication; totals arrive with the group
        return super().exchange(dp)


class LocalSGD(_Periodic):
    """Local SGD: each rank updates from its own part of the batch, and every ``k`` steps
    (and at each epoch's end) the parameters are averaged with one ``Allreduce``.

    Not the single-process arithmetic: replicas drift between averages and optimizer state
    stays per rank; the benchmark measures the accuracy this costs.
    """

    name, what = "local-sgd", "local SGD period"

    def setup(self, dp: Replica) -> None:
        # loss, count, correct and non-finite steps of this rank since the last average
        self.totals = np.zeros(4, np.float64)
        self.avg = np.zeros(dp.model.n_params + 4, dp.model.dtype)

    def exchange(self, dp: Replica) -> tuple[float, int, int, bool]:
        n = dp.model.n_params
        with dp.timer.compute():
            loss, count, correct = buffer.totals(dp.buf, n)
            finite = not dp.policy.checks or all_finite(dp.buf)
            if count and (finite or dp.policy.mode == "ignore"):  # a bad step stays local
                dp.optimizer.step_(dp.model.params, dp.model.grads, scale=1.0 / count)
            if finite:
                self.totals[:3] += (loss, count, correct)
            else:
                self.totals[3] += 1
        if not self.due(dp):
            return 0.0, 0, 0, False
        with dp.timer.communicate():
            self.avg[:n], self.avg[n:] = dp.model.params, self.totals
            C.allreduce_sum_(dp.comm, self.avg)
        loss, count, correct, bad = (float(v) for v in self.avg[n:])
        self.totals[...] = 0
        if bad and dp.policy.mode == "stop":  # before averaging: parameters stay as they were
            raise dp.policy.error(float("nan"), dp.global_step)
        dp.policy.skipped += int(bad) if dp.policy.mode == "skip" else 0
        np.divide(self.avg[:n], dp.comm.size, out=dp.model.params)
        self.bytes_sent += self.avg.nbytes
        return loss, int(round(count)), int(round(correct)), False


def make_sync(name: str, optimizer_factory=None, bucket_bytes: int = 1 << 20,
              codec: str = "bfloat16", dedicated: bool = False, k: int = 4,
              ps_shared_memory: bool = True, ps_chunk_bytes: int = 1 << 20) -> Sync:
    """A strategy by name: ``allreduce`` (fused), ``per-layer``, ``overlapped`` (bucketed
    ``Iallreduce`` during backward), ``compressed`` (16-bit, error feedback), ``ps``
    (``dedicated`` server or not; through shared memory within nodes unless
    ``ps_shared_memory=False``; updates shipped in pieces of ``ps_chunk_bytes``),
    ``sharded-ps`` (needs ``optimizer_factory``),
    ``accumulate`` and ``local-sgd`` (every ``k`` steps)."""
    if name == "allreduce":
        return Sync()
    if name == "per-layer":
        return PerLayer()
    if name == "overlapped":
        return Overlapped(bucket_bytes)
    if name == "compressed":
        return Compressed(codec)
    if name == "ps":
        return ParameterServer(dedicated, shared_memory=ps_shared_memory, chunk_bytes=ps_chunk_bytes)
    if name == "accumulate":
        return Accumulate(k)
    if name == "local-sgd":
        return LocalSGD(k)
    if name == "sharded-ps":
        if optimizer_factory is None:
            raise C.MpidpError("sharded-ps needs an optimizer factory (one optimizer per slice)")
        return ShardedParameterServer(optimizer_factory)
    raise C.MpidpError(f"unknown sync mode {name!r}; expected one of {SYNCS}")
