"""The one loop's own cost per step: :func:`mpidp.fit` as ``mpidp train`` runs it (stop
signals installed, their request riding in the step's own Allreduce, the watchdog on, the
epoch's load-balance gather) against ``DataParallel.step`` called in a bare loop on the
same batches, on the standard workload (MLP 784-1024-1024-10, global batch 512). Run:
``mpiexec -n 2 python benchmarks/bench_loop.py`` (with one BLAS thread per rank); prints the
medians of 5 alternating repeats."""

from __future__ import annotations

import sys
import time

import numpy as np

import mpidp  # before numpy: BLAS threads per rank
from mpidp import nn
from mpidp.comm import Watchdog, world
from mpidp.data.balance import Plan
from mpidp.run.signals import StopSignals

BATCH, STEPS = 512, 40


def _dp(comm):
    model = nn.mlp(784, (1024, 1024), 10).init_(0)
    return mpidp.DataParallel(model, nn.SGD(0.05), nn.SoftmaxCrossEntropy(), comm)


def bare(comm, shard) -> float:
    dp = _dp(comm)
    batches = list(Plan(comm, None, shard.n_total, BATCH, 0).batches(shard, 0, dp.timer))
    mpidp.comm.barrier(comm)
    t = time.perf_counter()
    for X, y in batches:
        dp.step(X, y)
    mpidp.comm.barrier(comm)
    return (time.perf_counter() - t) / len(batches)


def looped(comm, shard) -> float:
    dp, stop, watchdog = _dp(comm), StopSignals(comm), Watchdog(comm, None)
    mpidp.comm.barrier(comm)
    t = time.perf_counter()
    mpidp.fit(dp, shard, 1, BATCH, seed=0, stop=stop, watchdog=watchdog)
    mpidp.comm.barrier(comm)
    stop.close()
    watchdog.stop()
    return (time.perf_counter() - t) / STEPS


def main(argv=None) -> int:
    comm = world()
    rng = np.random.default_rng(0)
    X = rng.standard_normal((BATCH * STEPS, 784)).astype(np.float32)
    y = rng.integers(0, 10, BATCH * STEPS)
    shard = mpidp.shard_from_arrays(comm, X[comm.rank::comm.size], y[comm.rank::comm.size])
    times = {"bare": [], "loop": []}
    for r in range(5):  # alternate which goes first
        order = (("bare", bare), ("loop", looped)) if r % 2 == 0 else (("loop", looped),
                                                                       ("bare", bare))
        for name, f in order:
            times[name].append(f(comm, shard))
    if comm.rank == 0:
        b, lo = np.median(times["bare"]), np.median(times["loop"])
        print(f"P={comm.size}: DataParallel.step in a bare loop {b * 1e3:.2f} ms/step; "
              f"fit with signals, watchdog and balance gather {lo * 1e3:.2f} ms/step; "
              f"ratio {lo / b:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
