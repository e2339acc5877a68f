"""Command-line pieces for partitioning and load balance: the ``train`` options
(``--partition``, ``--costs``, ``--capacities``, ``--adapt-every``, ``--slowdown``,
``--trace``), their summary, and ``mpidp predict`` (map/reduce over a dataset)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import zipfile
import zlib

import numpy as np

from . import comm as C
from . import nn
from .balance import Partition, Plan, format_balance
from .data import Data
from .mapreduce import map_reduce
from .nn.sparse import CSR
from .partition import STRATEGIES, block_range, train_test_split
from .sources import open_source, scan_rows


def _floats(text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers like 1,2, got {text!r}") from None


def _slowdown(text: str) -> dict[int, float]:
    out = {}
    for part in text.split(","):
        try:
            rank, factor = part.split(":")
            out[int(rank)] = float(factor)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected RANK:FACTOR[,RANK:FACTOR...] like 1:2, got {text!r}") from None
        if not out[int(rank)] >= 1 or int(rank) < 0:
            raise argparse.ArgumentTypeError(f"need RANK >= 0 and FACTOR >= 1, got {part!r}")
    return out


def add_partition_options(p: argparse.ArgumentParser) -> None:
    """The partitioning and load-balance options of ``mpidp train``."""
    a = p.add_argument
    a("--partition", choices=STRATEGIES, default="block",
      help="which samples each rank owns: block (contiguous), cyclic (round robin), shuffled "
      "(seeded), weighted (by --capacities), cost (every batch balanced by per-sample cost), "
      "adaptive (re-weighted from each rank's measured speed)")
    a("--costs", default="auto", help="per-sample costs for cost/adaptive: 'auto' (the "
      "workload's own, e.g. non-zeros for --dataset bow; else uniform), 'uniform', or a .npy "
      "file with one cost per dataset row")
    a("--capacities", type=_floats, default=None,
      help="relative rank speeds, comma-separated, one per rank (weighted; adaptive's start)")
    a("--adapt-every", type=int, default=None,
      help="adaptive: re-measure speeds every N steps (default: every epoch)")
    a("--slowdown", type=_slowdown, default={}, metavar="RANK:FACTOR",
      help="FOR BENCHMARKS AND TESTS: make RANK's per-sample work (each step's forward/"
      "backward) FACTOR times slower by sleeping (FACTOR-1)x its duration, simulating a "
      "straggler or slower node; the replicated update after the collective is not slowed")
    a("--trace", default=None, metavar="FILE",
      help="write a Chrome trace-event JSON timeline (compute / wait / comm / update per rank "
      "and step) to FILE; open it in Perfetto or chrome://tracing")


def _costs_arg(spec: str, n_samples: int):
    if spec in ("auto", "uniform"):
        return None
    try:
        return np.load(spec, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--costs {spec!r}: cannot read a .npy file ({exc})") from exc


def load_options(args: argparse.Namespace, comm: C.Comm) -> dict:
    """Keyword arguments for :func:`mpidp.load` from the partition options. Collective."""
    costs = C.run_agreed(comm, _costs_arg, args.costs, args.n_samples)
    return {"partition": args.partition, "costs": costs, "capacities": args.capacities}


def apply_slowdown(args: argparse.Namespace, comm: C.Comm, timer) -> None:
    """Set this rank's ``timer.slowdown`` from ``--slowdown`` (raises on every rank for a
    rank that does not exist)."""
    bad = [r for r in args.slowdown if r >= comm.size]
    if bad:
        raise C.MpidpError(f"--slowdown names rank {bad[0]} but there are {comm.size} ranks")
    timer.slowdown = args.slowdown.get(comm.rank, 1.0)


def make_plan(args: argparse.Namespace, comm: C.Comm, data: Data, timer) -> Plan:
    """The training :class:`Plan`; applies ``--slowdown`` to this rank's ``timer``."""
    apply_slowdown(args, comm, timer)
    costs = None if args.costs == "uniform" else data.costs
    part = Partition(args.partition, costs, args.capacities, args.adapt_every, args.seed)
    return Plan(comm, part, data.train.n_total, args.batch_size, args.seed,
                not args.no_shuffle, args.drop_last, trace=args.trace is not None)


def is_sparse(data: Data) -> bool:
    return isinstance(data.train.X, CSR)


def summarize(args, comm, plan: Plan, history: list[dict], write) -> dict:
    """The last epoch's load-balance figures; writes the trace (rank 0). Returns them."""
    figures = history[-1]["balance"]
    if comm.rank == 0:
        print(format_balance(figures), flush=True)
        if args.trace:
            os.makedirs(os.path.dirname(os.path.abspath(args.trace)), exist_ok=True)
            write(args.trace, lambda f: f.write(json.dumps(
                {"traceEvents": plan.events, "displayTimeUnit": "ms"}).encode()))
            print(f"wrote timeline {args.trace} ({len(plan.events)} events)", flush=True)
    return figures


# --- mpidp predict ----------------------------------------------------------------------

