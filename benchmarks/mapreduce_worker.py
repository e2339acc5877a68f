"""One map/reduce timing job (run by bench_partition.py under mpiexec): the bag-of-words rows
(work proportional to non-zeros) through a sparse layer, summed; static strategies vs the
dynamic counter, all with the same rows per chunk (argv[1]; the work of a row depends on the
chunk size, since the temporaries grow with it). Per mode: median wall seconds, median CPU
makespan (the largest per-rank CPU time: the measure under oversubscription) and CPU
imbalance. Rank 0 prints one JSON line."""

from __future__ import annotations

import json
import sys

import numpy as np
from mpi4py import MPI

import mpidp  # noqa: F401  (BLAS threads before numpy)
from mpidp.data.sources import BowSource
from mpidp.parallel.mapreduce import map_reduce


def main(argv: list[str]) -> None:
    comm = MPI.COMM_WORLD
    repeats = int(argv[0]) if argv else 3
    chunk = int(argv[1]) if len(argv) > 1 else 16
    src = BowSource(16000, 2000, seed=0)
    X = src.read(np.arange(src.n_samples))[0]  # every rank: same rows, outside the timing
    W = np.random.default_rng(0).standard_normal((2000, 128))

    def fn(R):
        terms = W[R.indices] * R.data[:, None]
        out = np.zeros((len(R), W.shape[1]))
        filled = R.row_lengths() > 0
        out[filled] = np.add.reduceat(terms, R.indptr[:-1][filled], axis=0)
        return np.tanh(out)

    modes = {"block": dict(partition="block"), "cyclic": dict(partition="cyclic"),
             "cost": dict(partition="cost", costs=src.costs()),
             "dynamic": dict(dynamic=True)}
    map_reduce(comm, fn, X, "sum", chunk_size=chunk, dynamic=True)  # warm-up, not timed
    result = {}
    for name, kw in modes.items():
        times, makespan, cpu_imb = [], [], []
        for _ in range(repeats):
            res = map_reduce(comm, fn, X, "sum", chunk_size=chunk, **kw)
            times.append(res.seconds)
            cpu = [r["compute_cpu_s"] for r in res.per_rank]
            makespan.append(max(cpu))
            cpu_imb.append(max(cpu) / np.mean(cpu))
        result[name] = {"seconds": float(np.median(times)),
                        "cpu_makespan": float(np.median(makespan)),
                        "imbalance_cpu": float(np.median(cpu_imb)), "chunk_size": chunk,
                        "samples": [r["samples"] for r in res.per_rank]}
    if comm.rank == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
