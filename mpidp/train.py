"""``mpidp train``: from command-line options to a finished run, in every mode.

Options are checked against the mode first (:mod:`mpidp.options`); then data are loaded,
the trainer for the mode is built, and every synchronous mode trains through the one loop
(:func:`mpidp.loop.run`) with the same watchdog, signals, fault injection, NaN policy,
replica check and checkpoints. ``async-ps`` runs its server/worker protocol, under the
same watchdog, faults and NaN policy. The end is the same for all: replicas checked
(a mismatch fails the run), ``model.npz`` and ``metrics.json`` written by rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from . import comm as C
from . import data as D
from . import nn
from . import options as O
from .checkpoint import restore, write_atomic
from .cli_partition import apply_slowdown, is_sparse, load_options, make_plan, summarize
from .loop import Checkpointing, fit
from .metrics import format_timings, gather_timings
from .parallel import DataParallel, make_trainer, model_layers
from .parallel.async_ps import train_async
from .parallel.sync import make_sync
from .signals import StopSignals
from .train_pipeline import fit_pipeline, restore_checkpoint

# Settings a checkpoint must share with the run that resumes it (the world size may differ).
RESUME_MUST_MATCH = ("dataset", "model", "hidden", "batch_size", "seed", "dtype", "optimizer",
                     "test_fraction", "no_shuffle", "drop_last", "n_samples", "n_features")


def say(comm: C.Comm, *lines: str) -> None:
    if comm.rank == 0:
        print(*lines, sep="\n", flush=True)


def check_out(out: str) -> None:
    """ValueError unless a file can be created in folder ``out`` (tried for real)."""
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} exists and is not a folder")
    parent = os.path.abspath(out)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:
        with open(os.path.join(parent, f".mpidp-probe-{os.getpid()}"), "wb") as f:
            name = f.name
        os.unlink(name)
    except OSError as exc:
        raise ValueError(f"--out {out!r}: cannot write in {parent!r} ({exc.strerror})") from None


def _config(args: argparse.Namespace, comm: C.Comm) -> dict:
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    config["world_size"] = comm.size
    return config


def resumed(comm: C.Comm, args: argparse.Namespace, config: dict, found):
    """The resume state from ``found`` (``(path, state)`` or None), after checking that the
    checkpoint was written with the settings ``RESUME_MUST_MATCH``; says what it resumed."""
    if found is None:
        say(comm, f"no checkpoint in {args.checkpoint_dir}: starting from the beginning")
        return None
    path, state = found
    changed = [k for k in RESUME_MUST_MATCH if state.config.get(k) != config.get(k)]
    if changed:
        raise C.MpidpError(f"checkpoint {path} was written with different settings: " + ", ".join(
            f"--{k.replace('_', '-')} {state.config.get(k)} (now {config.get(k)})" for k in changed))
    if state.epoch > args.epochs:
        raise C.MpidpError(f"checkpoint {path} is at epoch {state.epoch} but --epochs is "
                           f"{args.epochs}: it would be rewritten as if less were trained; "
                           f"use --epochs >= {state.epoch}")
    say(comm, f"resumed from {path}: epoch {state.epoch + 1}, step {state.step}, "
        f"{state.global_step} steps done (written with "
        f"{state.config.get('world_size', '?')} ranks, now {comm.size})")
    return state


def _load_data(comm: C.Comm, args: argparse.Namespace, server: int | None) -> D.Data:
    """Load the dataset over all ranks, or (dedicated parameter server) over the workers only,
    the server getting empty shards. Collective; errors reach every rank, said once."""
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
            error = str(exc)  # already agreed among the workers
    first_worker = 1 if server == 0 else 0
    error = C.bcast_obj(comm, error, root=first_worker)
    if error is not None:
        raise C.MpidpError(error)
    meta = C.bcast_obj(comm, None if data is None else (
        data.name, data.n_features, data.n_outputs, data.classification, data.train.n_total,
        data.test.n_total, data.train.y.dtype, data.train.y.shape[1:]), root=first_worker)
    if data is not None:
        return data
    name, d, n_out, classification, n_train, n_test, y_dtype, y_shape = meta
    empty = lambda n: D.Shard(np.empty((0, d), args.dtype), np.empty((0, *y_shape), y_dtype), 0, n)
    return D.Data(empty(n_train), empty(n_test), name, d, n_out, classification)


class _Report:
    """One line per epoch on rank 0."""

    def __init__(self, comm: C.Comm, epochs: int) -> None:
        self.comm, self.epochs = comm, epochs

    def __call__(self, r: dict) -> None:
        acc = "" if r.get("accuracy") is None else f"  acc {r['accuracy']:.4f}"
        tl = "" if "test_loss" not in r else f"  test loss {r['test_loss']:.4f}"
        test = "" if r.get("test_accuracy") is None else f"  test acc {r['test_accuracy']:.4f}"
        secs = "" if r.get("seconds") is None else f"  ({r['seconds']:.2f}s)"
        say(self.comm, f"epoch {r['epoch']:>3}/{self.epochs}  loss {r['loss']:.4f}{acc}{tl}"
            f"{test}{secs}")


def train(args: argparse.Namespace, comm: C.Comm, given: set[str]) -> dict | None:
    """Run ``mpidp train``. Collective. Returns the metrics on rank 0, None elsewhere."""
    t_start = time.perf_counter()
    errors = O.problems(args, given, comm.size)
    if errors:  # every rank computes the same list from the same arguments
        raise C.MpidpError("; ".join(errors))
    if not 0 <= args.test_fraction < 1:
        raise C.MpidpError(f"--test-fraction must be in [0, 1), got {args.test_fraction}")
    if args.check_every < 0:
        raise C.MpidpError(f"--check-every must be >= 0, got {args.check_every}")
    C.root_decides(comm, check_out, args.out)
    watchdog = C.Watchdog(comm, args.watchdog or None) if args.watchdog != 0 else None
    stop = StopSignals(comm)
    try:
        if O.mode_of(args) in O.MODEL_PARALLEL:
            return _train_model_parallel(args, comm, t_start, watchdog, stop)
        return _train_data_parallel(args, comm, t_start, watchdog, stop)
    finally:
        stop.close()
        if watchdog is not None:
            watchdog.stop()


def _checkpointing(args, config) -> Checkpointing | None:
    if not args.checkpoint_dir:
        return None
    return Checkpointing(args.checkpoint_dir, args.checkpoint_every, args.keep_checkpoints, config)


def _train_data_parallel(args, comm, t_start, watchdog, stop) -> dict | None:
    dedicated = O.dedicated_server(args)
    data = _load_data(comm, args, server=0 if dedicated else None)
    model, loss = C.run_agreed(comm, nn.build, args.model, data.n_features, data.n_outputs,
                               args.hidden, args.dtype, data.classification, is_sparse(data))
    model.init_(np.random.default_rng(args.seed))
    make_opt = lambda: nn.make_optimizer(args.optimizer, args.lr, args.momentum, args.weight_decay)
    sync = make_sync("allreduce" if args.sync == "async-ps" else args.sync,  # async: eval only
                     make_opt, bucket_bytes=int(args.bucket_mb * 2**20), codec=args.compress,
                     dedicated=dedicated, k=args.sync_every,
                     ps_shared_memory=args.ps_transport == "shared",
                     ps_chunk_bytes=max(1, int(args.ps_chunk_mb * 2**20)))
    dp = DataParallel(model, make_opt(), loss, comm, init_sync=args.init_sync,
                      check_every=args.check_every, on_nonfinite=args.on_nonfinite, sync=sync)
    config, report = _config(args, comm), _Report(comm, args.epochs)
    _announce(comm, args, data, f"model: {model!r}", f"this rank holds {len(data.train.X)} "
              "train rows")
    resume = resumed(comm, args, config, restore(comm, args.checkpoint_dir, dp.model,
                                                  dp.optimizer)) if args.resume else None
    extra: dict = {}
    if args.sync == "async-ps":
        history = _fit_async(args, comm, dp, data, report, watchdog)
        extra, balance = {"async": history.pop()}, None
    else:
        plan = make_plan(args, comm, data, dp.timer, partition=not dedicated)
        history = fit(dp, data.train, args.epochs, args.batch_size, seed=args.seed,
                      shuffle=not args.no_shuffle, drop_last=args.drop_last, test=data.test,
                      progress=not args.no_progress, on_epoch=report,
                      checkpoint=_checkpointing(args, config), resume=resume, partition=plan,
                      stop=stop, watchdog=watchdog)
        balance = summarize(args, comm, plan, history, write_atomic)
    dp.check_replicas()  # a mismatch is a failed run: every rank raises, nothing is written
    timings = gather_timings(comm, dp.timer)
    if comm.rank != 0:
        return None
    metrics = _metrics(args, comm, history, model.n_params, dp.global_step, timings, t_start)
    metrics.update(skipped_steps=dp.skipped_steps + extra.get("async", {}).get("skipped", 0),
                   **extra, sync=args.sync, balance=balance, config=config,
                   bytes_sent_per_step=dp.sync.bytes_sent / max(dp.global_step, 1))
    return finish(comm, args, metrics, model, data, "bit-identical (checked)")


def _fit_async(args, comm, dp: DataParallel, data: D.Data, report, watchdog) -> list[dict]:
    """``--sync async-ps``: train asynchronously, then evaluate; one history entry per epoch
    (the workers' training loss as the server received it), then the server's summary."""
    t0 = time.perf_counter()
    apply_slowdown(args, comm, dp.timer)
    if watchdog is not None:
        watchdog.start()
    stats = train_async(dp.model, dp.optimizer, dp.loss, comm, data.train, args.epochs,
                        args.batch_size, seed=args.seed, max_staleness=args.max_staleness,
                        timer=dp.timer, on_nonfinite=args.on_nonfinite)
    history = [{"epoch": e + 1, "loss": s / c, "accuracy": None, "seconds": None}
               for e, (s, c) in sorted((int(k), v) for k, v in stats.epoch_loss.items())]
    if not history:
        raise C.MpidpError("async-ps applied no update (every push was dropped or skipped)")
    ev = dp.evaluate(data.test.X, data.test.y) if data.test.n_total else None
    if ev is not None:
        history[-1].update(test_loss=ev.loss, test_accuracy=ev.accuracy if data.classification else None)
    history[-1]["seconds"] = time.perf_counter() - t0
    report(history[-1])
    return [*history, stats.summary()]


def _announce(comm, args, data: D.Data, *lines: str) -> None:
    mpi = C.mpi_info(comm)
    say(comm, f"mpidp train: {O.mode_of(args)} on {comm.size} rank(s), "
        f"{mpi['library']} (mpi4py {mpi['mpi4py']})",
        f"data: {data.name}, {data.train.n_total} train / {data.test.n_total} test samples, "
        f"{data.n_features} features, {data.n_outputs} outputs", *lines)


def _train_model_parallel(args, comm, t_start, watchdog, stop) -> dict | None:
    """``--parallel pipeline|hybrid``: every rank loads the whole training set (the first
    stage needs the inputs, the last the targets) and builds only its own stage."""
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
                        schedule=args.schedule, on_nonfinite=args.on_nonfinite)
    pipe.init_(np.random.default_rng(args.seed))  # the same initial model as --parallel data
    apply_slowdown(args, comm, pipe.timer)
    _announce(comm, args, data, f"{pipe.n_stages} stages x {pipe.n_replicas} replicas, "
              f"{args.micro_batches} micro-batches, {args.schedule}; stage bounds (layers) "
              f"{pipe.plan.bounds}")
    config = _config(args, comm)
    resume = (resumed(comm, args, config, restore_checkpoint(pipe, args.checkpoint_dir))
              if args.resume else None)
    history = fit_pipeline(pipe, data.train.X, data.train.y, args.epochs, args.batch_size,
                           seed=args.seed, shuffle=not args.no_shuffle, drop_last=args.drop_last,
                           X_test=data.test.X, y_test=data.test.y,
                           on_epoch=_Report(comm, args.epochs),
                           checkpoint=_checkpointing(args, config), resume=resume,
                           check_every=args.check_every, stop=stop, watchdog=watchdog)
    pipe.check_replicas()
    full = pipe.gather_params(0)
    timings = gather_timings(comm, pipe.timer)
    memory = C.gather_rows(comm, np.array(list(pipe.memory().values()), np.float64))
    if comm.rank != 0:
        return None
    model, _ = nn.build(args.model, data.n_features, data.n_outputs, args.hidden, args.dtype,
                        data.classification)
    model.params[...] = full
    metrics = _metrics(args, comm, history, model.n_params, pipe.global_step, timings, t_start)
    metrics.update(parallel=args.parallel, stages=pipe.n_stages, replicas=pipe.n_replicas,
                   stage_bounds=pipe.plan.bounds, config=config,
                   skipped_steps=pipe.policy.skipped,
                   memory_per_rank=[dict(zip(pipe.memory(), map(int, row))) for row in memory])
    same = "bit-identical (checked)" if pipe.n_replicas > 1 else "one replica (nothing to compare)"
    return finish(comm, args, metrics, model, data, same)


def _metrics(args, comm, history, n_params, steps, timings, t_start) -> dict:
    last = history[-1]
    return {"world_size": comm.size, "mode": O.mode_of(args), "epochs": args.epochs,
            "final_loss": last["loss"], "train_accuracy": last["accuracy"],
            "test_loss": last.get("test_loss"), "test_accuracy": last.get("test_accuracy"),
            "params_in_sync": True, "n_params": n_params,
            "wall_s": time.perf_counter() - t_start, "history": history, "steps": steps,
            "timings": timings, "mpi": C.mpi_info(C.self_comm())}


def finish(comm: C.Comm, args: argparse.Namespace, metrics: dict, model: nn.Sequential,
           data: D.Data, replicas: str) -> dict:
    """On rank 0: write ``model.npz`` and ``metrics.json`` (atomically) and print the summary."""
    meta = {"model": args.model, "hidden": list(args.hidden), "n_features": data.n_features,
            "n_outputs": data.n_outputs, "classification": data.classification}
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "model.npz"), lambda f: np.savez(
        f, params=model.params, spec=json.dumps(model.spec()), dtype=str(model.dtype),
        meta=json.dumps(meta)))
    write_atomic(os.path.join(args.out, "metrics.json"),
                 lambda f: f.write(json.dumps(metrics, indent=2).encode()))
    last = metrics["history"][-1]
    final = f"final: loss {last['loss']:.4f}"
    if last.get("test_accuracy") is not None:
        final += f", test accuracy {last['test_accuracy']:.4f}"
    say(comm, final, f"replicas: {replicas}", "per-rank timing (whole run):",
        format_timings(metrics["timings"]), f"wrote {args.out}/metrics.json and "
        f"{args.out}/model.npz ({metrics['wall_s']:.1f}s)")
    return metrics
