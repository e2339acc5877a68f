"""Batch normalisation with the global batch's statistics: what its collectives cost, and
what per-rank statistics cost in accuracy.

Run under ``mpiexec -n 2 python benchmarks/bench_models_bn.py --out bn.json`` (one BLAS
thread per rank; ``bench_models.py`` starts it). The model is a model file
(default ``examples/models/digits-cnn-bn.toml``) on ``--dataset digits``, built as
``mpidp train`` builds it (:func:`mpidp.nn.model_layers`), trained with the CLI's default
optimizer, learning rate, momentum, weight decay, epochs and test split, read from the
CLI's own parser (never written down here).

- **cost**: ``DataParallel.step`` with global statistics (the layers' own ``Allreduce`` s,
  counted in ``layer_sums`` and timed in ``layer_sums_s``) and, in turns with it, with
  per-rank statistics (``model.context.reduce_sum`` the identity: no extra collective),
  at each ``--cost-batches`` global batch; warm-up steps dropped, the slowest rank's time
  between barriers, medians of ``--repeats``.
- **accuracy**: for each seed, :func:`mpidp.fit` at each global batch of ``--acc-batches`` with
  global, then per-rank statistics. With per-rank statistics every rank's running
  statistics differ, so the test accuracy is that of rank 0's model on the whole test set
  (rank 1's is reported too); with global statistics the replicas are identical.

Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpidp
from mpidp import comm as C
from mpidp import nn
from mpidp.data.partition import local_batches

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "examples" / "models" / "digits-cnn-bn.toml"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results file (written by rank 0)")
    p.add_argument("--model", default=str(MODEL), help="model file with BatchNorm layers")
    p.add_argument("--dataset", default="digits")
    p.add_argument("--cost-batches", default="64,16", help="global batches of the cost runs")
    p.add_argument("--repeats", type=int, default=7, help="timed runs of each variant")
    p.add_argument("--steps", type=int, default=100, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--acc-batches", default="16,4", help="global batches of the accuracy runs")
    p.add_argument("--seeds", default="0,1,2,3,4", help="seeds of the accuracy runs")
    p.add_argument("--part", choices=("cost", "accuracy", "both"), default="both",
                   help="what to measure (the timed cost, the accuracy runs, or both)")
    args = p.parse_args(argv)
    args.cost_batches = [int(b) for b in args.cost_batches.split(",") if b.strip()]
    args.acc_batches = [int(b) for b in args.acc_batches.split(",") if b.strip()]
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if min(args.repeats, args.steps, *args.acc_batches, *args.cost_batches) < 1 or not args.seeds:
        p.error("--repeats, --steps and the batches must be >= 1; give at least one seed")
    return args


def cli_defaults(dataset: str, model: str) -> argparse.Namespace:
    """What ``mpidp train --dataset DATASET --model MODEL`` would run with: its parser's
    defaults for everything else."""
    from mpidp.cli.main import build_parser
    return build_parser().parse_args(["train", "--dataset", dataset, "--model", model])


def trainer(comm: MPI.Comm, data, cli: argparse.Namespace, seed: int,
            per_rank: bool) -> mpidp.DataParallel:
    """The model of ``cli.model`` for ``data`` with the CLI's optimizer, initialised as the
    CLI does from ``seed``; ``per_rank``: batch norm uses each rank's own rows only."""
    layers, loss = nn.model_layers(cli.model, data.sample_shape, data.n_outputs)
    model = nn.Sequential(layers, data.sample_shape, cli.dtype)
    model.init_(np.random.default_rng(seed))
    dp = mpidp.DataParallel(model, nn.make_optimizer(cli.optimizer, cli.lr, cli.momentum,
                                                     cli.weight_decay), loss, comm)
    if per_rank:
        dp.model.context.reduce_sum = lambda a: a
    return dp


def load(comm: MPI.Comm, cli: argparse.Namespace, seed: int):
    return mpidp.load(comm, cli.dataset, seed=seed, test_fraction=cli.test_fraction, dtype=cli.dtype)


# --- cost -------------------------------------------------------------------------------

def timed(comm: MPI.Comm, dp: mpidp.DataParallel, shard, batches, steps: int) -> dict:
    """``steps`` steps between barriers: the slowest rank's s/step, and this job's
    layer-collective count and seconds per step (mean and max over ranks)."""
    n0, s0 = dp.layer_sums, dp.layer_sums_s
    comm.Barrier()
    t0 = MPI.Wtime()
    for idx in itertools.islice(batches, steps):
        dp.step(shard.X[idx], shard.y[idx], index=shard_index(shard, idx))
    comm.Barrier()
    step_s = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX) / steps
    sums_s = comm.allgather((dp.layer_sums_s - s0) / steps)
    return {"step_s": step_s, "layer_sums_per_step": (dp.layer_sums - n0) / steps,
            "layer_sums_s_mean": float(np.mean(sums_s)), "layer_sums_s_max": float(np.max(sums_s))}


def shard_index(shard, idx) -> np.ndarray:
    """Global training positions of the local rows ``idx`` (dropout keys its masks on them)."""
    return np.arange(shard.start, shard.stop, dtype=np.int64)[idx]


