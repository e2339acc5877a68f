"""Step time of mpidp's data-parallel training against a hand-written mpi4py + NumPy loop.

Run under ``mpiexec -n P python benchmarks/bench_step.py --out results.json``. The standard
workload (docs/benchmarks.md): MLP 784 -> 1024 -> 1024 -> 10, ReLU, softmax cross-entropy, SGD lr
0.05, float32; synthetic MNIST-shaped data 60,000 x 784, 10 classes, fixed seed; global
batch 512 split over the P ranks; warm-up steps, then measured steps timed between
barriers with ``MPI.Wtime`` (the slowest rank's time). mpidp and the hand-written loop run
alternately in the same job, from the same initial parameters on the same local rows and
global batches, ``--repeats`` times each; the medians are reported. Rank 0 writes JSON.

mpidp is driven exactly as :func:`mpidp.fit` drives it: ``DataParallel.step`` on
``X[idx], y[idx]`` for each ``idx`` of :func:`mpidp.data.partition.local_batches`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from mpi4py import MPI

import mpidp
from benchmarks.handwritten_dp import HandwrittenDP
from benchmarks.handwritten_dp import local_batches as hw_local_batches
from benchmarks.harness import alternate, blas_info
from mpidp import nn
from mpidp.data.partition import local_batches

HIDDEN = (1024, 1024)
OPENBLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
IMPLS = ("mpidp", "handwritten")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results file (written by rank 0)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each implementation")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each timed run")
    p.add_argument("--steps", type=int, default=60, help="timed steps per run")
    p.add_argument("--batch-size", type=int, default=512, help="GLOBAL batch size")
    p.add_argument("--n-samples", type=int, default=60000, help="synthetic training samples")
    p.add_argument("--n-features", type=int, default=784)
    p.add_argument("--n-classes", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0, help="data, initialisation and shuffling seed")
    p.add_argument("--on-nonfinite", default="stop", choices=("stop", "skip", "ignore"),
                   help="mpidp's NaN/Inf policy; 'ignore' skips its one pass over the reduced "
                   "buffer, doing exactly the hand-written loop's work")
    args = p.parse_args(argv)
    if min(args.repeats, args.steps, args.batch_size) < 1 or args.warmup < 0:
        p.error("--repeats, --steps and --batch-size must be >= 1, --warmup >= 0")
    return args


# --- what ran where ---------------------------------------------------------------------

def environment(comm: MPI.Comm) -> dict:
    vendor, version = MPI.get_vendor()
    return {
        "mpi_library": MPI.Get_library_version().strip().splitlines()[0].strip(),
        "mpi_vendor": f"{vendor} {'.'.join(map(str, version))}",
        "mpi4py": __import__("mpi4py").__version__,
        "numpy": np.__version__,
        "mpidp": mpidp.__version__,
        "python": platform.python_version(),
        "host": MPI.Get_processor_name(),
        "world_size": comm.size,
        "blas": blas_info(),
        "openblas_env_set": {v: v in os.environ for v in OPENBLAS_VARS},
        "thread_env": {v: os.environ.get(v) for v in THREAD_VARS},
    }


# --- one timed run ----------------------------------------------------------------------

def warm_up(step: Callable, X: np.ndarray, y: np.ndarray, batches: Iterator, n: int) -> None:
    """``n`` untimed steps (first-touch of buffers, BLAS and MPI warm-up)."""
    for idx in itertools.islice(batches, n):
        step(X[idx], y[idx])


def timed_run(comm: MPI.Comm, step: Callable, X: np.ndarray, y: np.ndarray,
              batches: Iterator, steps: int) -> tuple[dict, float]:
    """``steps`` timed calls ``step(X[idx], y[idx])``, one per ``idx`` of ``batches``. Collective.

    Returns the slowest rank's seconds per step (between barriers) with every rank's
    median and 90th percentile single-step wall time, and this rank's seconds inside ``step``.
    """
    per_step = np.empty(steps)
    comm.Barrier()
    t0 = MPI.Wtime()
    for i, idx in enumerate(itertools.islice(batches, steps)):
        Xb, yb = X[idx], y[idx]
        t = MPI.Wtime()
        step(Xb, yb)
        per_step[i] = MPI.Wtime() - t
    comm.Barrier()
    elapsed = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)
    return {"step_s": elapsed / steps,
            "rank_step_p50_s": comm.allgather(float(np.median(per_step))),
            "rank_step_p90_s": comm.allgather(float(np.percentile(per_step, 90)))}, float(per_step.sum())


def comm_share(comm: MPI.Comm, busy_s: float, comm_s: float) -> dict:
    """Share of the time inside ``step`` spent communicating, per rank and averaged. Collective."""
    shares = comm.allgather(comm_s / busy_s if busy_s else 0.0)
    return {"comm_share": float(np.mean(shares)), "rank_comm_share": shares}


def run_mpidp(comm: MPI.Comm, shard: mpidp.Shard, init: np.ndarray, args) -> tuple[dict, np.ndarray]:
    """Time ``DataParallel.step`` fed by :func:`mpidp.data.partition.local_batches`, as ``fit`` does."""
    model = nn.mlp(args.n_features, HIDDEN, args.n_classes, dtype=np.float32)
    model.params[...] = init
    dp = mpidp.DataParallel(model, nn.SGD(args.lr), nn.SoftmaxCrossEntropy(), comm,
                            on_nonfinite=args.on_nonfinite)
    batches = itertools.chain.from_iterable(
        local_batches(shard.n_total, args.batch_size, shard.start, shard.stop, epoch, args.seed)
        for epoch in itertools.count())
    warm_up(dp.step, shard.X, shard.y, batches, args.warmup)
    compute0, comm0 = dp.timer.compute_s, dp.timer.comm_s
    result, _ = timed_run(comm, dp.step, shard.X, shard.y, batches, args.steps)
    compute_s, comm_s = dp.timer.compute_s - compute0, dp.timer.comm_s - comm0
    result.update(comm_share(comm, compute_s + comm_s, comm_s))
    return result, model.params.copy()


def run_handwritten(comm: MPI.Comm, shard: mpidp.Shard, init: np.ndarray,
                    args) -> tuple[dict, np.ndarray]:
    """Time :class:`handwritten_dp.HandwrittenDP` on the same rows, batches and start."""
    sizes = (args.n_features, *HIDDEN, args.n_classes)
    hw = HandwrittenDP(comm, sizes, args.lr, args.seed)
    hw.params[...] = init
    batches = hw_local_batches(shard.n_total, args.batch_size, shard.start, shard.stop, args.seed)
    warm_up(hw.step, shard.X, shard.y, batches, args.warmup)
    comm0 = hw.comm_s
    result, busy_s = timed_run(comm, hw.step, shard.X, shard.y, batches, args.steps)
    result.update(comm_share(comm, busy_s, hw.comm_s - comm0))
    return result, hw.params.copy()


# --- the job ----------------------------------------------------------------------------

def summarise(runs: list[dict], batch_size: int) -> dict:
    step_s = statistics.median(r["step_s"] for r in runs)
    return {"step_s": step_s, "step_ms": step_s * 1e3, "steps_per_s": 1 / step_s,
            "samples_per_s": batch_size / step_s,
            "comm_share": statistics.median(r["comm_share"] for r in runs), "repeats": runs}


def measure(comm: MPI.Comm, shard: mpidp.Shard, args) -> tuple[dict, list[float]]:
    """Alternate mpidp and the hand-written loop ``args.repeats`` times (the order flips each
    repeat); both start from the same parameters. Collective."""
    init = nn.mlp(args.n_features, HIDDEN, args.n_classes).init_(args.seed).params
    comm.Bcast(init, root=0)
    runners = {"mpidp": run_mpidp, "handwritten": run_handwritten}
    runs: dict[str, list[dict]] = {name: [] for name in IMPLS}
    diffs = []
    for got in alternate({n: lambda r, n=n: runners[n](comm, shard, init, args) for n in IMPLS},
                         args.repeats):
        for name in IMPLS:
            runs[name].append(got[name][0])
        diff = float(np.max(np.abs(got["mpidp"][1] - got["handwritten"][1])))
        diffs.append(comm.allreduce(diff, op=MPI.MAX))
    return {name: summarise(runs[name], args.batch_size) for name in IMPLS}, diffs


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    mpidp.abort_on_error()  # an exception on one rank ends the job instead of hanging it
    data = mpidp.load(comm, "synthetic", distribute="local", test_fraction=0.0, seed=args.seed,
                      n_samples=args.n_samples, n_features=args.n_features,
                      n_classes=args.n_classes)
    results, diffs = measure(comm, data.train, args)
    env = environment(comm)
    local_rows = comm.gather(len(data.train.X), root=0)
    if comm.rank == 0:
        out = {
            "benchmark": "step", "world_size": comm.size,
            "workload": {"model": f"mlp {args.n_features}->{'->'.join(map(str, HIDDEN))}->"
                         f"{args.n_classes} relu, softmax cross-entropy, sgd lr {args.lr}",
                         "dtype": "float32", "n_samples": args.n_samples,
                         "batch_size": args.batch_size, "warmup": args.warmup,
                         "steps": args.steps, "repeats": args.repeats, "seed": args.seed,
                         "local_rows": local_rows},
            **results,
            "ratio_mpidp_over_handwritten": results["mpidp"]["step_s"] / results["handwritten"]["step_s"],
            "params_max_abs_diff": diffs,
            "environment": env,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=2)
        os.replace(tmp, args.out)
        print(f"P={comm.size}: mpidp {results['mpidp']['step_ms']:.2f} ms/step, handwritten "
              f"{results['handwritten']['step_ms']:.2f} ms/step, ratio "
              f"{out['ratio_mpidp_over_handwritten']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
