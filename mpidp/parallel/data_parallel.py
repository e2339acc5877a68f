"""Synchronous data parallelism: every rank holds the whole model; one in-place ``Allreduce``
per step combines gradient sums, the loss sum and the sample counts. :class:`DataParallel` is
the trainer; its batches and run (:func:`fit`) are in :mod:`~mpidp.parallel.data_feed`."""

from __future__ import annotations

import copy
import time

import numpy as np

from .. import comm as C
from ..digest import settings_of, state_of
from ..errors import is_whole
from ..nn import Context, Loss, Optimizer, Sequential
from ..nn.context import positions
from ..nn.optim import Segments
from ..observe.metrics import StepTimer
from ..run import checkpoint as ckpt
from ..run.nonfinite import ON_NONFINITE, NonFiniteError, Policy, all_finite
from ..run.stats import StepStats
from . import buffer
from .evaluation import global_sums, n_correct, score_sums
from .modes import make_sync
from .sync import Exchanged, Round, Setup, Sync

INIT_SYNC = ("bcast", "seed")
#: The rule for layer state (docs/extending.md) that replicas whose state differs broke.
STATE_RULE = ("a layer must update its state only from global figures (sums that "
              "context.reduce_sum completes over the batch), never from its own rows")


def out_of_sync(comm: C.Comm, model: Sequential, root: int = 0) -> str | None:
    """Why the replicas of ``model`` over ``comm`` are not bit-identical, in one line naming
    the ranks and the rule broken: the parameters, or the first layer whose state differs;
    None when they are. Collective: one small Allreduce."""
    held = [(i, layer) for i, layer in enumerate(model.layers) if layer.state]
    states = [np.concatenate([np.ravel(v) for v in layer.state.values()]) for _, layer in held]
    bad = C.replicas_differ(comm, [model.params, *states], root)
    if bad[0]:
        return f"parameters differ from rank {root}'s on ranks {bad[0]}: replicas are out of sync"
    return next((f"layer {i} ({layer!r}): its state differs from rank {root}'s on ranks "
                 f"{ranks}: {STATE_RULE}" for (i, layer), ranks in zip(held, bad[1:]) if ranks), None)


class TrainerBase:
    """What most trainers of the run loop (:class:`mpidp.run.loop.Trainer`) answer alike:
    faults (``step`` makes its gradient NaN while ``_poison`` is set), boundaries, totals."""

    _poison = False

    def poison_(self) -> None:
        """Fault injection: this rank's gradient contribution to the next step is NaN."""
        self._poison = True

    def nudge_(self) -> None:
        """Fault injection: move this rank's first parameter by one ulp (a desync)."""
        p = self.model.params
        if p.size:
            p[0] = np.nextafter(p[0], np.inf)

    def at_boundary(self) -> bool:
        """True when a checkpoint may be taken."""
        return True

    def epoch_totals(self, totals: np.ndarray) -> np.ndarray:
        """The epoch's ``(loss, count, correct)`` sums: already global here."""
        return totals