def add_predict(sub) -> None:
    p = sub.add_parser("predict", help="apply a trained model to a dataset across the ranks",
                       description="Predict with a model saved by 'mpidp train' (model.npz). "
                       "Rows are split over the ranks (any --partition, or --dynamic work "
                       "stealing); every rank writes its own rows of one .npy file.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--model", required=True, help="model.npz written by mpidp train, or its folder")
    a("--dataset", required=True, help="as for train: digits, synthetic, bow or PATH")
    a("--rows", choices=("all", "test"), default="all",
      help="all rows, or the held-out test rows of the seeded split used by train")
    a("--seed", type=int, default=0, help="seed of the split and of synthetic data")
    a("--test-fraction", type=float, default=0.2, help="as for train (with --rows test)")
    a("--n-samples", type=int, default=60000, help="synthetic/bow: samples")
    a("--n-features", type=int, default=784, help="synthetic/bow: features")
    a("--partition", choices=STRATEGIES[:-1], default="block", help="static split of the rows")
    a("--dynamic", action="store_true", help="ranks take chunks from a shared counter instead")
    a("--chunk-size", type=int, default=512, help="rows per chunk")
    a("--out", required=True, help=".npy file for the outputs (n_rows, n_outputs)")


class _Rows:
    """A source restricted to ``rows`` (sorted), cast to the model's dtype."""

    def __init__(self, src, rows, dtype) -> None:
        self.src, self.rows, self.dtype, self.n_samples = src, rows, dtype, len(rows)

    def read(self, idx):
        X, y = self.src.read(self.rows[np.asarray(idx)])
        return (X.astype(self.dtype) if isinstance(X, CSR) else np.asarray(X, self.dtype)), y

    def costs(self):
        return self.src.costs()[self.rows] if hasattr(self.src, "costs") else None


class _Pairs:
    """Rows handed to the function as ``(X, y)`` pairs (for evaluation)."""

    def __init__(self, data: _Rows) -> None:
        self.data, self.n_samples = data, data.n_samples

    def read(self, idx):
        return self.data.read(idx), None


def _open_model(path: str):
    """The model saved in ``path`` (a ``model.npz`` or its folder); ValueError naming the
    file if it is missing, truncated, corrupted (zip CRC-32), not a model, or not finite."""
    path = os.path.join(path, "model.npz") if os.path.isdir(path) else path
    try:
        with np.load(path, allow_pickle=False) as saved:
            spec, dtype, params = json.loads(str(saved["spec"])), str(saved["dtype"]), saved["params"]
        model = nn.from_spec(spec, dtype)
        model.params[...] = params
    except (OSError, KeyError, ValueError, TypeError, EOFError, zipfile.BadZipFile,
            zlib.error) as exc:
        raise ValueError(f"--model {path!r}: cannot load a saved model ({type(exc).__name__}: "
                         f"{exc}); give the model.npz that 'mpidp train' wrote, or its "
                         f"folder") from None
    if not np.isfinite(model.params).all():
        raise ValueError(f"--model {path!r}: the saved parameters contain NaN or Inf")
    return model


def predict(args: argparse.Namespace, comm: C.Comm) -> dict | None:
    """Run ``mpidp predict``. Collective. Returns a summary on rank 0."""
    model = C.run_agreed(comm, _open_model, args.model)
    src = C.run_agreed(comm, open_source, args.dataset, seed=args.seed,
                       n_samples=args.n_samples, n_features=args.n_features)
    rows = np.arange(src.n_samples)
    if args.rows == "test":
        rows = train_test_split(src.n_samples, args.test_fraction, args.seed)[1]
    if src.n_features != model.n_in:  # same verdict on every rank
        raise C.MpidpError(f"--dataset {args.dataset} has {src.n_features} features, but the "
                           f"model in {args.model} takes {model.n_in}")
    mine = rows[slice(*block_range(len(rows), comm.size, comm.rank))]
    bad = scan_rows(src, mine, dtype=model.dtype)  # each rank its block, before any work
    C.agree(comm, bad and f"{bad}: predictions for such rows are meaningless; clean or drop "
            f"them first")
    data = _Rows(src, rows, model.dtype)
    costs = data.costs() if args.partition == "cost" else None
    res = map_reduce(comm, model.forward, data, "concat", partition=args.partition, costs=costs,
                     dynamic=args.dynamic, chunk_size=args.chunk_size, out=args.out)
    correct = None
    if src.classification:  # evaluation: a second map over the same rows, reduced by a sum
        pairs = _Pairs(data)
        hits = map_reduce(comm, lambda XY: (model.forward(XY[0]).argmax(1) == XY[1])[:, None],
                          pairs, "sum", partition=args.partition, costs=costs,
                          dynamic=args.dynamic, chunk_size=args.chunk_size)
        correct = float(hits.value[0]) / max(len(rows), 1)
    summary = {"rows": len(rows), "out": args.out, "accuracy": correct,
               "per_rank": res.per_rank, "seconds": res.seconds}
    if comm.rank == 0:
        acc = "" if correct is None else f", accuracy {correct:.4f}"
        print(f"predicted {len(rows)} rows on {comm.size} ranks in {res.seconds:.2f}s{acc}; "
              f"wrote {args.out}", file=sys.stdout, flush=True)
        return summary
    return None
