"""How replicas combine gradients: one strategy object per way, behind ``make_sync(name)``.

A strategy turns each rank's gradient SUMS (plus the extras of :mod:`.buffer`) into global
sums: ``setup(Setup)`` allocates its :class:`Buffers`, ``exchange(Round)`` communicates and
returns an :class:`Exchanged`, and the trainer, unless its NaN policy drops the step, calls
``update(optimizer, count)``. ``bytes_sent``: the payload this rank hands to MPI.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from .. import comm as C
from ..errors import setting
from ..nn import Optimizer, Sequential
from ..observe.metrics import StepTimer
from ..run.nonfinite import all_finite
from . import buffer
from .modes import MODES, Settings, having, refuses_model


@dataclass
class Setup:
    """What a trainer tells its strategy once: where, what model, which clock."""

    comm: C.Comm
    root: int
    model: Sequential  # read for its sizes and parameters; the trainer binds it
    timer: StepTimer
    grads: np.ndarray | None = None  # a buffer to reduce in place of a new one (delegation)


@dataclass
class Buffers:
    """What a strategy allocates in :meth:`Sync.setup`; the trainer binds its model to it."""

    grads: np.ndarray  # (n_params + buffer.N_EXTRA,): gradients | extras, the reduced buffer
    params: np.ndarray | None = None  # (n_params,): where the parameters must live; None: stay


@dataclass
class Round:
    """What a trainer tells its strategy every step."""

    optimizer: Optimizer  # local SGD steps with it on every rank before averaging
    checks: bool  # False: the policy accepts anything, so finiteness need not be computed
    step: int  # the global step, for messages
    last_of_epoch: bool = False


@dataclass
class Exchanged:
    """What one exchange produced, the same on every rank."""

    loss_sum: float = 0.0
    count: int = 0
    correct: int = 0
    stop: bool = False  # some rank asked to stop
    finite: bool | None = None  # the verdict on the sums, where the strategy computed it
    nonfinite_steps: int = 1  # with finite False: how many steps it speaks for
    averaged: bool = False  # the exchange already made the replicas equal (local SGD)


def global_sums(buf: np.ndarray, n_params: int) -> Exchanged:
    """The :class:`Exchanged` of the extras of a reduced buffer ``buf``."""
    return Exchanged(*buffer.totals(buf, n_params), buffer.stopping(buf, n_params))


class Sync:
    """Fused allreduce: ONE in-place ``Allreduce`` of the whole buffer (``node_aware``:
    through :class:`mpidp.comm.NodeAllreduce`; None: where it pays). The default and the
    others' base; each takes its mode's settings' fields as arguments and attributes."""

    name = "allreduce"

    def __init__(self, *args, **kwargs) -> None:
        self.bytes_sent = 0
        self.node_aware: bool | None = None  # where the mode's settings lack it
        self.hierarchy: C.NodeAllreduce | None = None
        settings = (MODES[self.name].settings if self.name in MODES else Settings)(*args, **kwargs)
        vars(self).update(vars(settings))

    @classmethod
    def of(cls, settings: Settings, optimizer_factory=None) -> Sync:
        """This strategy with ``settings``, its mode's (``optimizer_factory``: unused)."""
        return cls(**vars(settings))

    def setup(self, s: Setup) -> Buffers:
        """Allocate this strategy's buffers for ``s.model``. Collective."""
        self.comm, self.root, self.model, self.timer = s.comm, s.root, s.model, s.timer
        self.n = s.model.n_params
        self.hierarchy = self._hierarchy(s) if s.grads is None else None
        self.buf = (s.grads if s.grads is not None else self.allocate(s)
                    if self.hierarchy is None else self.hierarchy.array)
        self.buf[...] = 0
        return Buffers(self.buf)

    def _hierarchy(self, s: Setup) -> C.NodeAllreduce | None:
        """The node-aware reduction this strategy uses, or None (plain ``Allreduce``)."""
        if (self.name not in having("node_aware") or self.node_aware is False or s.comm.size == 1
                or not self.node_aware and not C.node_aware_pays(s.comm)):
            return None
        try:
            return C.NodeAllreduce(s.comm, self.n + buffer.N_EXTRA, s.model.dtype)
        except MemoryError as e:  # the same on every rank
            if self.node_aware:
                raise C.MpidpError(f"node-aware reduction: {e}; free {C.SHM_DIR} or turn "
                                   "node-aware reduction off") from None
            if s.comm.rank == 0:
                print(f"mpidp: node-aware reduction off: {e}", file=sys.stderr)
            return None

    def allocate(self, s: Setup) -> np.ndarray:
        """The reduced buffer ``(n_params + N_EXTRA,)``, zeroed."""
        return buffer.new(s.model.n_params, s.model.dtype)

    def on_layer_done(self) -> Callable[[int], None] | None:
        """A backward hook (``Sequential.backward(on_layer_done=...)``), or None."""

    def on_layer_part(self) -> tuple[Callable[[int, int], None], int] | None:
        """``(hook, piece)`` for ``Sequential.backward(on_layer_part=..., piece=...)``, or None."""

    def on_forward(self) -> tuple[Callable[[int, int | None], None], int] | None:
        """``(hook, piece)`` for ``Sequential.forward(on_layer_params=...)``, or None."""

    def settle(self) -> None:
        """Complete an update still arriving (see :meth:`on_forward`). Collective."""

    def when_whole(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the parameters hold the last update whole: now, or when an
        update still arriving (see :meth:`on_forward`) has settled."""
        fn()

    def abandon(self) -> None:
        """After a lost rank: drop what is in flight on the communicators, revoked so that
        no survivor waits there, without waiting for it. Local."""

    def refuses_run(self, optimizer: Optimizer, on_nonfinite: str) -> str | None:
        """Why it cannot train with ``optimizer`` under the NaN policy ``on_nonfinite``, or None."""

    def refuses(self, model) -> str | None:
        """Why this strategy cannot train ``model`` (a layer it cannot honour), or None."""
        return refuses_model(model.layers, self.name)

    def reduce(self) -> None:
        """Make ``self.buf`` hold the global sums on every rank. Collective."""
        if self.hierarchy is None:
            C.allreduce_sum_(self.comm, self.buf)
        else:
            self.hierarchy.allreduce()
        # a node leader hands the buffer to MPI; the others only to shared memory
        self.bytes_sent += self.buf.nbytes if self.hierarchy is None or self.hierarchy.leads else 0

    def at_boundary(self) -> bool:
        """True when nothing is pending between synchronisations (a checkpoint may be taken)."""
        return True

    def accumulating(self) -> bool:
        """True when this step's backward must ADD to the sums already in the buffer."""
        return False

    def before_checkpoint(self, optimizer: Optimizer) -> None:
        """Gather the whole optimizer state into ``optimizer`` on the root. Collective."""

    def after_checkpoint(self, optimizer: Optimizer) -> None:
        """After the checkpoint is written (every rank)."""

    def after_restore(self, optimizer: Optimizer) -> None:
        """After :func:`mpidp.run.checkpoint.restore` filled ``optimizer`` on every rank."""

    def describe(self) -> str | None:
        """A line for the run's header about how this strategy exchanges, or None."""
        return None if self.hierarchy is None else self.hierarchy.describe()

    def step_begins(self) -> None:
        """Before every step's forward pass (``auto`` starts its clock here)."""

    def step_done(self) -> None:
        """After every step, updated or not (``auto`` measures itself). Collective there."""

    def close(self) -> None:
        """Release what the strategy holds beyond its buffers (threads); idempotent."""

    def free(self) -> None:
        """Release the shared-memory windows, after :meth:`close`. Collective; idempotent."""
        if getattr(self, "hierarchy", None) is not None:
            self.hierarchy.free()
            self.hierarchy = None

    def exchange(self, r: Round) -> Exchanged:
        """Communicate; returns the global sums (the trainer judges them). Collective."""
        with self.timer.communicate(self.name, bytes=int(self.buf.nbytes)):
            self.reduce()
        return global_sums(self.buf, self.n)

    def update(self, optimizer: Optimizer, count: int) -> None:
        """Step ``optimizer`` with the mean gradient ``sum / count``, alike on every rank."""
        with self.timer.compute():
            optimizer.step_(self.model.params, self.buf[:self.n], scale=1.0 / count)


class PerLayer(Sync):
    """One ``Allreduce`` per parameter array (and one for the extras): the naive way."""

    name = "per-layer"

    def reduce(self) -> None:
        for layer in self.model.layers:
            for g in layer.grads.values():
                C.allreduce_sum_(self.comm, g)
        C.allreduce_sum_(self.comm, self.buf[self.n:])
        self.bytes_sent += self.buf.nbytes


class _Periodic(Sync):
    """A strategy that synchronises every ``k`` steps and at the end of each epoch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pending, self.early = 0, False

    def setup(self, s: Setup) -> Buffers:
        self.pending, self.early = 0, False  # set up again (a lost rank's survivors): no group
        return super().setup(s)

    def at_boundary(self) -> bool:
        return self.pending == 0

    def due(self, last_of_epoch: bool) -> bool:
        """Count this step; True when it is time to synchronise (``early``: for an epoch's end)."""
        self.pending += 1
        if self.pending < self.k and not last_of_epoch:
            return False
        self.early, self.pending = self.pending < self.k, 0
        return True

    def check_early(self, early_ranks: int) -> None:
        """Refuse, on every rank, a synchronisation that ``early_ranks`` ranks but not all
        brought forward for an epoch's end: their steps no longer pair up."""
        if 0 < early_ranks < (size := self.comm.size):
            raise C.MpidpError(
                f"{setting('sync', self.name)}: the end of an epoch (last_of_epoch) came at "
                f"different steps on different ranks ({early_ranks} of {size} ranks "
                f"synchronised early for it); it synchronises every {self.k} steps and at each "
                f"epoch's end, so every rank must be told of the end at the same step")


class Accumulate(_Periodic):
    """Gradient accumulation: sum gradients over ``k`` global batches locally, then ONE
    ``Allreduce`` and one update (global batch ``k * B``; cut short at an epoch's end)."""

    name = "accumulate"

    def accumulating(self) -> bool:
        return self.pending > 0  # the first batch of a group overwrites the last group's sums

    def exchange(self, r: Round) -> Exchanged:
        if not self.due(r.last_of_epoch):
            return Exchanged()  # no communication, no update; totals arrive with the group
        buffer.mark_early(self.buf, self.n, self.early)
        got = super().exchange(r)
        self.check_early(buffer.early_ranks(self.buf, self.n))
        return got


class _Averaged(IntEnum):
    """The slots after the parameters in local SGD's averaged buffer: ``avg[n + slot]``."""

    LOSS = 0
    COUNT = 1
    CORRECT = 2
    NONFINITE = 3  # local steps left out for NaN/Inf
    STOP = 4  # this rank's stop request
    EARLY = 5  # this rank averages early, for an epoch's end (summed: 0 or every rank)


class LocalSGD(_Periodic):
    """Local SGD: each rank updates from its own part of the batch; every ``k`` steps (and
    at each epoch's end) one ``Allreduce`` averages the parameters and carries the totals,
    non-finite local steps (not applied; the policy judges them then) and stop requests."""

    name = "local-sgd"

    def setup(self, s: Setup) -> Buffers:
        out = super().setup(s)
        self.totals = np.zeros(_Averaged.STOP, np.float64)  # the totals slots, kept here
        self.avg = np.zeros(self.n + len(_Averaged), s.model.dtype)  # params | _Averaged
        return out

    def exchange(self, r: Round) -> Exchanged:
        with self.timer.compute():
            self._local_step(r)
        if not self.due(r.last_of_epoch):
            return Exchanged()
        n, params = self.n, self.model.params
        with self.timer.communicate(self.name, bytes=int(self.avg.nbytes)):
            self.avg[:n], self.avg[n:n + _Averaged.STOP] = params, self.totals
            self.avg[n + _Averaged.STOP:] = self.buf[n + buffer.STOP], self.early
            C.allreduce_sum_(self.comm, self.avg)
        loss, count, correct, bad, stop, early = (float(v) for v in self.avg[n:])
        self.check_early(int(round(early)))
        self.totals[...] = 0
        np.divide(self.avg[:n], self.comm.size, out=params)
        self.bytes_sent += self.avg.nbytes
        bad = int(round(bad))  # local steps left out: the trainer's policy judges them
        return Exchanged(loss, int(round(count)), int(round(correct)), stop > 0,
                         finite=not bad, nonfinite_steps=max(bad, 1), averaged=True)

    def _local_step(self, r: Round) -> None:
        """This rank's own update from its own sums; a non-finite one stays out."""
        loss, count, correct = buffer.totals(self.buf, self.n)
        finite = not r.checks or all_finite(self.buf)
        if count and finite:
            r.optimizer.step_(self.model.params, self.buf[:self.n], scale=1.0 / count)
        if finite:
            self.totals[:_Averaged.NONFINITE] += (loss, count, correct)
        else:
            self.totals[_Averaged.NONFINITE] += 1