class DataParallel(TrainerBase):
    """Train ``model`` with ``optimizer`` on ``loss``, replicated over ``comm``. A step's update
    is the single-process one (up to summation order) for any split.

    init_sync : ``"bcast"`` copies ``root``'s parameters to every rank; ``"seed"``
        verifies with a checksum that every rank initialised identically.
    abort_on_error : install :func:`mpidp.comm.abort_on_error` (unless
        ``MPIDP_ABORT_ON_ERROR=0``) so an exception on one rank ends the job.
    check_every : :meth:`check_replicas` every this many steps (0: never).
    on_nonfinite : on a global NaN/Inf, ``"stop"`` (:class:`NonFiniteError`), ``"skip"``
        the update (``skipped_steps``) or ``"ignore"`` it; one verdict on every rank.
    watchdog : seconds without progress on a rank before the job ends
        (:class:`mpidp.comm.Watchdog`). None: no watchdog.
    sync : a :class:`mpidp.parallel.sync.Sync` or a name from ``SYNCS`` (``allreduce``).
    """

    def __init__(self, model: Sequential, optimizer: Optimizer, loss: Loss,
                 comm: C.Comm | None = None, init_sync: str = "bcast", root: int = 0,
                 abort_on_error: bool = True, check_every: int = 0, on_nonfinite: str = "stop",
                 watchdog: float | None = None, sync: Sync | str = "allreduce") -> None:
        comm = comm if comm is not None else C.world()
        _check_kinds(model, optimizer, loss, sync, comm, root)
        # a strategy object holds one trainer's buffers and state: never a second trainer's
        taken = not isinstance(sync, str) and getattr(sync, "_taken", False)
        C.agree_same(comm, "DataParallel", {  # before any collective that could then hang
            "model": model.spec(), "dtype": str(model.dtype), "optimizer": settings_of(optimizer),
            "optimizer state": state_of(optimizer),  # a replica's moments, not another's
            "loss": settings_of(loss), "sync": sync if isinstance(sync, str) else
            "a strategy object in use" if taken else settings_of(sync, skip=("bytes_sent",)),
            "init_sync": init_sync, "root": root,
            "on_nonfinite": on_nonfinite, "check_every": check_every,
            "watchdog": "off" if not watchdog else watchdog})
        if taken:  # on every rank: the arguments agree
            raise C.MpidpError(
                f"this {type(sync).__name__} strategy object already served a DataParallel (it "
                f"holds that trainer's buffers and state): give each DataParallel a strategy "
                f"of its own, e.g. make_sync({getattr(sync, 'name', '...')!r}), or its name")
        for what, value, known in (("init sync", init_sync, INIT_SYNC),
                                   ("on_nonfinite", on_nonfinite, ON_NONFINITE)):
            if value not in known:
                raise C.MpidpError(f"unknown {what} {value!r}; expected one of {known}")
        if not is_whole(check_every, 0):
            raise C.MpidpError(f"check_every must be a whole number >= 0, got {check_every!r}")
        self.check_every, self.policy = check_every, Policy(on_nonfinite)
        self.global_step = 0  # steps taken (or skipped) since training started
        self.stop_requested: bool | None = None  # this rank asks to stop (set by the loop)
        self._check_due = False  # a replica check waits for the next synchronisation
        self._kept_state: np.ndarray | None = None  # untrained state before this update's steps
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.comm, self.root, self.timer = comm, root, StepTimer()
        self.layer_sums, self.layer_sums_s = 0, 0.0  # layers' own collectives (batch norm)
        self.watchdog = C.Watchdog(self.comm, watchdog).start() if watchdog else None
        if abort_on_error:
            C.install_abort_hook()
        # layers that sum over the global batch (batch norm) ask through the model's context
        model.set_context(Context(reduce_sum=self._reduce_sum, group_size=self.comm.size))
        optimizer.place(Segments.of(model))  # a sharded strategy places its own on its slice
        self.sync = (make_sync(sync, optimizer_factory=lambda: copy.deepcopy(optimizer))
                     if isinstance(sync, str) else sync)
        if refused := self.sync.refuses(model) or self.sync.refuses_run(optimizer, on_nonfinite):
            raise C.MpidpError(refused)  # the same verdict on every rank, before any work
        self.sync_params(init_sync)
        # grads | extras (mpidp.parallel.buffer): ONE buffer, laid out as the strategy needs
        bufs = self.sync.setup(Setup(self.comm, root, model, self.timer))
        self.sync._taken = True  # this trainer's from here on (a failed start leaves it free)
        model.use_grad_buffer(bufs.grads)
        if bufs.params is not None:
            model.use_param_buffer(bufs.params)
        self.buf = bufs.grads
        self._on_layer_done = self.sync.on_layer_done()
        self._on_layer_part = self.sync.on_layer_part() if self._on_layer_done else None
        self._on_forward = self.sync.on_forward()
        self.closed = False

    def _reduce_sum(self, a: np.ndarray) -> np.ndarray:
        """A layer's sum over the replicas (batch norm's), timed in ``layer_sums_s``."""
        t = time.perf_counter()
        C.allreduce_sum_(self.comm, a)
        self.layer_sums_s += time.perf_counter() - t
        self.layer_sums += 1
        return a

    def close(self) -> None:
        """Release what the strategy holds (threads, shared-memory windows), moving the
        model's arrays into its own memory. Collective; idempotent; also ending ``with``."""
        if self.closed:
            return
        self.sync.settle()
        self.buf = self.buf.copy()  # out of any window the strategy frees
        self.model.use_grad_buffer(self.buf)
        self.model.use_param_buffer(self.model.params.copy())
        self.sync.close()
        self.sync.free()
        self.closed = True

    def __enter__(self) -> DataParallel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def sync_params(self, how: str = "bcast") -> None:
        """Make every rank's parameters (and layer state) equal ``root``'s (``bcast``) or
        check they are (``seed``)."""
        self.sync.settle()
        if how == "bcast":
            C.bcast_(self.comm, self.model.params, self.root)
            if self.model.n_state:
                C.bcast_(self.comm, self.model.state, self.root)
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

    def settle(self) -> None:
        """Complete an update still arriving between steps (finish ``"forward"``): call it
        before reading ``model.params`` in a loop of your own. Collective."""
        self.sync.settle()

    def in_sync(self) -> bool:
        """True on every rank iff all replicas are bit-identical. Collective."""
        self.sync.settle()
        return out_of_sync(self.comm, self.model, self.root) is None

    def check_replicas(self) -> None:
        """Raise :class:`mpidp.MpidpError` on every rank unless all replicas are
        bit-identical, naming the ranks (or the layer) that differ. Collective."""
        self.sync.settle()
        if why := out_of_sync(self.comm, self.model, self.root):
            raise C.MpidpError(why)

    def at_boundary(self) -> bool:
        """True when a checkpoint may be taken (not inside an accumulation group)."""
        return self.sync.at_boundary()

    def save_checkpoint(self, directory: str, state: ckpt.State, keep: int,
                        run_id: str | None = None) -> None:
        """Write a checkpoint of ``state`` (root writes; a refusal, e.g. a folder taken
        over by another run, is raised on every rank). Collective."""
        self.sync.settle()
        self.sync.before_checkpoint(self.optimizer)  # a sharded state is gathered to root
        try:
            C.root_decides(self.comm, ckpt.save, directory, self.model, self.optimizer, state,
                           keep, root=self.root, run_id=run_id)
        finally:
            self.sync.after_checkpoint(self.optimizer)

    def restore(self, directory: str) -> tuple[str, ckpt.State] | None:
        """Load the newest good checkpoint in ``directory`` on every rank (a sharded
        strategy keeps its slice of the optimizer state). Collective."""
        self.sync.settle()  # nothing still arriving may overwrite what is restored
        found = ckpt.restore(self.comm, directory, self.model, self.optimizer, self.root)
        if found is not None:
            self.global_step = found[1].global_step
            self.sync.after_restore(self.optimizer)
        return found

    def step(self, X: np.ndarray, y: np.ndarray, last_of_epoch: bool = False,
             index: np.ndarray | None = None) -> StepStats:
        """One step on this rank's part ``X`` ``(n_local, ...)`` of the global batch.
        Collective. Returns the global batch's stats (periodic strategies: zeros between
        synchronisations, which ``last_of_epoch`` brings forward). ``index``: the rows'
        global positions, which key dropout masks."""
        if self.closed:
            raise C.MpidpError("this DataParallel is closed: build a new one to train again")
        buf, n = self.buf, self.model.n_params
        self.sync.step_begins()
        add = self.sync.accumulating()  # gradient accumulation: add to the buffer's sums
        ctx = self.model.context
        ctx.training, ctx.step = True, self.global_step
        if self.model.n_state and self.policy.checks and not add:  # what a dropped step restores
            self._kept_state = self.model.state.copy()  # (forward moves batch norm's)
        if index is not None:
            ctx.index = positions(index)
        with self.timer.compute("compute", samples=len(X)):
            try:
                if self._on_forward is None:
                    out = self.model.forward(X)
                else:  # the last update's parts arrive as the layers read them
                    hook, piece = self._on_forward
                    out = self.model.forward(X, on_layer_params=hook, piece=piece)
                    self.sync.settle()  # every sum is done before backward reuses the buffer
            finally:
                ctx.index = None  # never reused by a later step
            buffer.put(buf, n, self.loss.forward(out, y), len(X), n_correct(self.loss, out, y),
                       bool(self.stop_requested), add)
            dy = self.loss.backward()
            if self._poison:  # fault injection: this rank's contribution, before any bucket
                dy, buf[n], self._poison = np.full_like(dy, np.nan), np.nan, False  # leaves
            part, piece = self._on_layer_part or (None, 0)
            self.model.backward(dy, accumulate=add, input_grad=False,
                                on_layer_done=self._on_layer_done, on_layer_part=part,
                                piece=piece)
            ctx.training = False
        got = self.sync.exchange(Round(self.optimizer, self.policy.checks, self.global_step,
                                       last_of_epoch))
        try:
            skipped = not self._judge_and_update(got)
        except NonFiniteError:
            self._restore_state()
            raise
        if skipped:
            self._restore_state()
        self.sync.step_done()
        self.timer.end_step(len(X))
        self.global_step += 1
        # replicas are equal only between synchronisations (local SGD's differ in between)
        self._check_due |= bool(self.check_every) and self.global_step % self.check_every == 0
        if self._check_due and self.sync.at_boundary():
            self._check_due = False
            self.check_replicas()
        C.set_step(self.global_step)
        return StepStats(got.loss_sum, got.count, got.correct, skipped, got.stop)

    def _restore_state(self) -> None:
        if self._kept_state is not None and self._kept_state.shape == self.model.state.shape:
            self.model.state[...] = self._kept_state

    def _judge_and_update(self, got: Exchanged) -> bool:
        """The NaN policy on the global sums (alike on every rank), then the update; False
        if the policy dropped it; :class:`NonFiniteError` for ``stop``."""
        if got.averaged:  # local SGD: the replicas are equal already; judge what it left out
            self.policy.apply(got.finite, got.loss_sum, self.global_step, got.nonfinite_steps,
                              self.model.params)
            return True
        if not got.count:
            return True
        with self.timer.compute():
            finite = got.finite if got.finite is not None else (
                not self.policy.checks or all_finite(self.buf))
        if not self.policy.apply(finite, got.loss_sum, self.global_step,
                                 1 if finite else got.nonfinite_steps, self.model.params):
            return False
        self.sync.update(self.optimizer, got.count)
        return True

    def evaluate(self, X: np.ndarray, y: np.ndarray, batch_size: int = 4096) -> StepStats:
        """Loss, accuracy and :mod:`mpidp.observe.scores` over every rank's ``(X, y)``
        together, as one process on all the rows would find them. Collective."""
        if not is_whole(batch_size, 1):
            raise C.MpidpError(f"evaluate: batch_size must be a whole number >= 1, got "
                               f"{batch_size!r}")
        self.sync.settle()
        total = np.zeros(3, np.float64)
        sums = score_sums(self.comm, self.loss, y, self.model.n_out)
        for s in range(0, len(X), batch_size):
            yb = y[s:s + batch_size]
            self.model.context.training = False
            out = self.model.forward(X[s:s + batch_size])
            total += (self.loss.forward(out, yb), len(out), n_correct(self.loss, out, yb))
            sums.add(out, yb)
        total, vector = global_sums(self.comm, total, sums)
        return StepStats(float(total[0]), int(total[1]), int(total[2]),
                         scores=sums.scores(vector))


