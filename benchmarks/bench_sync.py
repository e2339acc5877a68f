"""One MPI job of ``make bench-sync``: every synchronisation mode on the standard workload.

Run: mpiexec -n P python benchmarks/bench_sync.py --out results.json [--weak]
Strong scaling: global batch 512 over P ranks; ``--weak``: 256 samples per rank. Fused
allreduce and the hand-written loop also run ``--pair-repeats`` times back to back (in turns
first), and their paired ratio is the median of the per-pair ratios.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from collections.abc import Sequence

import numpy as np
from bench_step import HIDDEN, environment, run_handwritten, timed_run, warm_up
from mpi4py import MPI

import mpidp
from mpidp import nn
from mpidp.data.partition import local_batches
from mpidp.parallel.ps import ParameterServer
from mpidp.parallel.strategies import make_sync
from mpidp.parallel.sync import Sync

MODES = ("allreduce", "per-layer", "overlapped", "compressed", "ps", "ps-bcast", "ps-dedicated",
         "sharded-ps", "accumulate", "local-sgd", "compute-only")


class ComputeOnly(Sync):
    """Not a training mode: each rank updates from its own gradient and never communicates.
    Its step time is the floor any synchronisation mode could reach on this machine (the
    ranks still share its cores and memory bandwidth), which bounds every speed-up claim."""

    name = "compute-only"

    def reduce(self) -> None:
        pass


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON results (rank 0)")
    p.add_argument("--weak", action="store_true", help="256 samples per rank (weak scaling)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pair-repeats", type=int, default=7,
                   help="runs of fused allreduce and the hand-written loop back to back (at "
                   "least --repeats; the extra ones follow all modes), for the paired ratio")
    p.add_argument("--n-samples", type=int, default=60000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.n_features, args.n_classes, args.lr = 784, 10, 0.05
    return args


def _sync_for(mode: str):
    if mode == "compute-only":
        return ComputeOnly()
    if mode == "ps-dedicated":
        return make_sync("ps", dedicated=True)
    if mode == "ps-bcast":  # the server's parameters sent by one Bcast, not shared memory
        return ParameterServer(shared_memory=False)
    return make_sync(mode, lambda: nn.SGD(0.05), bucket_bytes=1 << 20, k=4)


def run_mode(comm, shard, init, mode: str, args) -> dict:
    """Time ``DataParallel.step`` with sync ``mode``; the dedicated server gets no rows."""
    model = nn.mlp(784, HIDDEN, 10, dtype=np.float32)
    model.params[...] = init
    dp = mpidp.DataParallel(model, nn.SGD(args.lr), nn.SoftmaxCrossEntropy(), comm,
                            sync=_sync_for(mode))
    n = shard.n_total
    start, stop = shard.start, shard.stop
    if mode == "ps-dedicated":  # the server's block is empty; workers keep theirs
        start, stop = (0, 0) if comm.rank == 0 else (start, stop)
    batches = itertools.chain.from_iterable(
        local_batches(n, args.batch_size, start, stop, e, args.seed) for e in itertools.count())
    warm_up(dp.step, shard.X, shard.y, batches, args.warmup)
    c0, m0, b0, s0 = dp.timer.compute_s, dp.timer.comm_s, dp.sync.bytes_sent, dp.global_step
    result, _ = timed_run(comm, dp.step, shard.X, shard.y, batches, args.steps)
    busy = dp.timer.compute_s - c0 + dp.timer.comm_s - m0
    result["comm_share"] = float(np.mean(comm.allgather((dp.timer.comm_s - m0) / busy if busy else 0)))
    result["bytes_per_step"] = float(np.mean(comm.allgather(
        (dp.sync.bytes_sent - b0) / max(dp.global_step - s0, 1))))
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    args.batch_size = 256 * comm.size if args.weak else 512
    # ps-dedicated: the server's rows are not trained on, so the data has P-1 workers' rows
    data = mpidp.load(comm, "synthetic", n_samples=args.n_samples, n_features=784, n_classes=10,
                      distribute="local", test_fraction=0.0, seed=args.seed)
    shard = data.train
    init = nn.mlp(784, HIDDEN, 10).init_(args.seed).params
    comm.Bcast(init, root=0)
    modes = [m for m in args.modes.split(",") if comm.size > 1 or not m.startswith("ps")]
    results: dict = {m: [] for m in modes}
    results["handwritten"] = []
    for r in range(args.repeats):
        for mode in modes:
            # the 5% target compares fused allreduce with the hand-written loop: run them
            # back to back, in turns first (as make bench does), so neither always leads
            if mode == "allreduce" and r % 2:
                results["handwritten"].append(run_handwritten(comm, shard, init, args)[0])
            results[mode].append(run_mode(comm, shard, init, mode, args))
            if mode == "allreduce" and not r % 2:
                results["handwritten"].append(run_handwritten(comm, shard, init, args)[0])
        if "allreduce" not in modes:
            results["handwritten"].append(run_handwritten(comm, shard, init, args)[0])
    for r in range(args.repeats, args.pair_repeats if "allreduce" in modes else 0):
        pair = (("allreduce", lambda: run_mode(comm, shard, init, "allreduce", args)),
                ("handwritten", lambda: run_handwritten(comm, shard, init, args)[0]))
        for name, run in pair[::-1] if r % 2 else pair:
            results[name].append(run())
    summary = {}
    for mode, runs in results.items():
        step = statistics.median(x["step_s"] for x in runs)
        summary[mode] = {"step_ms": step * 1e3, "samples_per_s": args.batch_size / step,
                         "comm_share": statistics.median(x["comm_share"] for x in runs),
                         "bytes_per_step": runs[0].get("bytes_per_step"), "repeats": runs}
    if "allreduce" in modes:  # the i-th runs of the two ran back to back
        summary["allreduce"]["paired_ratio_to_handwritten"] = statistics.median(
            a["step_s"] / h["step_s"] for a, h in zip(results["allreduce"], results["handwritten"]))
    if comm.rank == 0:
        out = {"world_size": comm.size, "batch_size": args.batch_size, "weak": args.weak,
               "steps": args.steps, "repeats": args.repeats, "modes": summary,
               "environment": environment(comm)}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
