"""Command line: ``mpidp train``, ``mpidp info``. Run under ``mpiexec -n P``.

Every rank parses the same arguments and takes the same decisions; only rank 0 prints.
Bad input exits with status 2 on every rank and leaves ``--out`` untouched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

from . import comm as C
from . import data as D
from . import nn
from .calibrate import calibrate, format_report
from .calibrate import save as save_model
from .checkpoint import restore, write_atomic
from .cli_partition import (
    add_partition_options,
    add_predict,
    apply_slowdown,
    is_sparse,
    load_options,
    make_plan,
    predict,
    summarize,
)
from .metrics import format_timings, gather_timings
from .parallel import INIT_SYNC, ON_NONFINITE, DataParallel
from .parallel.async_ps import train_async
from .parallel.sync import SYNCS, make_sync
from .loop import Checkpointing, fit

# Settings a checkpoint must share with the run that resumes it (the world size may differ).
RESUME_MUST_MATCH = ("dataset", "model", "hidden", "batch_size", "seed", "dtype", "optimizer",
                     "test_fraction", "no_shuffle", "drop_last", "n_samples", "n_features")


class _Parser(argparse.ArgumentParser):
    """Usage errors are printed by rank 0 only; every rank exits with status 2."""

    def error(self, message: str):
        if C.world().rank == 0:
            self.print_usage(sys.stderr)
            print(f"{self.prog}: error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def _hidden(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated layer widths like 128,64, got {text!r}") from None
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"layer widths must be >= 1, got {text!r}")
    return sizes


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="train a model data-parallel over the MPI ranks",
                       description="Train a model data-parallel: every rank holds a replica, "
                       "gradients are summed with one Allreduce per step. Run under mpiexec -n P.",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--dataset", default="digits", help="'digits' (scikit-learn's 8x8 digits), 'synthetic', "
      "or PATH: an .npz with arrays X and y, a folder with X.npy and y.npy, or an .h5 file")
    a("--model", choices=("linear", "logreg", "mlp"), default="mlp",
      help="linear: least squares; logreg: softmax regression; mlp: ReLU MLP")
    a("--hidden", type=_hidden, default=(128, 64), help="MLP hidden widths, comma-separated")
    a("--epochs", type=_positive(int), default=10, help="passes over the training set")
    a("--batch-size", type=_positive(int), default=64,
      help="GLOBAL batch size: samples per step summed over all ranks")
    a("--lr", type=_positive(float), default=0.1, help="learning rate")
    a("--optimizer", choices=("sgd", "momentum", "adam"), default="momentum",
      help="sgd, SGD with momentum (--momentum), or adam")
    a("--momentum", type=float, default=0.9, help="momentum factor for --optimizer momentum")
    a("--weight-decay", type=float, default=0.0, help="L2 weight decay")
    a("--seed", type=int, default=0, help="seed for initialisation, split, shuffling, synthetic data")
    a("--dtype", choices=("float32", "float64"), default="float32", help="floating-point type")
    a("--distribute", choices=D.DISTRIBUTE, default="scatter",
      help="scatter: rank 0 reads and Scatterv's each rank its rows; "
      "local: each rank reads only its own rows from the file")
    a("--init-sync", choices=INIT_SYNC, default="bcast",
      help="bcast: rank 0's initial parameters are broadcast; seed: every rank initialises "
      "from the same seed (verified by checksum)")
    a("--out", default="out", help="folder for metrics.json and model.npz (written at the end)")
    a("--test-fraction", type=float, default=0.2, help="share of samples held out for testing")
    a("--n-classes", type=int, default=None, help="number of classes (default: max label + 1)")
    a("--n-samples", type=_positive(int), default=60000, help="synthetic: samples")
    a("--n-features", type=_positive(int), default=784, help="synthetic: features")
    a("--no-shuffle", action="store_true", help="visit samples in file order every epoch")
    a("--drop-last", action="store_true", help="skip the last, smaller batch of each epoch")
    a("--no-progress", action="store_true", help="no progress bar")
    m = p.add_argument_group("model parallelism")
    m.add_argument("--parallel", choices=("data", "pipeline", "hybrid"), default="data",
                   help="data: every rank a replica; pipeline: consecutive layers on consecutive "
                   "ranks; hybrid: pipelines of 2 stages x P/2 data-parallel replicas")
    m.add_argument("--micro-batches", type=_positive(int), default=4,
                   help="pipeline/hybrid: micro-batches per batch (sizes differ by at most 1)")
    m.add_argument("--schedule", choices=("gpipe", "1f1b"), default="1f1b",
                   help="pipeline/hybrid: gpipe (all forwards, then all backwards) or 1f1b")
    r = p.add_argument_group("reliability")
    r.add_argument("--checkpoint-dir", default=None,
                   help="folder for checkpoints (rank 0 writes them atomically, with a checksum)")
    r.add_argument("--checkpoint-every", type=_positive(int), default=100,
                   help="steps between checkpoints (one more is written at the end)")
    r.add_argument("--keep-checkpoints", type=_positive(int), default=3,
                   help="how many recent checkpoints to keep")
    r.add_argument("--resume", action="store_true",
                   help="continue from the newest good checkpoint in --checkpoint-dir (any "
                   "number of ranks); starts afresh if there is none")
    r.add_argument("--check-every", type=int, default=0,
                   help="compare parameter checksums across ranks every N steps (0: only at the end)")
    r.add_argument("--on-nonfinite", choices=ON_NONFINITE, default="stop",
                   help="NaN/Inf in the global loss or gradient: stop with an error, skip the "
                   "step's update, or ignore")
    g = p.add_argument_group("synchronisation")
    g.add_argument("--sync", choices=(*SYNCS, "async-ps"), default="allreduce",
                   help="allreduce: one fused in-place Allreduce per step; per-layer: one per "
                   "array; overlapped: bucketed Iallreduce during backward; compressed: 16-bit "
                   "with error feedback; ps: parameter server (rank 0); sharded-ps: every rank "
                   "updates 1/P of the parameters; accumulate: sync every --sync-every batches; "
                   "local-sgd: average parameters every --sync-every steps; async-ps: workers "
                   "push gradients and pull parameters without waiting (rank 0 serves)")
    g.add_argument("--max-staleness", type=int, default=8,
                   help="async-ps: drop gradients computed on parameters older than this")
    g.add_argument("--ps-placement", choices=("root", "dedicated"), default="root",
                   help="ps: the server also computes (root) or holds no data (dedicated)")
    g.add_argument("--ps-transport", choices=("shared", "mpi"), default="shared",
                   help="ps: within each node that runs several ranks, gradients and "
                   "parameters go through MPI shared memory and node leaders relay over MPI "
                   "(shared), or always Reduce_scatter + Gatherv and Bcast (mpi)")
    g.add_argument("--ps-chunk-mb", type=_positive(float), default=1.0,
                   help="ps (shared): the server ships its update in pieces of this many MiB")
    g.add_argument("--bucket-mb", type=_positive(float), default=1.0,
                   help="overlapped: bucket size in MiB")
    g.add_argument("--compress", choices=("bfloat16", "float16"), default="bfloat16",
                   help="compressed: 16-bit format of the gradients on the wire")
    g.add_argument("--sync-every", type=_positive(int), default=4,
                   help="accumulate / local-sgd: steps between synchronisations")
    r.add_argument("--watchdog", type=_positive(float), default=None, metavar="SECONDS",
                   help="abort, naming the ranks that never arrived, if a step's Allreduce "
                   "waits longer than this")
    add_partition_options(p)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mpidp", description="Data-parallel training of NumPy models over MPI.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_train(sub)
    sub.add_parser("info", help="print MPI library, world size and numpy/BLAS configuration")
    m = sub.add_parser("model", help="measure latency, bandwidth and compute; predict scaling "
                       "of allreduce and parameter server up to 1,024 ranks (needs >= 2 ranks)")
    m.add_argument("--out", default="out/model", help="folder for model.json, model.md, model.png")
    m.add_argument("--batch-size", type=_positive(int), default=512, help="global batch")
    add_predict(sub)
    return parser


def _say(comm, *lines: str) -> None:
    if comm.rank == 0:
        print(*lines, sep="\n", flush=True)


def _check_out(out: str) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} exists and is not a folder")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    target = out if os.path.isdir(out) else parent
    if not os.access(target, os.W_OK):
        raise ValueError(f"--out {out!r}: no permission to write in {target!r}")


def _save(out: str, metrics: dict, model: nn.Sequential, meta: dict) -> None:
    os.makedirs(out, exist_ok=True)
    write_atomic(os.path.join(out, "model.npz"), lambda f: np.savez(
        f, params=model.params, spec=json.dumps(model.spec()), dtype=str(model.dtype),
        meta=json.dumps(meta)))
    write_atomic(os.path.join(out, "metrics.json"),
                  lambda f: f.write(json.dumps(metrics, indent=2).encode()))


def _resume(comm: C.Comm, args: argparse.Namespace, config: dict, dp: DataParallel):
    """Restore the newest good checkpoint (collective); None (and a notice) if there is none."""
    return resumed(comm, args, config, restore(comm, args.checkpoint_dir, dp.model, dp.optimizer))


def resumed(comm: C.Comm, args: argparse.Namespace, config: dict, found):
    """The resume state from ``found`` (``(path, state)`` or None), after checking that the
    checkpoint was written with the settings ``RESUME_MUST_MATCH``; says what it resumed."""
    if found is None:
        _say(comm, f"no checkpoint in {args.checkpoint_dir}: starting from the beginning")
        return None
    path, state = found
    changed = [k for k in RESUME_MUST_MATCH if state.config.get(k) != config.get(k)]
    if changed:
        raise C.MpidpError(f"checkpoint {path} was written with different settings: " + ", ".join(
            f"--{k.replace('_', '-')} {state.config.get(k)} (now {config.get(k)})" for k in changed))
    _say(comm, f"resumed from {path}: epoch {state.epoch + 1}, step {state.step}, "
         f"{state.global_step} steps done (written with "
         f"{state.config.get('world_size', '?')} ranks, now {comm.size})")
    return state


def _load_data(comm: C.Comm, args: argparse.Namespace, server: int | None) -> D.Data:
    """Load the dataset over all ranks, or (dedicated parameter server) over the workers only,
    the server getting empty shards. Collective; errors reach every rank."""
    kw = dict(distribute=args.distribute, seed=args.seed, test_fraction=args.test_fraction,
              dtype=args.dtype, n_classes=args.n_classes, n_samples=args.n_samples,
              n_features=args.n_features,
              regression=args.model == "linear" and args.dataset == "synthetic")
    if server is None:
        return D.load(comm, args.dataset, **kw, **load_options(args, comm))
    workers = C.split_off(comm, server)
    data, error = None, None
    if workers is not None:
        try:
            data = D.load(workers, args.dataset, **kw, **load_options(args, workers))
        except C.MpidpError as exc:
            error = str(exc)
    C.agree(comm, error)
    first_worker = 1 if server == 0 else 0
    meta = C.bcast_obj(comm, None if data is None else (
        data.name, data.n_features, data.n_outputs, data.classification, data.train.n_total,
        data.test.n_total, data.train.y.dtype, data.train.y.shape[1:]), root=first_worker)
    if data is not None:
        return data
    name, d, n_out, classification, n_train, n_test, y_dtype, y_shape = meta
    empty = lambda n: D.Shard(np.empty((0, d), args.dtype), np.empty((0, *y_shape), y_dtype), 0, n)
    return D.Data(empty(n_train), empty(n_test), name, d, n_out, classification)


def _fit_async(args, comm, dp: DataParallel, data: D.Data, report) -> tuple[list[dict], dict]:
    """``--sync async-ps``: train asynchronously, then evaluate; history has one entry per
    epoch (the workers' training loss as the server received it) and the final test figures."""
    t0 = time.perf_counter()
    apply_slowdown(args, comm, dp.timer)
    stats = train_async(dp.model, dp.optimizer, dp.loss, comm, data.train, args.epochs,
                        args.batch_size, seed=args.seed, max_staleness=args.max_staleness,
                        timer=dp.timer)
    history = [{"epoch": e + 1, "loss": s / c, "accuracy": None, "seconds": None}
               for e, (s, c) in sorted((int(k), v) for k, v in stats.epoch_loss.items())]
    ev = dp.evaluate(data.test.X, data.test.y) if data.test.n_total else None
    if ev is not None:
        history[-1].update(test_loss=ev.loss, test_accuracy=ev.accuracy if data.classification else None)
    history[-1]["seconds"] = time.perf_counter() - t0
    report(history[-1])
    return history, {"async": stats.summary()}


def train(args: argparse.Namespace, comm: C.Comm) -> dict | None:
    """Run ``mpidp train``. Collective. Returns the metrics on rank 0, None elsewhere."""
    if getattr(args, "parallel", "data") != "data":
        from .cli_pipeline import train_model_parallel
        return train_model_parallel(args, comm)
    t_start = time.perf_counter()
    C.root_decides(comm, _check_out, args.out)
    if not 0 <= args.test_fraction < 1:
        raise C.MpidpError(f"--test-fraction must be in [0, 1), got {args.test_fraction}")
    dedicated = (args.sync == "ps" and args.ps_placement == "dedicated") or args.sync == "async-ps"
    if args.sync in ("ps", "async-ps") and comm.size < 2:
        raise C.MpidpError(f"--sync {args.sync} needs at least 2 ranks (a server and a worker)")
    data = _load_data(comm, args, server=0 if dedicated else None)
    model, loss = C.run_agreed(comm, nn.build, args.model, data.n_features, data.n_outputs,
                               args.hidden, args.dtype, data.classification, is_sparse(data))
    model.init_(np.random.default_rng(args.seed))
    optimizer = nn.make_optimizer(args.optimizer, args.lr, args.momentum, args.weight_decay)
    if args.resume and not args.checkpoint_dir:
        raise C.MpidpError("--resume needs --checkpoint-dir")
    if args.sync == "async-ps" and args.checkpoint_dir:
        raise C.MpidpError("--sync async-ps does not write or resume checkpoints (its "
                           "workers are at different steps); drop --checkpoint-dir")
    if args.check_every < 0:
        raise C.MpidpError(f"--check-every must be >= 0, got {args.check_every}")
    sync = make_sync("allreduce" if args.sync == "async-ps" else args.sync,  # async: eval only
                     lambda: nn.make_optimizer(args.optimizer, args.lr, args.momentum,
                                               args.weight_decay),
                     bucket_bytes=int(args.bucket_mb * 2**20), codec=args.compress,
                     dedicated=dedicated, k=args.sync_every,
                     ps_shared_memory=args.ps_transport == "shared",
                     ps_chunk_bytes=max(1, int(args.ps_chunk_mb * 2**20)))
    dp = DataParallel(model, optimizer, loss, comm, init_sync=args.init_sync,
                      check_every=args.check_every, on_nonfinite=args.on_nonfinite,
                      watchdog=args.watchdog, sync=sync)
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    config["world_size"] = comm.size
    mpi = C.mpi_info(comm)
    _say(comm, f"mpidp train  {json.dumps(config)}",
         f"MPI: {mpi['library']} (MPI {mpi['mpi_standard']}, mpi4py {mpi['mpi4py']}), "
         f"world size {comm.size}",
         f"data: {data.name}, {data.train.n_total} train / {data.test.n_total} test samples, "
         f"{data.n_features} features, {data.n_outputs} outputs; this rank holds "
         f"{len(data.train.X)} train rows",
         f"model: {model!r}")
    resume = _resume(comm, args, config, dp) if args.resume else None

    def report(r: dict) -> None:
        acc = "" if r["accuracy"] is None else f"  acc {r['accuracy']:.4f}"
        test = "" if r.get("test_accuracy") is None else f"  test acc {r['test_accuracy']:.4f}"
        tl = "" if "test_loss" not in r else f"  test loss {r['test_loss']:.4f}"
        _say(comm, f"epoch {r['epoch']:>3}/{args.epochs}  loss {r['loss']:.4f}{acc}{tl}{test}"
             f"  ({r['seconds']:.2f}s)")

    checkpointing = (Checkpointing(args.checkpoint_dir, args.checkpoint_every,
                                   args.keep_checkpoints, config) if args.checkpoint_dir else None)
    extra: dict = {}
    if args.sync == "async-ps":
        history, extra = _fit_async(args, comm, dp, data, report)
        balance = None
    else:
        plan = make_plan(args, comm, data, dp.timer)
        history = fit(dp, data.train, args.epochs, args.batch_size, seed=args.seed,
                      shuffle=not args.no_shuffle, drop_last=args.drop_last, test=data.test,
                      progress=not args.no_progress, on_epoch=report, checkpoint=checkpointing,
                      resume=resume, partition=plan)
        balance = summarize(args, comm, plan, history, write_atomic)
    in_sync = dp.in_sync()
    timings = gather_timings(comm, dp.timer)
    if comm.rank != 0:
        return None
    last = history[-1]
    wall = time.perf_counter() - t_start
    metrics = {"world_size": comm.size, "epochs": args.epochs, "final_loss": last["loss"],
               "train_accuracy": last["accuracy"], "test_loss": last.get("test_loss"),
               "test_accuracy": last.get("test_accuracy"), "params_in_sync": in_sync,
               "n_params": model.n_params, "wall_s": wall, "history": history,
               "steps": dp.global_step, "skipped_steps": dp.skipped_steps, **extra,
               "sync": args.sync, "bytes_sent_per_step": dp.sync.bytes_sent / max(dp.global_step, 1),
               "timings": timings, "balance": balance, "config": config, "mpi": mpi}
    return finish(comm, args, metrics, model, data)


def finish(comm: C.Comm, args: argparse.Namespace, metrics: dict, model: nn.Sequential,
           data: D.Data) -> dict:
    """On rank 0: write ``model.npz`` and ``metrics.json`` (atomically) and print the summary."""
    meta = {"model": args.model, "hidden": list(args.hidden), "n_features": data.n_features,
            "n_outputs": data.n_outputs, "classification": data.classification}
    _save(args.out, metrics, model, meta)
    last = metrics["history"][-1]
    final = f"final: loss {last['loss']:.4f}"
    if last.get("test_accuracy") is not None:
        final += f", test accuracy {last['test_accuracy']:.4f}"
    _say(comm, final, f"replicas bit-identical: {metrics['params_in_sync']}", "per-rank timing:",
         format_timings(metrics["timings"]), f"wrote {args.out}/metrics.json and "
         f"{args.out}/model.npz ({metrics['wall_s']:.1f}s)")
    return metrics


def info(comm: C.Comm) -> dict:
    """MPI and numpy/BLAS configuration (printed by rank 0)."""
    result = {"mpi": C.mpi_info(comm), "numpy": np.__version__, "blas": _blas_info(),
              "env": {k: os.environ[k] for k in sorted(os.environ)
                      if k.startswith(("OPENBLAS", "OMP_", "MKL_"))}}
    _say(comm, json.dumps(result, indent=2))
    return result


def _blas_info() -> list[dict] | str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        cfg = np.show_config(mode="dicts") if hasattr(np, "show_config") else {}
        return str(cfg.get("Build Dependencies", {}).get("blas", "unknown"))
    return [{k: d.get(k) for k in ("internal_api", "version", "num_threads",
                                   "threading_layer", "architecture")}
            for d in threadpool_info() if d.get("user_api") == "blas"]


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    comm = C.world()
    C.abort_on_error()
    try:
        if args.command == "train":
            train(args, comm)
        elif args.command == "model":
            report = calibrate(comm, args.batch_size)
            if comm.rank == 0:
                print(format_report(report), "\nwrote " + ", ".join(save_model(report, args.out)),
                      flush=True)
        elif args.command == "predict":
            predict(args, comm)
        else:
            info(comm)
    except C.MpidpError as exc:  # raised identically on every rank
        if comm.rank == 0:
            print(f"mpidp: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0
