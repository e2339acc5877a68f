"""Asynchronous against synchronous parameter server on the standard workload, with and
without a straggler: one MPI job of ``make bench-sync``.

Run: mpiexec -n 3 python benchmarks/bench_async.py --out async.json

Rank 0 serves and holds no data; the other ranks work, each owning a block of the training
set and its share of every global batch of 512. Four runs start from the same parameters:
synchronous (``ps``, dedicated server: every step waits for every worker) and asynchronous
(``async-ps``: the server applies each push as it comes), each with all workers at full
speed and with the last worker ``--slowdown`` times slower (its forward/backward stretched
by sleeping, as ``mpidp train --slowdown`` does). Rank 0 writes, per run, the loss trace
(server clock, loss, samples), samples/s, staleness and test figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

import mpidp
from benchmarks.bench_step import HIDDEN, environment
from benchmarks.harness import quick_defaults
from mpidp import nn
from mpidp.data.partition import local_batches
from mpidp.observe.metrics import StepTimer
from mpidp.parallel.async_ps import TRACE_FIELDS, AsyncPS, fit_async
from mpidp.parallel.modes import make_sync

MODES = ("sync", "async")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON results (rank 0)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=512, help="global batch")
    p.add_argument("--n-samples", type=int, default=60000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--slowdown", type=float, default=2.0, help="the last worker's slowdown")
    p.add_argument("--max-staleness", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    quick_defaults(p, epochs=1, n_samples=4000)
    return p.parse_args(argv)


def load(comm: MPI.Comm, args) -> tuple[mpidp.Shard, mpidp.Shard]:
    """Train and test shards: the workers split the data; the server gets empty shards."""
    workers = comm.Split(0 if comm.rank else 1, comm.rank)
    data = None
    if comm.rank:
        data = mpidp.load(workers, "synthetic", n_samples=args.n_samples, n_features=784,
                          n_classes=10, distribute="local", test_fraction=0.1, seed=args.seed)
    n_train, n_test = comm.bcast(None if data is None else
                                 (data.train.n_total, data.test.n_total), root=1)
    workers.Free()
    if data is not None:
        return data.train, data.test
    empty = lambda n: mpidp.Shard(np.empty((0, 784), np.float32), np.empty(0, np.int64), 0, n)
    return empty(n_train), empty(n_test)


def evaluate(comm: MPI.Comm, model: nn.Sequential, test: mpidp.Shard) -> dict:
    """Test loss and accuracy of ``model`` (equal on every rank) over every rank's test rows."""
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm)
    ev = dp.evaluate(test.X, test.y)
    return {"test_loss": ev.loss, "test_accuracy": ev.accuracy}


def run_sync(comm, train, test, init, args, slowdown: float) -> dict:
    """Synchronous dedicated-server training; the trace is one row per global step."""
    model = nn.mlp(784, HIDDEN, 10, dtype=np.float32)
    model.params[...] = init
    dp = mpidp.DataParallel(model, nn.SGD(args.lr), nn.SoftmaxCrossEntropy(), comm,
                            sync=make_sync("ps", dedicated=True))
    dp.timer.slowdown = slowdown
    trace = []
    comm.Barrier()
    t0 = MPI.Wtime()
    for epoch in range(args.epochs):
        for idx in local_batches(train.n_total, args.batch_size, train.start, train.stop,
                                 epoch, args.seed):
            s = dp.step(train.X[idx], train.y[idx])
            trace.append((MPI.Wtime() - t0, s.loss_sum, s.count))
    comm.Barrier()
    wall = MPI.Wtime() - t0
    return {"wall_s": wall, "trace": trace, **evaluate(comm, model, test)}


def run_async(comm, train, test, init, args, slowdown: float) -> dict:
    """Asynchronous training; the trace is one row per push, on the server's clock."""
    model = nn.mlp(784, HIDDEN, 10, dtype=np.float32)
    model.params[...] = init
    comm.Barrier()
    t0 = MPI.Wtime()
    ps = AsyncPS(model, nn.SGD(args.lr), nn.SoftmaxCrossEntropy(), comm, args.max_staleness,
                 timer=StepTimer(slowdown=slowdown))
    stats = fit_async(ps, train, args.epochs, args.batch_size, seed=args.seed)
    comm.Barrier()
    wall = MPI.Wtime() - t0
    trace = [(t, loss, count) for t, loss, count, *_ in stats.trace]
    return {"wall_s": wall, "trace": trace, "pushes": stats.trace, **stats.summary(),
            **evaluate(comm, model, test)}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    mpidp.abort_on_error()
    if comm.size < 3:
        raise mpidp.MpidpError("bench_async needs >= 3 ranks: a server and two workers")
    train, test = load(comm, args)
    init = nn.mlp(784, HIDDEN, 10).init_(args.seed).params
    runs = {}
    for name, slow in (("equal", 1.0), ("straggler", args.slowdown)):
        me = slow if comm.rank == comm.size - 1 else 1.0
        runs[f"sync-{name}"] = run_sync(comm, train, test, init, args, me)
        runs[f"async-{name}"] = run_async(comm, train, test, init, args, me)
    if comm.rank == 0:
        out = {"world_size": comm.size, "workers": comm.size - 1, "epochs": args.epochs,
               "batch_size": args.batch_size, "slowdown": args.slowdown,
               "max_staleness": args.max_staleness, "trace_fields": list(TRACE_FIELDS),
               "runs": runs, "environment": environment(comm)}
        with open(args.out, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
