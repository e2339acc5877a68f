"""The asynchronous parameter server (mode ``async-ps``): workers push gradients and pull parameters
without waiting for each other; the server (rank ``root``, holding no data) applies each push as it
comes, dropping those staler than ``max_staleness`` (updates made since the worker's pull). Every
worker ends with a "done" message, so the job always ends."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from .. import comm as C
from ..data.distribute import Shard
from ..data.partition import local_batches, steps_per_epoch
from ..digest import settings_of
from ..errors import setting
from ..nn import Loss, Optimizer, Sequential
from ..nn.optim import Segments
from ..observe.metrics import StepTimer
from ..run import checkpoint as ckpt
from ..run.faults import Injector
from ..run.loop import run, watched_run, writing_checkpoint
from ..run.nonfinite import NonFiniteError, Policy, all_finite
from ..run.signals import Preempted
from ..run.spec import RunSpec
from ..run.stats import StepStats
from .data_parallel import TrainerBase
from .modes import AsyncPSSettings, refuses_model

_PUSH, _PULL = 11, 12
_STOP = -2  # the version the server answers with when training must stop
_PREEMPTED = "preempted"  # the server's reason to stop on SIGTERM/SIGUSR1


class _Slot(IntEnum):
    """The slots of a push message after the gradient ``(n_params,)``: ``msg[n + slot]``."""

    LOSS = 0  # the batch's loss sum
    COUNT = 1  # its samples
    EPOCH = 2
    BATCH = 3  # the global batch of the epoch
    VERSION = 4  # of the parameters the gradient was computed on; -1: the worker is done
    STOP = 5  # 1: this worker was asked to stop (SIGTERM/SIGUSR1 on its rank)


_EXTRA = len(_Slot)  # a push message is (n_params + _EXTRA,)
_COUNTS = ("applied", "dropped", "skipped")  # of AsyncStats, checkpointed and broadcast
#: Columns of :attr:`AsyncStats.trace`: seconds since training started (server clock), the
#: push's loss sum and sample count, its staleness, whether it was applied, the worker.
TRACE_FIELDS = ("t", "loss_sum", "count", "staleness", "applied", "worker")


@dataclass
class AsyncStats:
    """What the server saw: applied and dropped pushes, staleness, per-epoch loss, and (on
    the server) one :data:`TRACE_FIELDS` row per push."""

    applied: int = 0
    dropped: int = 0  # staler than max_staleness
    skipped: int = 0  # non-finite (on_nonfinite="skip"), as the server's Policy counts them
    staleness: list[int] = field(default_factory=list)  # of the applied pushes
    epoch_loss: dict[int, list[float]] = field(default_factory=dict)  # epoch -> [sum, count]
    trace: list[tuple] = field(default_factory=list)

    @property
    def served(self) -> int:
        """Pushes served: applied, dropped or skipped."""
        return self.applied + self.dropped + self.skipped

    def summary(self) -> dict:
        s = np.array(self.staleness or [0])
        return {"applied": self.applied, "dropped": self.dropped, "skipped": self.skipped,
                "staleness_max": int(s.max()), "staleness_mean": float(s.mean())}


class _Stopped(Exception):
    """The server told this worker to stop (NaN policy or a signal); not an error here."""


class _Worker(TrainerBase):
    """One worker as a trainer of :func:`mpidp.run.loop.run`: a step computes on the last
    pulled parameters, pushes the gradient and pulls fresh parameters."""

    def __init__(self, comm, model: Sequential, loss: Loss, root: int, timer: StepTimer) -> None:
        self.comm, self.model, self.loss, self.root, self.timer = comm, model, loss, root, timer
        self.msg = np.zeros(model.n_params + _EXTRA, model.dtype)
        self.version = np.zeros(1, np.int64)
        self.world, self.global_step, self.epoch, self.batch = comm, 0, 0, 0
        self.stop_requested: bool | None = None  # a signal on this rank (set by the loop)
        model.use_grad_buffer(self.msg)

    def step(self, X: np.ndarray, y: np.ndarray, last_of_epoch: bool = False) -> StepStats:
        """One push and pull; raises :class:`_Stopped` when the server says stop."""
        model, msg, n = self.model, self.msg, self.model.n_params
        model.context.training, model.context.step = True, self.global_step
        with self.timer.compute():  # stretched by timer.slowdown (a simulated slower node)
            msg[n + _Slot.LOSS] = self.loss.forward(model.forward(X), y)
            model.backward(self.loss.backward(), input_grad=False)
            model.context.training, model.context.index = False, None
            if self._poison:
                msg[0], self._poison = np.nan, False
        msg[n + _Slot.COUNT:] = len(X), self.epoch, self.batch, self.version[0], bool(self.stop_requested)
        with self.timer.communicate("push and pull", bytes=int(msg.nbytes)):
            C.send(self.comm, msg, self.root, _PUSH)
            C.recv_(self.comm, model.params, self.root, _PULL)  # fresh parameters...
            C.recv_(self.comm, self.version, self.root, _PULL)  # ...and their version
        self.timer.end_step(len(X))
        self.global_step += 1
        if self.version[0] == _STOP:
            raise _Stopped
        return StepStats(float(msg[n + _Slot.LOSS]), len(X), 0)

    def check_replicas(self) -> None:
        """Workers hold different parameters by design until the end."""

    def save_checkpoint(self, *args) -> None:
        raise C.MpidpError("async-ps checkpoints are written by the server")


class _WorkerFeed:
    """This worker's non-empty parts of each epoch's global batches (a loop's Feed)."""

    labelled = False  # the server reports the loss only

    def __init__(self, w: _Worker, shard: Shard, spec: RunSpec) -> None:
        self.w, self.shard, self.spec = w, shard, spec
        self.n_steps = steps_per_epoch(shard.n_total, spec.batch_size, spec.drop_last)

    def batches(self, epoch: int, first: int):
        """This worker's parts of the epoch's global batches ``first`` and later."""
        self.w.epoch, spec, shard = epoch, self.spec, self.shard
        ctx = self.w.model.context
        ctx.epoch, ctx.seed = epoch, spec.seed
        for b, idx in enumerate(local_batches(shard.n_total, spec.batch_size, shard.start,
                                              shard.stop, epoch, spec.seed, spec.shuffle,
                                              spec.drop_last)):
            y = shard.y[idx]
            if b >= first and len(y):
                self.w.batch = b
                ctx.index = shard.positions[idx]  # keys dropout masks to the samples
                yield shard.X[idx], y

    def end_epoch(self) -> None:
        """Nothing to report: the server has the loss."""

    evaluate = end_epoch

    def state(self) -> dict:
        return {}


def _work(w: _Worker, shard: Shard, spec: RunSpec, start: ckpt.State | None) -> None:
    try:
        run(w, _WorkerFeed(w, shard, spec),
            RunSpec(spec.epochs, spec.batch_size, resume=start, stop=spec.stop,
                    watchdog=spec.watchdog))
    except _Stopped:
        return  # the server stopped training: it already counts us as done
    w.msg[w.model.n_params + _Slot.VERSION] = -1
    C.send(w.comm, w.msg, w.root, _PUSH)


class _Positions:
    """Where each worker is, as served (checkpointed): ``[epoch, next batch, pushes made]``."""

    KEY = "async"  # under this key of :attr:`mpidp.run.checkpoint.State.partition`

    def __init__(self, workers: list[int], resume: ckpt.State | None, epochs: int) -> None:
        self.at = {w: [0, 0, 0] for w in workers}
        self.epochs, self.saved = epochs, {}
        if resume is not None:
            self.saved = resume.partition[self.KEY]
            old = {int(w): p for w, p in self.saved["workers"].items()}
            if sorted(old) == workers:
                self.at = {w: list(p) for w, p in old.items()}
            else:  # another number of ranks: all from the slowest worker's position
                slowest = min((p[0], p[1]) for p in old.values())
                self.at = {w: [*slowest, 0] for w in workers}

    def served(self, w: int, epoch: int, batch: int) -> None:
        self.at[w] = [epoch, batch + 1, self.at[w][2] + 1]

    def done(self, w: int) -> None:
        self.at[w] = [self.epochs, 0, self.at[w][2]]

    def state(self, stats: AsyncStats, version: int, config: dict) -> ckpt.State:
        """The checkpoint's :class:`~mpidp.run.checkpoint.State`: the slowest worker's
        position; its step the pushes served so far."""
        epoch, batch = min((p[0], p[1]) for p in self.at.values())
        info = {"workers": {str(w): p for w, p in self.at.items()}, "version": version,
                "applied": stats.applied, "dropped": stats.dropped, "skipped": stats.skipped,
                "epoch_loss": {str(e): v for e, v in stats.epoch_loss.items()}}
        return ckpt.State(epoch, batch, stats.served, [0.0, 0.0, 0.0], [], config, {self.KEY: info})


class _ServerFaults:
    """What ``nan`` and ``desync`` faults (:mod:`mpidp.run.faults`) do on the server: the
    push being served turns NaN; the server's first parameter moves by one ulp."""

    def __init__(self, model: Sequential, msg: np.ndarray) -> None:
        self.model, self.msg = model, msg

    def poison_(self) -> None:
        self.msg[:self.model.n_params + _Slot.LOSS + 1] = np.nan

    nudge_ = _Worker.nudge_


def _server(ps: AsyncPS, positions: _Positions, spec: RunSpec) -> tuple[AsyncStats, str | None]:
    comm, model, optimizer, policy, root = ps.comm, ps.model, ps.optimizer, ps.policy, ps.root
    tracer, signals, checkpoint = ps.timer.tracer, spec.stop, spec.checkpoint
    n, stats, version = model.n_params, AsyncStats(), np.zeros(1, np.int64)
    if saved := positions.saved:  # resumed: the counts go on
        version[0] = saved["version"]
        stats.applied, stats.dropped, stats.skipped = (saved[k] for k in _COUNTS)
        stats.epoch_loss = {int(e): list(v) for e, v in saved["epoch_loss"].items()}
    policy.skipped = stats.skipped  # the policy counts on from the checkpoint's count, or 0
    stop = np.array([_STOP], np.int64)
    faults = Injector(comm.rank)  # the server's steps are the pushes it has served
    error = None  # once set, every worker is told to stop at its next push
    t0 = time.perf_counter()
    workers = [r for r in range(comm.size) if r != root]
    bufs = {w: np.zeros(n + _EXTRA, model.dtype) for w in workers}
    reqs = [C.irecv(comm, bufs[w], w, _PUSH)[0] for w in workers]  # one piece each

    def save() -> None:
        state = positions.state(stats, int(version[0]), checkpoint.config)
        with writing_checkpoint(tracer):  # the server alone writes
            ckpt.save(checkpoint.directory, model, optimizer, state, checkpoint.keep,
                      run_id=checkpoint.run_id)

    while any(r != C.MPI_REQUEST_NULL for r in reqs):  # a worker not done yet
        t_wait = time.perf_counter()
        i = C.wait_any(reqs)
        t_got = time.perf_counter()
        w, msg = workers[i], bufs[workers[i]]
        if msg[n + _Slot.VERSION] < 0:  # this worker is done
            reqs[i] = C.MPI_REQUEST_NULL
            positions.done(w)
            continue
        if error is None and (msg[n + _Slot.STOP] > 0 or signals is not None and signals.requested):
            error = _PREEMPTED  # a signal on the server or on this worker
        if error is not None:  # stopping: this worker is done once told
            C.send(comm, model.params, w, _PULL)
            C.send(comm, stop, w, _PULL)
            reqs[i] = C.MPI_REQUEST_NULL
            continue
        faults.apply(stats.served, _ServerFaults(model, msg))
        stale = int(version[0] - msg[n + _Slot.VERSION])
        loss, count = float(msg[n + _Slot.LOSS]), float(msg[n + _Slot.COUNT])
        applied = stale <= ps.max_staleness
        if applied and policy.checks and not all_finite(msg[:n + _Slot.LOSS + 1]):
            try:
                applied = policy.apply(False, loss, stats.applied + stats.dropped)
            except C.MpidpError as exc:
                error, applied = str(exc), False
            stats.skipped = policy.skipped
        if applied:
            tot = stats.epoch_loss.setdefault(int(msg[n + _Slot.EPOCH]), [0.0, 0.0])
            tot[0] += loss
            tot[1] += count
            optimizer.step_(model.params, msg[:n], scale=1.0 / count)
            version[0] += 1
            stats.applied += 1
            stats.staleness.append(stale)
        elif stale > ps.max_staleness:
            stats.dropped += 1
        stats.trace.append((time.perf_counter() - t0, loss, count, stale, applied, w))
        C.send(comm, model.params, w, _PULL)
        C.send(comm, stop if error is not None else version, w, _PULL)
        if tracer is not None:
            tracer.step = stats.served
            tracer.add("wait for a push", "ps", "comm", t_wait, t_got)
            tracer.add("serve a push", "ps", "compute", t_got, time.perf_counter(), worker=w,
                       staleness=stale, applied=bool(applied))
        if error is None:  # this batch is done, whatever became of it
            positions.served(w, int(msg[n + _Slot.EPOCH]), int(msg[n + _Slot.BATCH]))
            if checkpoint is not None and stats.served % checkpoint.every == 0:
                save()
        reqs[i] = C.MPI_REQUEST_NULL if error is not None else C.irecv(comm, msg, w, _PUSH)[0]
    if checkpoint is not None and error in (None, _PREEMPTED):  # the end, or a clean stop
        save()
    return stats, error


@dataclass
class AsyncPS:
    """The asynchronous parameter server's trainer over ``comm``: rank ``root`` serves, the
    others work; a non-finite push meets ``on_nonfinite`` on the server; a worker's
    ``timer`` records its pushes. Train with :func:`fit_async`."""

    model: Sequential
    optimizer: Optimizer
    loss: Loss
    comm: C.Comm
    max_staleness: int = AsyncPSSettings.max_staleness
    on_nonfinite: str = "stop"
    timer: StepTimer = field(default_factory=StepTimer)
    root: int = 0

    def __post_init__(self) -> None:
        C.agree_same(self.comm, "AsyncPS", {  # before any collective that could then hang
            "model": self.model.spec(), "dtype": str(self.model.dtype),
            "optimizer": settings_of(self.optimizer), "loss": settings_of(self.loss),
            "max_staleness": self.max_staleness, "on_nonfinite": self.on_nonfinite,
            "root": self.root})
        if self.comm.size < 2:
            raise C.MpidpError("async-ps needs at least 2 ranks (a server and a worker)")
        if self.model.n_params + _EXTRA > C.MAX_COUNT:
            raise C.MpidpError("async-ps sends the parameters in one message: at most "
                               f"{C.MAX_COUNT - _EXTRA} parameters, got {self.model.n_params}")
        AsyncPSSettings(self.max_staleness)  # checked
        if refused := refuses_model(self.model.layers, "async-ps"):
            raise C.MpidpError(refused)
        self.policy = Policy(self.on_nonfinite)
        self.optimizer.place(Segments.of(self.model))  # the server updates the whole vector


def _check_spec(spec: RunSpec) -> None:
    if spec.resume is not None and _Positions.KEY not in spec.resume.partition:
        raise C.MpidpError(f"this checkpoint was written by synchronous training; async-ps "
                           f"resumes only its own checkpoints (resume it with the "
                           f"{setting('sync')} it was written with, or start over with "
                           f"{setting('restart')})")
    if spec.partition is not None:
        raise C.MpidpError("partition does not apply to async-ps: its workers keep the "
                           "contiguous blocks they loaded (block or weighted)")
    if spec.check_every:
        raise C.MpidpError("check_every does not apply to async-ps: its workers hold "
                           "different parameters by design until the end")
    if given := [name for name in ("on_step", "on_epoch", "progress") if getattr(spec, name)]:
        raise C.MpidpError(f"{', '.join(given)} does not apply to async-ps: its workers are "
                           "at different steps, and the server reports when training ends "
                           "(AsyncStats)")


def fit_async(ps: AsyncPS, train: Shard, epochs: int | None = None,
              batch_size: int | None = None, *, spec: RunSpec | None = None,
              **settings) -> AsyncStats:
    """Train asynchronously. Collective. Workers split each global batch by their blocks
    (the server's ``train`` is ignored); ``spec`` and ``settings`` as for :func:`mpidp.fit`
    (the server checkpoints every ``checkpoint.every`` pushes, at the end and on a stop).
    Returns the server's :class:`AsyncStats` on every rank (the trace only on the server);
    the parameters end identical on every rank."""
    spec = RunSpec.of(spec, epochs=epochs, batch_size=batch_size, **settings)
    comm, root = ps.comm, ps.root
    C.agree_same(comm, "fit_async", {**spec.agreed(), **train.identity("train")})
    C.run_agreed(comm, _check_spec, spec)
    C.run_agreed(comm, steps_per_epoch, train.n_total, spec.batch_size, spec.drop_last)
    C.bcast_(comm, ps.model.params, root)
    with watched_run(spec, comm) as spec:
        if spec.watchdog is not None:
            spec.watchdog.start()
        positions = _Positions([r for r in range(comm.size) if r != root], spec.resume, spec.epochs)
        stats, error = AsyncStats(), None
        if comm.rank == root:
            stats, error = _server(ps, positions, spec)
        else:
            _work(_Worker(comm, ps.model, ps.loss, root, ps.timer), train, spec,
                  ckpt.State(*positions.at[comm.rank]) if spec.resume is not None else None)
        error = C.bcast_obj(comm, error, root)  # the server's reason to stop, on every rank
        if error == _PREEMPTED:
            raise Preempted(int(C.bcast_obj(comm, stats.applied, root)), spec.checkpoint)
        if error is not None:
            raise NonFiniteError(error)
        C.bcast_(comm, ps.model.params, root)
        summary = C.bcast_obj(comm, stats.summary() | {"epoch_loss": stats.epoch_loss}, root)
        stats.applied, stats.dropped, stats.skipped = (summary[k] for k in _COUNTS)
        stats.epoch_loss = summary["epoch_loss"]
        return stats


def epoch_history(stats: AsyncStats) -> list[dict]:
    """A history record per epoch of the loss the server received; MpidpError when no
    update was applied."""
    history = [{"epoch": e + 1, "loss": s / c, "accuracy": None, "seconds": None}
               for e, (s, c) in sorted((int(k), v) for k, v in stats.epoch_loss.items())]
    if not history:
        raise C.MpidpError("async-ps applied no update (every push was dropped or skipped)")
    return history
