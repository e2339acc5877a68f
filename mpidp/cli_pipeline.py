"""``mpidp train --parallel pipeline|hybrid``: the command line's model-parallel path.

Every rank loads the whole training set (the first stage needs the inputs, the last the
targets), builds only its own stage, trains with :func:`mpidp.train_pipeline.fit_pipeline`
and, at the end, the first stage of replica 0 (world rank 0) gathers the whole model and
writes ``model.npz`` and ``metrics.json`` in the same format as data-parallel training.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from . import comm as C
from . import data as D
from . import nn
from .metrics import gather_timings
from .parallel import make_trainer, model_layers
from .loop import Checkpointing
from .train_pipeline import fit_pipeline, restore_checkpoint

# Data-parallel-only options the pipeline does not implement: refused, not ignored.
_UNSUPPORTED = {"watchdog": None, "check_every": 0, "sync": "allreduce", "partition": "block",
                "slowdown": {}, "trace": None}


def _refuse_unsupported(args: argparse.Namespace) -> None:
    used = [k for k, default in _UNSUPPORTED.items() if getattr(args, k) != default]
    if used:
        raise C.MpidpError(f"--parallel {args.parallel} does not support " + ", ".join(
            f"--{k.replace('_', '-')}" for k in used) + "; use --parallel data for those")


def train_model_parallel(args: argparse.Namespace, comm: C.Comm) -> dict | None:
    """Run ``mpidp train`` with a pipeline or hybrid. Collective. Metrics on rank 0."""
    from .cli import _check_out, _say, resumed  # the CLI module imports this one lazily

    t_start = time.perf_counter()
    C.root_decides(comm, _check_out, args.out)
    _refuse_unsupported(args)
    if args.resume and not args.checkpoint_dir:
        raise C.MpidpError("--resume needs --checkpoint-dir")
    data = C.run_agreed(comm, D.load, C.self_comm(), args.dataset, seed=args.seed,
                        test_fraction=args.test_fraction, dtype=args.dtype,
                        n_classes=args.n_classes, n_samples=args.n_samples,
                        n_features=args.n_features,
                        regression=args.model == "linear" and args.dataset == "synthetic")
    layers, loss = C.run_agreed(comm, model_layers, args.model, data.n_features,
                                data.n_outputs, args.hidden, data.classification)
    optimizer = nn.make_optimizer(args.optimizer, args.lr, args.momentum, args.weight_decay)
    pipe = make_trainer(args.parallel, layers, data.n_features, optimizer, loss, comm,
                        dtype=args.dtype, micro_batches=args.micro_batches,
                        schedule=args.schedule)
    pipe.init_(np.random.default_rng(args.seed))  # the same initial model as --parallel data
    _say(comm, f"mpidp train --parallel {args.parallel}: {pipe.n_stages} stages x "
         f"{pipe.n_replicas} replicas, {args.micro_batches} micro-batches, {args.schedule}; "
         f"stage bounds (layers) {pipe.plan.bounds}",
         f"data: {data.name}, {data.train.n_total} train / {data.test.n_total} test samples")

    def report(r: dict) -> None:
        acc = "" if r["accuracy"] is None else f"  acc {r['accuracy']:.4f}"
        test = "" if r.get("test_accuracy") is None else f"  test acc {r['test_accuracy']:.4f}"
        _say(comm, f"epoch {r['epoch']:>3}/{args.epochs}  loss {r['loss']:.4f}{acc}{test}"
             f"  ({r['seconds']:.2f}s)")

    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    config["world_size"] = comm.size
    resume = (resumed(comm, args, config, restore_checkpoint(pipe, args.checkpoint_dir))
              if args.resume else None)
    checkpointing = (Checkpointing(args.checkpoint_dir, args.checkpoint_every,
                                   args.keep_checkpoints, config) if args.checkpoint_dir else None)
    history = fit_pipeline(pipe, data.train.X, data.train.y, args.epochs, args.batch_size,
                           seed=args.seed, shuffle=not args.no_shuffle, drop_last=args.drop_last,
                           X_test=data.test.X, y_test=data.test.y, on_epoch=report,
                           checkpoint=checkpointing, resume=resume)
    return _finish(args, comm, pipe, history, data, t_start)


def _finish(args, comm, pipe, history, data, t_start) -> dict | None:
    from .cli import finish
    in_sync = pipe.in_sync()
    full = pipe.gather_params(0)
    timings = gather_timings(comm, pipe.timer)
    memory = C.gather_rows(comm, np.array(list(pipe.memory().values()), np.float64))
    if comm.rank != 0:
        return None
    last = history[-1]
    model, _ = nn.build(args.model, data.n_features, data.n_outputs, args.hidden, args.dtype,
                        data.classification)
    model.params[...] = full
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    metrics = {"world_size": comm.size, "parallel": args.parallel, "stages": pipe.n_stages,
               "replicas": pipe.n_replicas, "stage_bounds": pipe.plan.bounds,
               "epochs": args.epochs, "final_loss": last["loss"],
               "train_accuracy": last["accuracy"], "test_loss": last.get("test_loss"),
               "test_accuracy": last.get("test_accuracy"), "params_in_sync": in_sync,
               "n_params": model.n_params, "wall_s": time.perf_counter() - t_start,
               "history": history, "steps": pipe.global_step, "timings": timings,
               "memory_per_rank": [dict(zip(pipe.memory(), map(int, row))) for row in memory],
               "config": config, "mpi": C.mpi_info(C.self_comm())}
    return finish(comm, args, metrics, model, data)