def _check_kinds(model, optimizer, loss, sync, comm, root) -> None:
    """Raise :class:`~mpidp.comm.MpidpError` naming an argument not of its kind."""
    for name, value, kind, wanted in (
            ("model", model, Sequential, "a model such as nn.mlp(...) or nn.Sequential(...)"),
            ("optimizer", optimizer, Optimizer, "an optimizer such as nn.SGD(0.1)"),
            ("loss", loss, Loss, "a loss such as nn.SoftmaxCrossEntropy()"),
            ("sync", sync, (str, Sync), "a strategy's name such as 'allreduce', or a "
                                        "strategy such as make_sync('overlapped')")):
        if not isinstance(value, kind):
            got = (f"the class {value.__name__} (call it)" if isinstance(value, type) else
                   repr(value) if isinstance(value, (int, float, type(None))) else
                   f"a {type(value).__name__}")
            raise C.MpidpError(f"DataParallel: {name} must be {wanted}, got {got}")
    if not all(hasattr(comm, a) for a in ("Allreduce", "size", "rank")):  # or a wrapper of one
        raise C.MpidpError(f"DataParallel: comm must be an MPI communicator (or None: "
                           f"COMM_WORLD), got {type(comm).__name__}")
    if not is_whole(root, 0) or root >= comm.size:
        raise C.MpidpError(f"DataParallel: root must be a rank of the communicator, 0 to "
                           f"{comm.size - 1}, got {root!r}")
