"""One MPI job of ``make bench-sync``: every synchronisation mode on the standard workload.

Run: mpiexec -n P python benchmarks/bench_sync.py --out results.json [--weak]
Strong scaling: global batch 512 over P ranks; ``--weak``: 256 samples per rank. Fused
allreduce and the hand-written loop also run ``--pair-repeats`` times back to back (in turns
first), and their paired ratio is the median of the per-pair ratios.

``--only`` times exactly the modes listed (``handwritten`` among them if wanted: no extra
pairs); ``--shuffle SEED`` runs each repeat's modes in an order drawn from SEED and the
repeat number. A mode whose strategy cannot be made here is skipped with its reason (in the
JSON's ``skipped``). ``--marks DIR``: rank 0 announces each timed run on the FIFO
``DIR/req`` (``start LABEL``, then ``stop LABEL``) and waits for a line on ``DIR/ack``, so
that a process outside the job can read counters (a link's bytes) around exactly the timed
steps.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

import mpidp
from benchmarks.bench_step import HIDDEN, comm_share, environment, timed_run, warm_up
from benchmarks.handwritten_dp import HandwrittenDP
from benchmarks.handwritten_dp import local_batches as hw_local_batches
from benchmarks.harness import alternate, paired_ratio
from benchmarks.sync_modes import EXTRA_MODES, MODES
from mpidp import nn
from mpidp.data.partition import local_batches
from mpidp.parallel import modes
from mpidp.parallel.compress import Compressed
from mpidp.parallel.modes import make_sync
from mpidp.parallel.ps import ParameterServer
from mpidp.parallel.sync import Sync

MAX_TRIAL_STEPS = 200  # untimed steps allowed for auto to commit to a strategy


class ComputeOnly(Sync):
    """Not a training mode: each rank updates from its own gradient and exchanges nothing,
    but waits for the others at a ``Barrier`` each step, as every synchronous step waits
    for the slowest rank. Its step time is the floor any synchronisation mode could reach
    on this machine (the ranks still share its cores and memory bandwidth), which bounds
    every speed-up claim."""

    name = "compute-only"

    def reduce(self) -> None:
        self.comm.Barrier()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON results (rank 0)")
    p.add_argument("--weak", action="store_true", help="256 samples per rank (weak scaling)")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated modes, of {MODES + EXTRA_MODES}")
    p.add_argument("--only", action="store_true",
                   help="time only --modes: no hand-written loop unless named, no pair repeats")
    p.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                   help="each repeat in an order shuffled by SEED and the repeat (default: as listed)")
    p.add_argument("--marks", default=None, metavar="DIR",
                   help="announce each timed run on the FIFOs DIR/req and DIR/ack (rank 0)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pair-repeats", type=int, default=7,
                   help="runs of fused allreduce and the hand-written loop back to back (at "
                   "least --repeats; the extra ones follow all modes), for the paired ratio")
    p.add_argument("--n-samples", type=int, default=60000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = sorted(set(args.modes) - set(MODES + EXTRA_MODES))
    if unknown:
        p.error(f"unknown mode(s) {unknown}; choose from {MODES + EXTRA_MODES}")
    if "handwritten" in args.modes and not args.only:
        p.error("handwritten runs beside allreduce by itself; name it in --modes only with --only")
    args.n_features, args.n_classes, args.lr = 784, 10, 0.05
    return args


class Marks:
    """Rank 0's side of ``--marks DIR``: ``mark(line)`` writes ``line`` to the FIFO
    ``DIR/req`` and returns once the reader answers a line on ``DIR/ack``. Without a
    folder (or off rank 0) it does nothing."""

    def __init__(self, folder: str | None, rank: int) -> None:
        self.req = self.ack = None
        if folder and rank == 0:
            self.req = open(f"{folder}/req", "w", buffering=1)
            self.ack = open(f"{folder}/ack")

    def __call__(self, line: str) -> None:
        if self.req is not None:
            self.req.write(line + "\n")
            if not self.ack.readline():
                raise RuntimeError(f"--marks: no reader answered {line!r} (it ended)")


def marked_run(comm, step, shard, batches, args, label: str) -> tuple[dict, float]:
    """:func:`bench_step.timed_run` between the marks ``start label`` and ``stop label``."""
    args.mark(f"start {label}")
    result = timed_run(comm, step, shard.X, shard.y, batches, args.steps)
    args.mark(f"stop {label}")
    result[0]["mark"] = label
    return result


def _sync_for(mode: str):
    if mode == "compute-only":
        return ComputeOnly()
    if mode == "auto":
        return make_sync("auto")
    if mode in ("allreduce-flat", "allreduce-node"):
        return make_sync("allreduce", node_aware=mode == "allreduce-node")
    if mode == "ps-dedicated":
        return make_sync("ps", dedicated=True)
    if mode == "compressed-int8":
        return make_sync("compressed", codec="int8", bucket_bytes=1 << 20)
    if mode == "compressed-numpy":
        return Compressed("bfloat16", bucket_bytes=1 << 20, kernels="numpy")
    if mode == "overlapped-forward":  # half-MiB buckets: finer parts for the next forward to read
        return make_sync("overlapped", bucket_bytes=1 << 19, finish="forward")
    if mode == "ps-bcast":  # the server's parameters sent by one Bcast, not shared memory
        return ParameterServer(shared_memory=False)
    own = modes.MODES[mode].fields  # the same bucket size and period wherever a mode has them
    return make_sync(mode, lambda: nn.SGD(0.05), **{k: v for k, v in
                                                    {"bucket_bytes": 1 << 20, "k": 4}.items()
                                                    if k in own})


def unavailable(comm, mode: str) -> str | None:
    """Why ``mode``'s strategy cannot be made here (on some rank), or None. Collective."""
    if mode == "handwritten":
        return None
    try:
        _sync_for(mode)
        reason = None
    except Exception as e:  # a mode this version of mpidp does not have (or not so)
        reason = f"{type(e).__name__}: {e}"
    return next((r for r in comm.allgather(reason) if r), None)