def allreduce_floor(comm: MPI.Comm, n: int, calls: int = 2000) -> float:
    """Median seconds of one in-place sum of ``n`` float64 over ``comm`` as the layers'
    go (:func:`mpidp.comm.allreduce_sum_`), called back to back: the latency floor."""
    a = np.zeros(n)
    blocks = []
    for _ in range(calls // 100):
        comm.Barrier()
        t = MPI.Wtime()
        for _ in range(100):
            C.allreduce_sum_(comm, a)
        blocks.append((MPI.Wtime() - t) / 100)
    return comm.allreduce(statistics.median(blocks), op=MPI.MAX)


def cost(comm: MPI.Comm, cli: argparse.Namespace, args) -> dict:
    data = load(comm, cli, cli.seed)
    sh = data.train
    width = max(layer.params["gamma"].size for layer in trainer(comm, data, cli, 0, False).model.layers
                if isinstance(layer, nn.BatchNorm))
    out = {"allreduce_floor_us": allreduce_floor(comm, 2 * width + 1) * 1e6,
           "allreduce_floor_doubles": 2 * width + 1, "by_batch": {}}
    for batch in args.cost_batches:
        variants = {name: trainer(comm, data, cli, cli.seed, per_rank=name == "per_rank")
                    for name in ("global", "per_rank")}
        streams = {name: itertools.chain.from_iterable(
            local_batches(sh.n_total, batch, sh.start, sh.stop, e, cli.seed) for e in itertools.count())
            for name in variants}
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(args.repeats):
            for name in (names if r % 2 == 0 else names[::-1]):
                timed(comm, variants[name], sh, streams[name], args.warmup)
                runs[name].append(timed(comm, variants[name], sh, streams[name], args.steps))
        summary = {}
        for name, rs in runs.items():
            med = lambda k, rs=rs: statistics.median(r[k] for r in rs)
            summary[name] = {"step_ms": med("step_s") * 1e3,
                             "layer_sums_per_step": med("layer_sums_per_step"),
                             "layer_sums_ms_mean": med("layer_sums_s_mean") * 1e3,
                             "layer_sums_ms_max": med("layer_sums_s_max") * 1e3,
                             "runs_ms": [r["step_s"] * 1e3 for r in rs]}
        g, p = summary["global"], summary["per_rank"]
        paired = [a["step_s"] / b["step_s"] for a, b in zip(runs["global"], runs["per_rank"])]
        summary["layer_sums_share"] = g["layer_sums_ms_mean"] / g["step_ms"]
        summary["extra_ms"] = g["step_ms"] - p["step_ms"]
        summary["paired_ratio_global_over_per_rank"] = statistics.median(paired)
        summary["local_rows_per_step"] = [batch // comm.size + (r < batch % comm.size)
                                          for r in range(comm.size)]
        out["by_batch"][str(batch)] = summary
    return out


# --- accuracy ---------------------------------------------------------------------------

def accuracy(model: nn.Sequential, X: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(model.predict(X, "label") == y))


def accuracy_runs(comm: MPI.Comm, cli: argparse.Namespace, args, batch: int) -> dict:
    runs = []
    for seed in args.seeds:
        data = load(comm, cli, seed)
        parts = comm.allgather((data.test.X, data.test.y))  # the whole test set on every rank
        Xt, yt = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        row = {"seed": seed, "n_test": len(yt)}
        for name in ("global", "per_rank"):
            dp = trainer(comm, data, cli, seed, per_rank=name == "per_rank")
            t = time.perf_counter()
            mpidp.fit(dp, data.train, cli.epochs, batch, seed=seed)
            wall = comm.allreduce(time.perf_counter() - t, op=MPI.MAX)
            accs = comm.allgather(accuracy(dp.model, Xt, yt))
            states = comm.allgather(dp.model.state.copy())
            row[name] = {"test_accuracy_rank0": accs[0], "test_accuracy_by_rank": accs,
                         "params_in_sync": bool(dp.in_sync()),
                         "state_max_abs_diff_between_ranks": float(max(
                             np.max(np.abs(s - states[0])) for s in states)),
                         "wall_s": wall}
        row["difference"] = row["global"]["test_accuracy_rank0"] - row["per_rank"]["test_accuracy_rank0"]
        runs.append(row)
    med = lambda f: statistics.median(f(r) for r in runs)
    return {"global_batch": batch, "per_rank_batch": batch / comm.size,
            "seeds": args.seeds, "runs": runs,
            "median_global": med(lambda r: r["global"]["test_accuracy_rank0"]),
            "median_per_rank": med(lambda r: r["per_rank"]["test_accuracy_rank0"]),
            "median_difference": med(lambda r: r["difference"])}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    mpidp.abort_on_error()
    cli = cli_defaults(args.dataset, args.model)
    result = {}
    if args.part in ("cost", "both"):
        result["cost"] = cost(comm, cli, args)
    if args.part in ("accuracy", "both"):
        result["accuracy"] = {str(b): accuracy_runs(comm, cli, args, b) for b in args.acc_batches}
    data = load(comm, cli, cli.seed)
    model = nn.Sequential(nn.model_layers(cli.model, data.sample_shape, data.n_outputs)[0],
                          data.sample_shape)
    if comm.rank == 0:
        out = {"world_size": comm.size, "model_file": os.path.relpath(cli.model, REPO),
               "layers": [repr(layer) for layer in model.layers], "n_params": model.n_params,
               "dataset": cli.dataset,
               "cli_defaults": {k: getattr(cli, k) for k in ("epochs", "lr", "optimizer", "momentum",
                                                            "weight_decay", "dtype", "test_fraction",
                                                            "batch_size", "seed")},
               "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup, **result,
               "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=2)
        os.replace(tmp, args.out)
        for b, a in result.get("accuracy", {}).items():
            print(f"batch norm, global batch {b}: global statistics {a['median_global']:.4f}, "
                  f"per-rank {a['median_per_rank']:.4f} (median over {len(args.seeds)} seeds)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
