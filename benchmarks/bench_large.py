"""Large messages: Bcast, Allreduce and a row Scatterv of buffers over 2 GiB, checked for
correctness, timed, with each rank's peak memory. Not run in CI (needs ~10 GB of RAM).

Run: mpiexec -n 2 python benchmarks/bench_large.py --gib 2.5 --out benchmarks/results/large.json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys

import numpy as np
from mpi4py import MPI

from mpidp import comm as C
from mpidp.data.partition import block_counts


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _timed(comm, fn) -> float:
    comm.Barrier()
    t = MPI.Wtime()
    fn()
    comm.Barrier()
    return MPI.Wtime() - t


def _bcast_allreduce(comm, n: int, results: dict) -> bool:
    buf = np.full(n, comm.rank + 1, np.int8) if comm.rank == 0 else np.zeros(n, np.int8)
    results["bcast_s"] = _timed(comm, lambda: C.bcast_(comm, buf))
    ok = bool(buf[0] == 1 and buf[-1] == 1 and buf[n // 2] == 1)
    buf[:] = 1
    results["allreduce_s"] = _timed(comm, lambda: C.allreduce_sum_(comm, buf))
    return ok and bool(buf[0] == comm.size and buf[-1] == comm.size and buf[n // 3] == comm.size)


def _scatter(comm, rows: int, results: dict) -> bool:
    counts = block_counts(rows, comm.size)
    full = None
    if comm.rank == 0:  # distinct rows, without materialising them: row i holds i mod 127
        full = np.broadcast_to((np.arange(rows) % 127).astype(np.int8)[:, None], (rows, 1024))
    out: list = []
    results["scatterv_s"] = _timed(comm, lambda: out.append(
        C.scatterv_rows(comm, full, counts, (1024,), np.int8)))
    start, mine = int(counts[:comm.rank].sum()), out[0]
    if len(mine) != counts[comm.rank]:
        return False
    return len(mine) == 0 or (mine[0, 0] == start % 127 and mine[-1, -1] == (start + len(mine) - 1) % 127)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.5, help="buffer size in GiB (int8 elements)")
    p.add_argument("--out", default=None, help="JSON results (rank 0)")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    n = int(args.gib * 2**30)  # int8: element count == byte count, beyond 2**31 - 1
    results = {"elements": n, "bytes": n, "exceeds_int32": n > 2**31 - 1, "ranks": comm.size,
               "max_count_per_call": C.MAX_COUNT, "mpi": C.mpi_info(comm)["library"]}
    ok = _bcast_allreduce(comm, n, results) & _scatter(comm, n // 1024, results)
    flags = comm.allgather(ok)
    peaks = comm.gather(_peak_rss_gib(), root=0)
    if comm.rank == 0:
        results.update(correct=all(flags), peak_rss_gib_per_rank=[round(x, 2) for x in peaks],
                       gib_per_s={k[:-2]: round(args.gib / results[k], 2)
                                  for k in ("bcast_s", "allreduce_s", "scatterv_s")})
        text = json.dumps(results, indent=2)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
    return 0 if all(flags) else 1


if __name__ == "__main__":
    sys.exit(main())
