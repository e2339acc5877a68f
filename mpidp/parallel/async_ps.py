"""Asynchronous parameter server: workers push gradients and pull parameters without waiting
for each other; the server (rank ``root``, holding no data) applies each push as it comes.

A worker computes on the parameters it last pulled; by the time its gradient arrives, other
workers may have updated them ``s`` times (its *staleness*). Pushes staler than
``max_staleness`` are dropped (counted), bounding how old a gradient can be. Every worker
pushes exactly its own number of batches and then a "done" message, so the server knows
when to stop: the job always ends. Buffer-based point-to-point only; one final ``Bcast``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .. import comm as C
from ..data import Shard
from ..faults import Injector
from ..metrics import StepTimer
from ..nn import Loss, Optimizer, Sequential
from ..nonfinite import Policy, all_finite
from ..partition import local_batches, steps_per_epoch

_PUSH, _PULL = 11, 12
_STOP = -2  # the version the server answers with when training must stop (NaN policy)
#: Columns of :attr:`AsyncStats.trace`: seconds since training started (server clock), the
#: push's loss sum and sample count, its staleness, whether it was applied, the worker.
TRACE_FIELDS = ("t", "loss_sum", "count", "staleness", "applied", "worker")


@dataclass
class AsyncStats:
    """What the server saw: applied and dropped pushes, staleness, per-epoch loss, and (on
    the server) one :data:`TRACE_FIELDS` row per push."""

    applied: int = 0
    dropped: int = 0  # staler than max_staleness
    skipped: int = 0  # non-finite (on_nonfinite="skip")
    staleness: list[int] = field(default_factory=list)  # of the applied pushes
    epoch_loss: dict[int, list[float]] = field(default_factory=dict)  # epoch -> [sum, count]
    trace: list[tuple] = field(default_factory=list)

    def summary(self) -> dict:
        s = np.array(self.staleness or [0])
        return {"applied": self.applied, "dropped": self.dropped, "skipped": self.skipped,
                "staleness_max": int(s.max()), "staleness_mean": float(s.mean())}


class _Worker:
    """One worker's side: compute on the last pulled parameters, push, pull."""

    def __init__(self, comm, model: Sequential, loss: Loss, root: int, timer: StepTimer) -> None:
        self.comm, self.model, self.loss, self.root, self.timer = comm, model, loss, root, timer
        n = model.n_params
        self.msg = np.zeros(n + 4, model.dtype)  # grads | loss | count | epoch | version (-1: done)
        self.version = np.zeros(1, np.int64)
        self._poison = False
        model.use_grad_buffer(self.msg)

    def poison_(self) -> None:  # fault injection (mpidp.faults)
        self._poison = True

    def nudge_(self) -> None:
        self.model.params[0] = np.nextafter(self.model.params[0], np.inf)

    def push(self, X: np.ndarray, y: np.ndarray, epoch: int) -> bool:
        """One push and pull; False when the server says stop."""
        model, msg, n = self.model, self.msg, self.model.n_params
        with self.timer.compute():  # stretched by timer.slowdown (a simulated slower node)
            msg[n] = self.loss.forward(model.forward(X), y)
            model.backward(self.loss.backward(), input_grad=False)
            if self._poison:
                msg[0], self._poison = np.nan, False
        msg[n + 1:n + 4] = (len(X), epoch, self.version[0])
        with self.timer.communicate("push and pull", bytes=int(msg.nbytes)):
            C.send(self.comm, msg, self.root, _PUSH)
            C.recv_(self.comm, model.params, self.root, _PULL)  # fresh parameters...
            C.recv_(self.comm, self.version, self.root, _PULL)  # ...and their version
        self.timer.end_step(len(X))
        return self.version[0] != _STOP


def _work(w: _Worker, shard: Shard, epochs: int, batch_size: int, seed: int) -> None:
    faults, step = Injector(w.comm.rank), 0
    for epoch in range(epochs):
        for idx in local_batches(shard.n_total, batch_size, shard.start, shard.stop, epoch, seed):
            if len(idx) == 0:
                continue
            C.set_step(step)
            if w.timer.tracer is not None:
                w.timer.tracer.step, w.timer.tracer.epoch = step, epoch
            faults.apply(step, w)
            step += 1
            if not w.push(shard.X[idx], shard.y[idx], epoch):
                return  # the server stopped training: it already counts us as done
    w.msg[w.model.n_params + 3] = -1
    C.send(w.comm, w.msg, w.root, _PUSH)