def run_mode(comm, shard, init, mode: str, args, label: str = "") -> dict:
    """Time ``DataParallel.step`` with sync ``mode``; the dedicated server gets no rows."""
    model = nn.mlp(784, HIDDEN, 10, dtype=np.float32)
    model.params[...] = init
    # finishing in forward applies parts before the whole gradient is known: no NaN check
    dp = mpidp.DataParallel(model, nn.SGD(args.lr), nn.SoftmaxCrossEntropy(), comm,
                            sync=_sync_for(mode),
                            on_nonfinite="ignore" if mode == "overlapped-forward" else "stop")
    n = shard.n_total
    start, stop = shard.start, shard.stop
    if mode == "ps-dedicated":  # the server's block is empty; workers keep theirs
        start, stop = (0, 0) if comm.rank == 0 else (start, stop)
    batches = itertools.chain.from_iterable(
        local_batches(n, args.batch_size, start, stop, e, args.seed) for e in itertools.count())
    warm_up(dp.step, shard.X, shard.y, batches, args.warmup)
    for _ in range(MAX_TRIAL_STEPS):  # auto picks on its first steps: untimed until it has
        if getattr(dp.sync, "choice", True) is not None:
            break
        warm_up(dp.step, shard.X, shard.y, batches, 1)
    c0, m0, b0, s0 = dp.timer.compute_s, dp.timer.comm_s, dp.sync.bytes_sent, dp.global_step
    # a step whose last sums finish during the next forward pass starts with the previous
    # step's and leaves its own: the timed steps each carry one step's exchange
    result, _ = marked_run(comm, dp.step, shard, batches, args, label or mode)
    dp.settle()
    chosen = getattr(dp.sync, "choice", None) or dp.sync
    result["sync"] = getattr(chosen, "name", type(chosen).__name__)
    if getattr(chosen, "codec", None) == "int8":  # the mode of that name here
        result["sync"] = "compressed-int8"
    elif mode == "compressed-numpy":
        result["sync"] = mode
    if getattr(dp.sync, "report", ""):
        result["sync_report"] = dp.sync.report
    busy = dp.timer.compute_s - c0 + dp.timer.comm_s - m0
    result["comm_share"] = float(np.mean(comm.allgather((dp.timer.comm_s - m0) / busy if busy else 0)))
    sent = comm.allgather((dp.sync.bytes_sent - b0) / max(dp.global_step - s0, 1))
    result["bytes_per_step"], result["rank_bytes_per_step"] = float(np.mean(sent)), sent
    return result


