"""Synchronous data parallelism: every rank holds the whole model; one in-place
``Allreduce`` per step combines gradient sums, the loss sum and the sample counts."""

from __future__ import annotations

import copy

import numpy as np

from .. import comm as C
from ..nn import Loss, Optimizer, Sequential
from ..nn.optim import chunk_edges
from ..observe.metrics import StepTimer
from ..run import checkpoint as ckpt
from ..run.nonfinite import ON_NONFINITE, Policy, all_finite
from ..run.stats import StepStats
from . import buffer
from .strategies import make_sync
from .sync import Sync

INIT_SYNC = ("bcast", "seed")
#: Reduced buffers at least this big are checked for NaN/Inf 1/P per rank plus a one-flag
#: ``Allreduce``; smaller ones whole on every rank (a pass over 1 MiB takes ~40 us, about
#: the latency of the extra collective between nodes).
SPLIT_CHECK_BYTES = 1 << 20


class DataParallel:
    """Train ``model`` with ``optimizer`` on ``loss``, replicated over ``comm``.

    Parameters
    ----------
    init_sync : ``"bcast"`` copies ``root``'s parameters to every rank (one ``Bcast``);
        ``"seed"`` trusts that every rank initialised identically and verifies it with a
        checksum (one small ``Allreduce``), raising on every rank if not.
    abort_on_error : install :func:`mpidp.comm.abort_on_error` so an exception on one rank
        ends the job instead of leaving the others waiting.
    check_every : every this many steps, compare parameter checksums across ranks (one
        small ``Allreduce``) and raise on every rank, naming the odd ranks, on a mismatch.
        0 disables the check.
    on_nonfinite : ``"stop"`` raises :class:`NonFiniteError` on every rank when the global
        loss or gradient holds NaN/Inf, before the update; ``"skip"`` drops that step's
        update (counted in ``skipped_steps``); ``"ignore"`` applies it. Every rank holds the
        same reduced sums, so each checks ``1/P`` of them (one dot product, at memory speed)
        and a one-integer ``Allreduce`` shares the verdict (below ``SPLIT_CHECK_BYTES``
        every rank checks all of them and there is no extra collective).
    watchdog : seconds: a rank that makes no progress (stuck computing, or waiting in an
        MPI call) for longer ends the job, naming the stalled ranks
        (:class:`mpidp.comm.Watchdog`); also the guard for a user's loop that calls
        :meth:`step` a different number of times on different ranks. None: no watchdog.
    sync : how gradients are combined: a :class:`mpidp.parallel.sync.Sync` or a name from
        ``SYNCS`` (``allreduce``, the default: one fused in-place ``Allreduce`` per step).

    Notes
    -----
    The gradient of a step is ``sum of per-sample gradients over the global batch /
    global sample count``, so any split of the batch over ranks (uneven, some empty)
    gives the single-process update up to floating-point summation order.
    """

    def __init__(self, model: Sequential, optimizer: Optimizer, loss: Loss,
                 comm: C.Comm | None = None, init_sync: str = "bcast", root: int = 0,
                 abort_on_error: bool = True, check_every: int = 0, on_nonfinite: str = "stop",
                 watchdog: float | None = None, sync: Sync | str = "allreduce") -> None:
        if init_sync not in INIT_SYNC:
            raise C.MpidpError(f"unknown init sync {init_sync!r}; expected one of {INIT_SYNC}")
        if on_nonfinite not in ON_NONFINITE:
            raise C.MpidpError(f"unknown on_nonfinite {on_nonfinite!r}; expected one of {ON_NONFINITE}")
        if check_every < 0:
            raise C.MpidpError(f"check_every must be >= 0, got {check_every}")
        self.check_every, self.policy = check_every, Policy(on_nonfinite)
        self.global_step = 0  # steps taken (or skipped) since training started
        self.last_of_epoch = False
        self._poison = False
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.comm = comm if comm is not None else C.world()
        self.root = root
        self.timer = StepTimer()
        self.watchdog = C.Watchdog(self.comm, watchdog).start() if watchdog else None
        if abort_on_error:
            C.abort_on_error()
        # grads | loss_sum | count | correct: ONE buffer, so ONE Allreduce per step
        self.buf = buffer.new(model.n_params, model.dtype)
        model.use_grad_buffer(self.buf)
        self.sync_params(init_sync)
        self.sync = (make_sync(sync, lambda: copy.deepcopy(optimizer)) if isinstance(sync, str)
                     else sync)
        self.sync.setup(self)  # its checks depend only on what every rank shares
        self._on_layer_done = self.sync.on_layer_done(self)

    def sync_params(self, how: str = "bcast") -> None:
        """Make every rank's parameters equal ``root``'s (``bcast``) or check they are (``seed``)."""
        if how == "bcast":
            C.bcast_(self.comm, self.model.params, self.root)
        else:
            C.assert_in_sync(self.comm, self.model.params, self.root)

    @property
    def on_nonfinite(self) -> str:
        return self.policy.mode

    @property
    def skipped_steps(self) -> int:
        return self.policy.skipped

    @property
    def world(self) -> C.Comm:
        return self.comm

    def in_sync(self) -> bool:
        """True on every rank iff all replicas' parameters are bit-identical. Collective."""
        return C.params_in_sync(self.comm, self.model.params)

    def check_replicas(self) -> None:
        """Raise :class:`mpidp.MpidpError` on every rank, naming the ranks whose parameters
        differ from the root's, unless all replicas are bit-identical. Collective."""
        C.assert_in_sync(self.comm, self.model.params, self.root)

    def poison_(self) -> None:
        """Fault injection: this rank's gradient contribution to the next step is NaN."""
        self._poison = True

    def nudge_(self) -> None:
        """Fault injection: move this rank's first parameter by one ulp (a desync)."""
        p = self.model.params
        p[0] = np.nextafter(p[0], np.inf)

    def at_boundary(self) -> bool:
        """True when a checkpoint may be taken (not inside an accumulation group)."""
        return self.sync.at_boundary()

    def save_checkpoint(self, directory: str, state: ckpt.State, keep: int,
                        run_id: str | None = None) -> None:
        """Write a checkpoint of ``state`` (root writes; a refusal, e.g. a folder taken
        over by another run, is raised on every rank). Collective."""
        self.sync.before_checkpoint(self)  # a sharded optimizer state is gathered to root
        try:
            C.root_decides(self.comm, ckpt.save, directory, self.model, self.optimizer, state,
                           keep, root=self.root, run_id=run_id)
        finally:
            self.sync.after_checkpoint(self)

    def restore(self, directory: str) -> tuple[str, ckpt.State] | None:
        """Load the newest good checkpoint in ``directory`` on every rank (the strategy takes
        its share when training resumes, :func:`mpidp.fit`). Collective."""
        found = ckpt.restore(self.comm, directory, self.model, self.optimizer, self.root)
        if found is not None:
            self.global_step = found[1].global_step
        return found

    def epoch_totals(self, totals: np.ndarray) -> np.ndarray:
        """The epoch's ``(loss, count, correct)`` sums: already global here."""
        return totals

    def _eval_pass(self, X: np.ndarray, y: np.ndarray) -> tuple[float, int]:
        out = self.model.forward(X)
        loss_sum = self.loss.forward(out, y)
        labelled = self.loss.classification or y.dtype.kind in "iu"
        return loss_sum, self.loss.n_correct(out, y) if labelled else 0

    def step(self, X: np.ndarray, y: np.ndarray, last_of_epoch: bool = False) -> StepStats:
        """One synchronous step on this rank's part ``X`` ``(n_local, n_features)`` of the
        global batch (``n_local`` may be 0). Collective. Returns the global batch's stats
        (strategies that synchronise every k steps return zeros in between and the group's
        totals when they synchronise; ``last_of_epoch`` makes them synchronise now)."""
        buf, n = self.buf, self.model.n_params
        self.last_of_epoch = last_of_epoch
        add = self.sync.accumulating()  # gradient accumulation: add to the buffer's sums
        with self.timer.compute("compute", samples=len(X)):
            out = self.model.forward(X)
            loss_sum = self.loss.forward(out, y)
            labelled = self.loss.classification or y.dtype.kind in "iu"
            extras = (loss_sum, len(X), self.loss.n_correct(out, y) if labelled else 0)
            if add:
                buf[n:] += extras
            else:
                buf[n:] = extras
            dy = self.loss.backward()
            if self._poison:  # fault injection: this rank's contribution, before any bucket
                dy, buf[n], self._poison = np.full_like(dy, np.nan), np.nan, False  # leaves
            self.model.backward(dy, accumulate=add, input_grad=False,
                                on_layer_done=self._on_layer_done)
        loss_sum, count, correct, skipped = self.sync.exchange(self)
        self.timer.end_step(len(X))
        self.global_step += 1
        if self.check_every and self.global_step % self.check_every == 0:
            C.assert_in_sync(self.comm, self.model.params, self.root)
        C.set_step(self.global_step)
        return StepStats(loss_sum, count, correct, skipped)

    def apply_global(self, buf: np.ndarray) -> tuple[float, int, int, bool]:
        """Update from the GLOBAL sums in ``buf`` (gradients | loss | count | correct):
        mean gradient = sum / count, folded into the optimizer step. Every rank holds the
        same ``buf`` and calls this (collective). Returns ``(loss_sum, count, correct, skipped)``."""
        loss_sum, count, correct, skipped = self.judge_global(buf)
        if count and not skipped:
            self.optimizer.step_(self.model.params, buf[:self.model.n_params], scale=1.0 / count)
        return loss_sum, count, correct, skipped

    def judge_global(self, buf: np.ndarray, everywhere: bool = True) -> tuple[float, int, int, bool]:
        """``(loss_sum, count, correct, skipped)`` of the global sums in ``buf``, with the NaN
        policy applied to them (raises for ``stop``); the update is left to the caller.

        ``everywhere``: every rank holds the same ``buf`` and calls this (collective), so
        each checks only its ``1/P`` of it and one tiny ``Allreduce`` shares the verdict;
        False: only this rank has ``buf`` (a parameter server) and checks all of it."""
        loss_sum, count, correct = buffer.totals(buf, self.model.n_params)
        skipped = False
        if count and self.policy.checks:  # "ignore" skips the pass altogether
            finite = self.all_finite_everywhere(buf) if everywhere else all_finite(buf)
            skipped = not self.finite_or_skip(finite, loss_sum)
        return loss_sum, count, correct, skipped

    def all_finite_everywhere(self, buf: np.ndarray) -> bool:
        """``all_finite(buf)`` for a 1-D ``buf`` that every rank holds identically. From
        :data:`SPLIT_CHECK_BYTES` up, each rank checks its ``1/P`` and one ``Allreduce`` of a
        flag combines them. Collective."""
        P, r = self.comm.size, self.comm.rank
        if P == 1 or buf.nbytes < SPLIT_CHECK_BYTES:
            return all_finite(buf)
        edges = chunk_edges(len(buf), P)
        flag = np.array([all_finite(buf[edges[r]:edges[r + 1]])], np.int32)
        return bool(C.allreduce_(self.comm, flag, "min")[0])

    def finite_or_skip(self, finite: bool, loss_sum: float) -> bool:
        """The NaN policy on a verdict every rank shares (:meth:`mpidp.run.nonfinite.Policy.apply`)."""
        return self.policy.apply(finite, loss_sum, self.global_step)

    def evaluate(self, X: np.ndarray, y: np.ndarray, batch_size: int = 4096) -> StepStats:
        """Loss and correct predictions over every rank's ``(X, y)``. Collective (1 Allreduce)."""
        total = np.zeros(3, np.float64)
        for s in range(0, len(X), batch_size):
            loss_sum, correct = self._eval_pass(X[s:s + batch_size], y[s:s + batch_size])
            total += (loss_sum, len(X[s:s + batch_size]), correct)
        C.allreduce_sum_(self.comm, total)
        return StepStats(float(total[0]), int(total[1]), int(total[2]))