def _server(comm, model, optimizer, root, max_staleness, policy: Policy,
            tracer=None) -> tuple[AsyncStats, str | None]:
    n, stats, version = model.n_params, AsyncStats(), np.zeros(1, np.int64)
    stop = np.array([_STOP], np.int64)
    error = None
    t0 = time.perf_counter()
    workers = [r for r in range(comm.size) if r != root]
    bufs = {w: np.zeros(n + 4, model.dtype) for w in workers}
    reqs = [C.irecv(comm, bufs[w], w, _PUSH)[0] for w in workers]  # one piece each
    active = len(workers)
    while active:
        t_wait = time.perf_counter()
        i = C.wait_any(reqs)
        t_got = time.perf_counter()
        w, msg = workers[i], bufs[workers[i]]
        if msg[n + 3] < 0:  # this worker is done
            active -= 1
            reqs[i] = C.MPI_REQUEST_NULL
            continue
        if error is not None:  # stopping: this worker is done once told
            C.send(comm, model.params, w, _PULL)
            C.send(comm, stop, w, _PULL)
            active -= 1
            reqs[i] = C.MPI_REQUEST_NULL
            continue
        stale = int(version[0] - msg[n + 3])
        applied = stale <= max_staleness
        if applied and policy.checks and not all_finite(msg[:n + 1]):
            try:
                applied = policy.apply(False, float(msg[n]), stats.applied + stats.dropped)
            except C.MpidpError as exc:
                error, applied = str(exc), False
            stats.skipped += error is None
        if applied:
            tot = stats.epoch_loss.setdefault(int(msg[n + 2]), [0.0, 0.0])
            tot[0] += float(msg[n])
            tot[1] += float(msg[n + 1])
            optimizer.step_(model.params, msg[:n], scale=1.0 / float(msg[n + 1]))
            version[0] += 1
            stats.applied += 1
            stats.staleness.append(stale)
        elif stale > max_staleness:
            stats.dropped += 1
        stats.trace.append((time.perf_counter() - t0, float(msg[n]), float(msg[n + 1]), stale,
                            applied, w))
        C.send(comm, model.params, w, _PULL)
        C.send(comm, stop if error is not None else version, w, _PULL)
        if tracer is not None:
            tracer.step = stats.applied + stats.dropped + stats.skipped
            tracer.add("wait for a push", "ps", "comm", t_wait, t_got)
            tracer.add("serve a push", "ps", "compute", t_got, time.perf_counter(), worker=w,
                       staleness=stale, applied=bool(applied))
        if error is not None:
            active -= 1
            reqs[i] = C.MPI_REQUEST_NULL
        else:
            reqs[i] = C.irecv(comm, msg, w, _PUSH)[0]
    return stats, error


def train_async(model: Sequential, optimizer: Optimizer, loss: Loss, comm: C.Comm, shard: Shard,
                epochs: int, batch_size: int, seed: int = 0, root: int = 0,
                max_staleness: int = 8, timer: StepTimer | None = None,
                on_nonfinite: str = "stop") -> AsyncStats:
    """Train asynchronously. Collective. ``shard`` on ``root`` is ignored (the server holds
    no data); workers split each global batch by their blocks, as in synchronous training,
    but update without waiting. Returns the server's :class:`AsyncStats` on every rank
    (summary only off root; the trace stays on root). A non-finite push meets
    ``on_nonfinite`` on the server: ``skip`` drops it (counted), ``stop`` tells every worker
    to stop and raises the same error on every rank. Parameters end identical on every
    rank (one ``Bcast``). A worker's ``timer`` (a :class:`mpidp.metrics.StepTimer`) records
    its compute and communication per push, and its ``slowdown`` makes it a straggler."""
    if comm.size < 2:
        raise C.MpidpError("async-ps needs at least 2 ranks (a server and a worker)")
    if model.n_params + 4 > C.MAX_COUNT:
        raise C.MpidpError("async-ps sends the parameters in one message: at most "
                           f"{C.MAX_COUNT - 4} parameters, got {model.n_params}")
    if max_staleness < 0:
        raise C.MpidpError(f"max staleness must be >= 0, got {max_staleness}")
    steps_per_epoch(shard.n_total, batch_size)  # validates batch_size
    C.bcast_(comm, model.params, root)
    policy, error = Policy(on_nonfinite), None
    if comm.rank == root:
        stats, error = _server(comm, model, optimizer, root, max_staleness, policy,
                               None if timer is None else timer.tracer)
    else:
        worker = _Worker(comm, model, loss, root, timer if timer is not None else StepTimer())
        _work(worker, shard, epochs, batch_size, seed)
        stats = AsyncStats()
    C.agree(comm, error)  # the NaN policy's stop reaches every rank as one error
    C.bcast_(comm, model.params, root)
    summary = C.bcast_obj(comm, stats.summary() | {"epoch_loss": stats.epoch_loss}, root)
    stats.applied, stats.dropped, stats.skipped = (summary[k] for k in ("applied", "dropped",
                                                                        "skipped"))
    stats.epoch_loss = summary["epoch_loss"]
    return stats