def run_handwritten(comm, shard, init, args, label: str = "handwritten") -> dict:
    """Time :class:`handwritten_dp.HandwrittenDP` on the same rows, batches and start."""
    hw = HandwrittenDP(comm, (784, *HIDDEN, 10), args.lr, args.seed)
    hw.params[...] = init
    batches = hw_local_batches(shard.n_total, args.batch_size, shard.start, shard.stop, args.seed)
    warm_up(hw.step, shard.X, shard.y, batches, args.warmup)
    comm0 = hw.comm_s
    result, busy_s = marked_run(comm, hw.step, shard, batches, args, label)
    result.update(comm_share(comm, busy_s, hw.comm_s - comm0))
    result["bytes_per_step"] = float(hw.buf.nbytes)  # one Allreduce of the whole buffer
    result["rank_bytes_per_step"] = [result["bytes_per_step"]] * comm.size
    return result


def _order(modes: list[str], seed: int | None, r: int) -> list[str]:
    """Repeat ``r``'s order: as listed, or shuffled by ``seed`` and ``r``."""
    if seed is None:
        return list(modes)
    order = list(modes)
    random.Random(f"{seed}:{r}").shuffle(order)
    return order


def run_only(comm, shard, init, modes: list[str], args) -> dict[str, list[dict]]:
    """``--only``: ``args.repeats`` runs of each of ``modes``, nothing else."""
    results: dict = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode in _order(modes, args.shuffle, r):
            label = f"{mode} {r}"
            results[mode].append(run_handwritten(comm, shard, init, args, label)
                                 if mode == "handwritten"
                                 else run_mode(comm, shard, init, mode, args, label))
    return results


def run_all(comm, shard, init, modes: list[str], args) -> dict[str, list[dict]]:
    """Every mode ``args.repeats`` times, the hand-written loop next to fused allreduce."""
    results: dict = {m: [] for m in modes}
    results["handwritten"] = []
    hand = lambda r: run_handwritten(comm, shard, init, args, f"handwritten {r}")
    for r in range(args.repeats):
        for mode in _order(modes, args.shuffle, r):
            # the 5% target compares fused allreduce with the hand-written loop: run them
            # back to back, in turns first (as make bench does), so neither always leads
            if mode == "allreduce" and r % 2:
                results["handwritten"].append(hand(r))
            results[mode].append(run_mode(comm, shard, init, mode, args, f"{mode} {r}"))
            if mode == "allreduce" and not r % 2:
                results["handwritten"].append(hand(r))
        if "allreduce" not in modes:
            results["handwritten"].append(hand(r))
    pair = {"allreduce": lambda r: run_mode(comm, shard, init, "allreduce", args, f"allreduce {r}"),
            "handwritten": hand}
    for got in alternate(pair, args.pair_repeats if "allreduce" in modes else 0, args.repeats):
        for name, run in got.items():
            results[name].append(run)
    return results


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
    modes = [m for m in args.modes if comm.size > 1 or not m.startswith("ps")]
    skipped = {m: why for m in modes if (why := unavailable(comm, m))}
    for mode, why in skipped.items():
        if comm.rank == 0:
            print(f"bench_sync: {mode} skipped: {why}", flush=True)
    modes = [m for m in modes if m not in skipped]
    args.mark = Marks(args.marks, comm.rank)
    results = (run_only if args.only else run_all)(comm, shard, init, modes, args)
    summary = {}
    for mode, runs in results.items():
        step = statistics.median(x["step_s"] for x in runs)
        summary[mode] = {"step_ms": step * 1e3, "samples_per_s": args.batch_size / step,
                         "comm_share": statistics.median(x["comm_share"] for x in runs),
                         "bytes_per_step": runs[0].get("bytes_per_step"), "repeats": runs}
    if "allreduce" in results and not args.only:  # the i-th runs of the two ran back to back
        summary["allreduce"]["paired_ratio_to_handwritten"] = paired_ratio(
            [a["step_s"] for a in results["allreduce"]], [h["step_s"] for h in results["handwritten"]])
    if comm.rank == 0:
        out = {"world_size": comm.size, "batch_size": args.batch_size, "weak": args.weak,
               "steps": args.steps, "repeats": args.repeats, "modes": summary,
               "skipped": skipped, "shuffle": args.shuffle,
               "environment": environment(comm)}
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
