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
from ..metrics import StepTimer
from ..nn import Loss, Optimizer, Sequential
from ..partition import local_batches, steps_per_epoch

_PUSH, _PULL = 11, 12
#: Columns of :attr:`AsyncStats.trace`: seconds since training started (server clock), the
#: push's loss sum and sample count, its staleness, whether it was applied, the worker.
TRACE_FIELDS = ("t", "loss_sum", "count", "staleness", "applied", "worker")


@dataclass
class AsyncStats:
    """What the server saw: applied and dropped pushes, staleness, per-epoch loss, and (on
    the server) one :data:`TRACE_FIELDS` row per push."""

    applied: int = 0
    dropped: int = 0
    staleness: list[int] = field(default_factory=list)
    epoch_loss: dict[int, list[float]] = field(default_factory=dict)  # epoch -> [sum, count]
    trace: list[tuple] = field(default_factory=list)

    def summary(self) -> dict:
        s = np.array(self.staleness or [0])
        return {"applied": self.applied, "dropped": self.dropped, "staleness_max": int(s.max()),
                "staleness_mean": float(s.mean())}


def _worker(comm, model, loss, shard, epochs, batch_size, seed, root, timer: StepTimer) -> None:
    n = model.n_params
    msg = np.zeros(n + 4, model.dtype)  # grads | loss sum | count | epoch | version (-1: done)
    version = np.zeros(1, np.int64)
    model.use_grad_buffer(msg)
    for epoch in range(epochs):
        for idx in local_batches(shard.n_total, batch_size, shard.start, shard.stop, epoch, seed):
            X, y = shard.X[idx], shard.y[idx]
            if len(X) == 0:
                continue
            with timer.compute():  # stretched by timer.slowdown (a simulated slower node)
                msg[n] = loss.forward(model.forward(X), y)
                model.backward(loss.backward(), input_grad=False)
            msg[n + 1:n + 4] = (len(X), epoch, version[0])
            with timer.communicate():
                C.send(comm, msg, root, _PUSH)
                C.recv_(comm, model.params, root, _PULL)  # fresh parameters...
                C.recv_(comm, version, root, _PULL)      # ...and their version
            timer.end_step(len(X))
    msg[n + 3] = -1
    C.send(comm, msg, root, _PUSH)


def _server(comm, model, optimizer, root, max_staleness) -> AsyncStats:
    n, stats, version = model.n_params, AsyncStats(), np.zeros(1, np.int64)
    t0 = time.perf_counter()
    workers = [r for r in range(comm.size) if r != root]
    bufs = {w: np.zeros(n + 4, model.dtype) for w in workers}
    reqs = [C.irecv(comm, bufs[w], w, _PUSH)[0] for w in workers]  # one piece each
    active = len(workers)
    while active:
        i = C.wait_any(reqs)
        w, msg = workers[i], bufs[workers[i]]
        if msg[n + 3] < 0:  # this worker is done
            active -= 1
            reqs[i] = C.MPI_REQUEST_NULL
            continue
        stale = int(version[0] - msg[n + 3])
        stats.staleness.append(stale)
        tot = stats.epoch_loss.setdefault(int(msg[n + 2]), [0.0, 0.0])
        tot[0] += float(msg[n])
        tot[1] += float(msg[n + 1])
        applied = stale <= max_staleness
        if applied:
            optimizer.step_(model.params, msg[:n], scale=1.0 / float(msg[n + 1]))
            version[0] += 1
            stats.applied += 1
        else:
            stats.dropped += 1
        stats.trace.append((time.perf_counter() - t0, float(msg[n]), float(msg[n + 1]), stale,
                            applied, w))
        C.send(comm, model.params, w, _PULL)
        C.send(comm, version, w, _PULL)
        reqs[i] = C.irecv(comm, msg, w, _PUSH)[0]
    return stats


def train_async(model: Sequential, optimizer: Optimizer, loss: Loss, comm: C.Comm, shard: Shard,
                epochs: int, batch_size: int, seed: int = 0, root: int = 0,
                max_staleness: int = 8, timer: StepTimer | None = None) -> AsyncStats:
    """Train asynchronously. Collective. ``shard`` on ``root`` is ignored (the server holds
    no data); workers split each global batch by their blocks, as in synchronous training,
    but update without waiting. Returns the server's :class:`AsyncStats` on every rank
    (summary only off root; the trace stays on root). Parameters end identical on every
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
    if comm.rank == root:
        stats = _server(comm, model, optimizer, root, max_staleness)
    else:
        _worker(comm, model, loss, shard, epochs, batch_size, seed, root,
                timer if timer is not None else StepTimer())
        stats = AsyncStats()
    C.bcast_(comm, model.params, root)
    summary = C.bcast_obj(comm, stats.summary() | {"epoch_loss": stats.epoch_loss}, root)
    stats.applied, stats.dropped = summary["applied"], summary["dropped"]
    stats.epoch_loss = summary["epoch_loss"]
    return stats
