"""How replicas combine gradients: one strategy object per way, behind ``make_sync(name)``.

Every strategy turns each rank's gradient SUMS (plus loss sum, sample count and correct
count, appended to the same flat buffer) into an update that leaves all replicas equal.
``bytes_sent`` counts the payload this rank contributes to MPI per step (a buffer of
``m`` bytes reduced or gathered counts ``m``; on the wire a ring allreduce sends
``2 (P-1)/P m``, as do a reduce-scatter plus an allgather).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from .. import comm as C
from ..nn import Optimizer, Sequential
from ..observe.metrics import StepTimer
from ..run.nonfinite import Policy, all_finite
from . import buffer, compress


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
        """After :func:`mpidp.run.checkpoint.restore` filled ``dp.optimizer`` on every rank."""

    def exchange(self, dp: Replica) -> tuple[float, int, int, bool]:
        """Communicate and update; returns the global ``(loss_sum, count, correct, skipped)``."""
        with dp.timer.communicate(self.name, bytes=int(dp.buf.nbytes)):
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
        with dp.timer.communicate(self.name, bytes=int(dp.buf.nbytes)):
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
