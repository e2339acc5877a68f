"""``mpidp train``: from command-line options to a finished run, in every mode.

Options are checked against the mode first (:mod:`mpidp.cli.options`); then data are loaded,
the trainer for the mode is built, and every synchronous mode trains through the one loop
(:func:`mpidp.run.loop.run`) with the same watchdog, signals, fault injection, NaN policy,
replica check and checkpoints. ``async-ps`` runs its server/worker protocol, under the
same watchdog, faults and NaN policy. The end is the same for all: replicas checked
(a mismatch fails the run), ``model.npz`` and ``metrics.json`` written by rank 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from .. import comm as C
from .. import nn
from ..atomic import check_folder, write_together
from ..data import distribute as D
from ..data.balance import Partition, format_balance
from ..data.partition import block_range, steps_per_epoch
from ..nn.modelfile import is_model_file, layers_from, read_model_file
from ..nn.sparse import CSR
from ..nn.standardize import moments, pass1_mean, pass1_sums, pass2_squares
from ..observe.metrics import format_timings, gather_timings
from ..observe.progress import line_seconds
from ..observe.watch import Outputs, Watch, log, say, setup_logging
from ..parallel import DataParallel, make_trainer
from ..parallel.async_ps import AsyncPS, fit_async
from ..parallel.data_parallel import fit
from ..parallel.layer_needs import refuses_model
from ..parallel.pipeline import fit_pipeline
from ..parallel.strategies import make_sync
from ..run import checkpoint as ck
from ..run import faults, memory
from ..run.checkpoint import restore, write_atomic
from ..run.early_stopping import EarlyStopping, ReduceOnPlateau
from ..run.folders import clean_stale_tmp, hold_folder
from ..run.signals import StopSignals
from ..run.spec import Checkpointing, RunSpec
from . import config as config_file
from . import options as O
from .imports import HINT, absolute_paths, import_modules, imports_of, unregistered
from .settings import compare_resume, format_changes


def check_out(args: argparse.Namespace) -> None:
    """ValueError unless every output location can be written (tried for real; no
    symbolic link to nothing in the way) and ``OUT/config.toml`` can record the settings."""
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} exists and is not a folder")
    check_folder(out, "--out")
    if args.checkpoint_dir:
        check_folder(args.checkpoint_dir, "--checkpoint-dir")
    config_file.check_recordable(O.applying(vars(args)))
    Watch.check(outputs(args))


def outputs(args: argparse.Namespace) -> Outputs:
    """Where the run's live outputs go, from the options."""
    return Outputs(args.out, args.log_every, args.tensorboard, args.trace, args.trace_steps)


def _costs_arg(path: str):
    if path in ("auto", "uniform"):
        return None
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--costs {path!r}: cannot read a .npy file ({exc})") from exc


def load_options(args: argparse.Namespace, comm: C.Comm) -> dict:
    """Keyword arguments for :func:`mpidp.load` from the partition options. Collective."""
    costs = C.run_agreed(comm, _costs_arg, args.costs)
    return {"partition": args.partition, "costs": costs, "capacities": args.capacities}


def apply_slowdown(args: argparse.Namespace, comm: C.Comm, timer) -> None:
    """Set this rank's ``timer.slowdown`` from ``--slowdown`` (ranks beyond the job were
    refused with the other settings, :func:`mpidp.cli.options.problems`)."""
    timer.slowdown = args.slowdown.get(comm.rank, 1.0)


def partition_of(args: argparse.Namespace, data: D.Data) -> Partition | None:
    """The training partition the options ask for; None with a dedicated server (the
    shards stay as loaded, over the workers)."""
    if O.dedicated_server(args):
        return None
    costs = None if args.costs == "uniform" else data.costs
    return Partition(args.partition, costs, args.capacities, args.adapt_every, args.seed)


def _config(args: argparse.Namespace, comm: C.Comm) -> dict:
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    config["world_size"] = comm.size
    return config


def resumed(comm: C.Comm, args: argparse.Namespace, config: dict, found):
    """The resume state from ``found`` (``(path, state)`` or None), after checking that the
    checkpoint fits this run (:func:`~.settings.compare_resume`: same settings and
    data, not more epochs done than asked); announces changed hyperparameters (and another
    ``--sync``) and records them in ``config["resume_changes"]``."""
    if found is None:
        say(comm, f"no checkpoint in {args.checkpoint_dir}: starting from the beginning")
        return None
    path, state = found
    state.source = state.source or path  # what a refusal of its position names
    changed, refusal = compare_resume(state.config, config, state=state, path=path)
    if refusal:
        raise C.MpidpError(refusal)
    if changed:
        config["resume_changes"] = changed
        say(comm, format_changes(changed))
    say(comm, f"resumed from {path}: epoch {state.epoch + 1}, step {state.step}, "
        f"{state.global_step} steps done (written with "
        f"{state.config.get('world_size', '?')} ranks, now {comm.size})")
    return state


@contextmanager
def claimed(comm: C.Comm, args: argparse.Namespace, config: dict):
    """Hold ``--out`` (rank 0 locks its path, so two jobs on a host never write one) and
    ``--checkpoint-dir`` for this run (see :func:`mpidp.run.checkpoint.claim`), and record
    the data's fingerprint in ``config``. Yields the run id (None without checkpoints).
    Collective."""
    held: dict = {}

    def take() -> str | None:
        held["out"] = hold_folder(args.out, "--out")
        if not args.checkpoint_dir:
            return None
        held["claim"] = ck.claim(args.checkpoint_dir, uuid.uuid4().hex, resume=args.resume,
                                 restart=args.restart)
        return held["claim"].run_id

    try:
        run_id = C.root_decides(comm, take)
        if args.checkpoint_dir:
            config["data_fingerprint"] = D.data_fingerprint(  # all of its bytes, ranks sharing
                comm, args.dataset,
                together=args.distribute == "local" and O.mode_of(args) != "async-ps")
        yield run_id
    finally:
        if "claim" in held:
            held["claim"].release()
        if held.get("out") is not None:
            os.close(held["out"])


def _load_data(comm: C.Comm, args: argparse.Namespace, server: int | None) -> D.Data:
    """Load the dataset over all ranks, or (dedicated parameter server) over the workers only,
    the server getting empty shards. Collective; errors reach every rank, said once."""
    kw = dict(distribute=args.distribute, copy=args.copy_data, seed=args.seed,
              test_fraction=args.test_fraction, val_fraction=args.val_fraction,
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
        data.name, data.sample_shape, data.n_outputs, data.classification, data.train.n_total,
        data.test.n_total, data.train.y.dtype, data.train.y.shape[1:], data.test_split,
        data.val.n_total if data.val is not None else 0), root=first_worker)
    if data is not None:
        return data
    name, shape, n_out, classification, n_train, n_test, y_dtype, y_shape, split, n_val = meta
    empty = lambda n: D.Shard(np.empty((0, *shape), args.dtype), np.empty((0, *y_shape), y_dtype),
                              0, n)
    return D.Data(empty(n_train), empty(n_test), name, int(np.prod(shape)), n_out,
                  classification, sample_shape=shape, test_split=split,
                  val=empty(n_val) if n_val else None)


BEST = "best.npz"  # the best validation epoch's model, in OUT


def _check_model(args: argparse.Namespace) -> None:
    """ValueError naming the option, the mode and the reason when ``--model`` (a model
    file) holds a layer the chosen ``--parallel`` / ``--sync`` cannot train."""
    if not is_model_file(args.model):
        return
    specs = read_model_file(args.model)
    missing = unregistered(specs)
    if missing:
        raise ValueError(f"--model {args.model}: layer class {missing[0]!r} is not registered: "
                         f"{HINT}")
    layers = layers_from(specs, 1, where=f"--model {args.model}")
    why = refuses_model(frozenset().union(*(layer.needs for layer in layers)), args.parallel,
                        args.sync)
    if why:
        raise ValueError(f"--model {args.model}: {why}")


def _check_inputs(comm: C.Comm, args: argparse.Namespace, layers: list, data: D.Data) -> None:
    """Every rank checks its rows against a first layer that takes token ids (an
    ``Embedding``); one error on every rank, before any work, if a row holds another value.
    Collective."""
    error = None
    if isinstance(layers[0], nn.Embedding):
        try:
            for shard in (data.train, data.test):
                layers[0].token_ids(shard.X)
        except ValueError as exc:
            error = f"--dataset {args.dataset} does not suit --model {args.model}: {exc}"
    C.agree(comm, error)


def _layers(args, data: D.Data) -> tuple[list, nn.Loss]:
    """The unbound layers and loss that ``--model`` names, for ``data``'s samples (with a
    ``Standardize`` in front for ``--standardize``)."""
    sparse = isinstance(data.train.X, CSR)
    if args.standardize and sparse:
        raise ValueError(f"--standardize does not apply to --dataset {args.dataset}: its rows "
                         f"are sparse, and centring them would make them dense")
    layers, loss = nn.model_layers(args.model, data.sample_shape, data.n_outputs, args.hidden,
                                   data.classification, sparse)
    return ([nn.Standardize(), *layers] if args.standardize else layers), loss


def _fits(args, data: D.Data, share: float, ranks_here: int) -> None:
    """ValueError, with the figure and the fix, when the model cannot fit in memory (or
    ``--val-fraction`` left no validation rows to watch)."""
    if args.val_fraction and data.val is None:
        raise ValueError(f"--val-fraction {args.val_fraction} leaves no validation rows of the "
                         f"{data.train.n_total} training samples: give a larger fraction")
    layers, _ = _layers(args, data)
    try:
        count, activations = memory.model_size(layers, data.sample_shape)
    except ValueError as exc:
        raise ValueError(f"--model {args.model}: {exc}") from None
    need = memory.estimate_counts(count, activations, args.dtype, args.optimizer,
                                  args.batch_size, share)
    layers = f", hidden {','.join(map(str, args.hidden))}" if args.model == "mlp" else ""
    size = (f"the {args.model} model of {count:,} parameters ({data.n_features} features, "
            f"{data.n_outputs} outputs{layers})")
    try:
        memory.check(need, ranks_here, size)
    except ValueError as exc:
        hint = (" (outputs come from the largest class label + 1: check the labels or set "
                "--n-classes)" if data.classification and args.n_classes is None
                and data.n_outputs > 10_000 else "")
        fixes = ["smaller --hidden layers" if args.model == "mlp" else None,
                 "--dtype float32" if args.dtype == "float64" else None,
                 "fewer ranks per node", "a node with more memory"]
        raise ValueError(f"{exc}{hint}; use " + ", ".join(f for f in fixes if f)) from None


class _Report:
    """One line per epoch on rank 0."""

    def __init__(self, comm: C.Comm, epochs: int) -> None:
        self.comm, self.epochs = comm, epochs

    def __call__(self, r: dict) -> None:
        acc = "" if r.get("accuracy") is None else f"  acc {r['accuracy']:.4f}"
        held = ""
        for name in ("val", "test"):
            if f"{name}_loss" in r:
                held += f"  {name} loss {r[f'{name}_loss']:.4f}"
            if r.get(f"{name}_accuracy") is not None:
                held += f"  {name} acc {r[f'{name}_accuracy']:.4f}"
            elif r.get(f"{name}_r2") is not None:
                held += f"  {name} r2 {r[f'{name}_r2']:.4f}"
        secs = "" if r.get("seconds") is None else f"  ({r['seconds']:.2f}s)"
        skipped = f"  skipped {r['skipped']} steps (NaN/Inf)" if r.get("skipped") else ""
        say(self.comm, f"epoch {r['epoch']:>3}/{self.epochs}  loss {r['loss']:.4f}{acc}{held}"
            f"{secs}{skipped}")


@dataclass
class _Job:
    """One ``mpidp train`` job: its options, communicator and what watches over it."""

    args: argparse.Namespace
    comm: C.Comm
    config: dict  # the settings recorded in checkpoints and OUT/config.toml
    run_id: str | None  # the checkpoint folder's owner (None: no checkpoints)
    watchdog: C.Watchdog | None
    stop: StopSignals
    t_start: float
    best: _Best | None = None  # keeps OUT/best.npz when there is a validation set

    @contextmanager
    def loading(self):
        """Loading the data: watched (up to ten watchdog timeouts: a file system that does
        not answer ends the job), and a stop signal ends the job at once."""
        if self.watchdog is not None:
            self.watchdog.start()
        with self.stop.during("loading the data"), C.excused("loading the data"):
            yield

    def spec(self, watch: Watch, **settings) -> RunSpec:
        """The run specification the options ask for (``settings``: what the mode adds,
        e.g. its partition and the checkpoint to resume from)."""
        a = self.args
        checkpoint = (Checkpointing(a.checkpoint_dir, a.checkpoint_every, a.keep_checkpoints,
                                    self.config, self.run_id) if a.checkpoint_dir else None)
        return RunSpec(a.epochs, a.batch_size, a.seed, not a.no_shuffle, a.drop_last,
                       **{"check_every": a.check_every, "checkpoint": checkpoint,
                          "progress": "none" if a.no_progress or a.quiet else a.progress,
                          "on_epoch": _both(_Report(self.comm, a.epochs), watch.epoch,
                                            *([self.best] if self.best else [])),
                          "early_stopping": (EarlyStopping(a.early_stopping, a.min_delta)
                                             if a.early_stopping else None),
                          "max_skipped": a.max_skipped,
                          "plateau": (ReduceOnPlateau(a.plateau_factor, a.plateau_patience,
                                                      a.min_delta)
                                      if a.lr_schedule == "plateau" else None),
                          "on_step": watch.step, "stop": self.stop, "watchdog": self.watchdog,
                          **settings})

    def resume(self, found, watch: Watch) -> ck.State | None:
        """The state to resume from (``--resume``), given what restoring ``found``."""
        state = resumed(self.comm, self.args, self.config, found) if self.args.resume else None
        watch.epoch_index = state.epoch if state is not None else 0
        if state is not None and self.best is not None:
            self.best.resume(state.history)
        return state

    def metrics(self, history: list[dict], n_params: int, steps: int, timings) -> dict:
        last = history[-1]
        return {"world_size": self.comm.size, "mode": O.mode_of(self.args),
                "epochs": self.args.epochs, "final_loss": last["loss"],
                "train_accuracy": last["accuracy"], "test_loss": last.get("test_loss"),
                "test_accuracy": last.get("test_accuracy"), "params_in_sync": True,
                "n_params": n_params, "wall_s": time.perf_counter() - self.t_start,
                "history": history, "steps": steps, "timings": timings,
                "mpi": C.mpi_info(self.comm), "config": self.config}


def train(args: argparse.Namespace, comm: C.Comm, given: set[str]) -> dict | None:
    """Run ``mpidp train``. Collective. Returns the metrics on rank 0, None elsewhere."""
    t_start = time.perf_counter()
    setup_logging(args.quiet, args.verbose)
    if "epochs" not in given:
        args.epochs = nn.default_epochs(args.model)
    errors = O.problems(args, given, comm.size) or _strategy_problems(args)
    try:
        faults.parse(os.environ.get("MPIDP_FAULT"))
    except ValueError as exc:
        errors.append(str(exc))
    try:
        line_seconds()  # a bad MPIDP_PROGRESS_SECONDS: refused before any work
    except C.MpidpError as exc:
        errors.append(str(exc))
    if errors:  # every rank computes the same list from the same arguments
        raise C.MpidpError("; ".join(errors))
    C.run_agreed(comm, import_modules, imports_of(args))  # the user's layers, before a model
    vars(args)["import"] = absolute_paths(imports_of(args))  # recorded so a resume finds them
    C.run_agreed(comm, _check_model, args)  # a bad model file or a refused layer: before any work
    C.root_decides(comm, check_out, args)
    if comm.rank == 0 and os.path.isdir(args.out):
        clean_stale_tmp(args.out)  # what a writer killed mid-write left behind
    watchdog = C.Watchdog(comm, args.watchdog or None) if args.watchdog != 0 else None
    stop, config = StopSignals(comm), _config(args, comm)
    try:
        with claimed(comm, args, config) as run_id:  # before any work: a used folder is refused
            job = _Job(args, comm, config, run_id, watchdog, stop, t_start)
            if O.mode_of(args) in O.MODEL_PARALLEL:
                return _train_model_parallel(job)
            return _train_data_parallel(job)
    finally:
        stop.close()
        if watchdog is not None:
            watchdog.stop()


class _Best:
    """``on_epoch`` (every rank): OUT/best.npz, the model of the epoch with the lowest
    validation loss so far, written atomically by rank 0. ``whole`` gives the whole model
    (on rank 0; collective for a pipeline, whose stages gather it)."""

    def __init__(self, comm: C.Comm, args: argparse.Namespace, whole, meta: dict) -> None:
        self.comm, self.path, self.whole, self.meta = comm, os.path.join(args.out, BEST), whole, meta
        self.loss, self.epoch = math.inf, None

    def resume(self, history: list[dict]) -> None:
        for record in history:  # a resumed run's best so far (the same figures everywhere)
            if record.get("val_loss") is not None and record["val_loss"] < self.loss:
                self.loss, self.epoch = record["val_loss"], record["epoch"]

    def __call__(self, record: dict) -> None:
        loss = record.get("val_loss")
        if loss is None or not loss < self.loss:  # a global figure: the same verdict everywhere
            return
        self.loss, self.epoch = loss, record["epoch"]
        model = self.whole()
        if self.comm.rank == 0:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            nn.save(model, self.path, meta={**self.meta, "epoch": self.epoch, "val_loss": loss})

    def summary(self) -> dict | None:
        return None if self.epoch is None else {"file": BEST, "epoch": self.epoch,
                                                "val_loss": self.loss}


def _model_meta(args: argparse.Namespace, data: D.Data) -> dict:
    """What ``model.npz`` (and ``best.npz``) records of the run besides the model."""
    return {"model": args.model, "hidden": list(args.hidden), "n_features": data.n_features,
            "sample_shape": list(data.sample_shape), "n_outputs": data.n_outputs,
            "classification": data.classification, "standardized": bool(args.standardize)}


def _optimizer(args: argparse.Namespace, n_train: int):
    """A factory of the optimizer the options ask for, its rate a schedule of the update
    count: epochs in the options become updates (``n_train`` training samples in global
    batches; accumulation updates once per group)."""
    steps = steps_per_epoch(n_train, args.batch_size, args.drop_last)
    per_epoch = -(-steps // args.sync_every) if args.sync == "accumulate" else steps
    lr = args.lr if args.lr_scaling == "none" else nn.scaled_lr(
        args.lr, args.batch_size, args.base_batch, args.lr_scaling)
    warmup = args.warmup_steps or int(round(args.warmup_epochs * per_epoch))
    total = max(args.epochs * per_epoch - warmup, 1)
    name, settings = args.lr_schedule, {}
    if name == "step":
        settings = {"step_size": args.lr_step_epochs * per_epoch, "gamma": args.lr_gamma}
    elif name == "multistep":
        settings = {"milestones": [max(m * per_epoch - warmup, 0) for m in args.lr_milestones],
                    "gamma": args.lr_gamma}
    elif name == "exponential":
        settings = {"gamma": args.lr_gamma ** (1.0 / per_epoch)}
    elif name == "cosine":
        settings = {"total": total, "min_lr": args.lr_min}
    elif name == "polynomial":
        settings = {"total": total, "end_lr": args.lr_min}
    schedule = nn.make_schedule("constant" if name == "plateau" else name, lr, warmup=warmup,
                                **settings)
    return lambda: nn.make_optimizer(args.optimizer, schedule, args.momentum, args.weight_decay,
                                     clip_norm=args.clip_norm, clip_value=args.clip_value)


def _standardize(comm: C.Comm, layer: nn.Standardize, X: np.ndarray) -> None:
    """Fit ``layer`` to the exact mean and standard deviation of every rank's ``X`` together:
    one ``Allreduce`` of the counts and sums, one of the centred sums of squares."""
    count, mean = pass1_mean(C.allreduce_sum_(comm, pass1_sums(X)))
    layer.fit_(count, mean, C.allreduce_sum_(comm, pass2_squares(X, mean)))


def _held_out(data: D.Data):
    """The sets evaluated after every epoch: the test set, and the validation set first."""
    return data.test if data.val is None else {"val": data.val, "test": data.test}


def _both(*callbacks):
    def call(record: dict) -> None:
        for cb in callbacks:
            cb(record)
    return call


def _strategy_problems(args: argparse.Namespace) -> list[str]:
    """What ``--sync overlapped`` refuses of the other options, known before any data: the
    strategy as the options make it, asked about the optimizer and the NaN policy."""
    if O.mode_of(args) != "overlapped":
        return []
    try:
        sync = make_sync("overlapped", bucket_bytes=int(args.bucket_mb * 2**20),
                         overlap_progress=args.overlap_progress,
                         overlap_finish=args.overlap_finish)
        optimizer = nn.make_optimizer(args.optimizer, args.lr, args.momentum, args.weight_decay,
                                      clip_norm=args.clip_norm, clip_value=args.clip_value)
    except (C.MpidpError, ValueError) as exc:
        return [str(exc)]
    why = sync.refuses_run(optimizer, args.on_nonfinite)
    return [why] if why else []


def _data_parallel_trainer(job: _Job, data: D.Data) -> DataParallel:
    """The model and its data-parallel trainer, as the options say. Collective."""
    args, comm = job.args, job.comm
    layers, loss = C.run_agreed(comm, _layers, args, data)
    _check_inputs(comm, args, layers, data)
    make_opt = _optimizer(args, data.train.n_total)
    name = "allreduce" if args.sync == "async-ps" else args.sync  # async: eval only
    # a resumed run keeps its checkpoint's settings: those of another mode do not apply
    applies = lambda dest: name in O.TABLE[dest][0]  # noqa: E731
    sync = make_sync(name, make_opt, bucket_bytes=int(args.bucket_mb * 2**20),
                     codec=args.compress if applies("compress") else None,
                     dedicated=O.dedicated_server(args), k=args.sync_every,
                     ps_shared_memory=args.ps_transport == "shared",
                     ps_chunk_bytes=max(1, int(args.ps_chunk_mb * 2**20)),
                     node_aware={"auto": None, "on": True, "off": False}[args.node_aware]
                     if applies("node_aware") else None,
                     overlap_progress=args.overlap_progress if applies("overlap_progress")
                     else "test",
                     overlap_finish=args.overlap_finish if applies("overlap_finish")
                     else "backward")
    dp = make_trainer("data", layers, data.sample_shape, make_opt(), loss, comm,
                      dtype=args.dtype, init_sync=args.init_sync,
                      on_nonfinite=args.on_nonfinite, sync=sync)
    dp.model.init_(np.random.default_rng(args.seed))  # the same numbers on every rank
    if args.standardize:
        _standardize(comm, dp.model.layers[0], data.train.X)
    dp.sync_params(args.init_sync)  # rank 0's initial model everywhere (bcast), or checked
    apply_slowdown(args, comm, dp.timer)
    return dp


def _train_data_parallel(job: _Job) -> dict | None:
    args, comm = job.args, job.comm
    with job.loading():
        data = _load_data(comm, args, server=0 if O.dedicated_server(args) else None)
    C.run_agreed(comm, _fits, args, data, 1.0, C.local_ranks(comm))
    dp = _data_parallel_trainer(job, data)
    if data.val is not None:
        job.best = _Best(comm, args, lambda: dp.model, _model_meta(args, data))
    watch = Watch(comm, outputs(args), dp.timer, job.config)
    if args.sync != "async-ps":  # async-ps counts its steps otherwise: said at the end
        watch.check_steps(args.epochs * steps_per_epoch(data.train.n_total, args.batch_size,
                                                        args.drop_last))
    how = dp.sync.describe()
    _announce(comm, args, data, f"model: {dp.model!r}", *([how] if how else []))
    log.debug(f"[rank {comm.rank}] {C.mpi_info(C.self_comm())['processor']}: "
              f"{len(data.train.X)} train rows, {len(data.test.X)} test rows")
    resume = job.resume(restore(comm, args.checkpoint_dir, dp.model, dp.optimizer)
                        if args.resume else None, watch)
    try:
        if args.sync == "async-ps":
            history, extra = _fit_async(job, dp, data, job.spec(  # the server reports
                watch, resume=resume, on_epoch=None, on_step=None, progress=False))
        else:
            history = fit(dp, data.train, test=_held_out(data), spec=job.spec(
                watch, partition=partition_of(args, data), resume=resume))
            extra = {"balance": history[-1]["balance"]}
            say(comm, "last epoch: " + format_balance(extra["balance"], per_rank=False))
        watch.finish(history)
        dp.check_replicas()  # a mismatch is a failed run: every rank raises, nothing is written
    finally:
        watch.close_history()
    scores = {name: dp.evaluate(shard.X, shard.y).scores  # the figures in full, at the end
              for name, shard in (("val", data.val), ("test", data.test))
              if shard is not None and shard.n_total}
    timings = gather_timings(comm, dp.timer)
    if comm.rank != 0:
        return None
    undecided = dp.sync.undecided() if args.sync == "auto" else None
    if undecided:
        print(f"mpidp: {undecided}", file=sys.stderr, flush=True)
    metrics = job.metrics(history, dp.model.n_params, dp.global_step, timings)
    metrics.update(skipped_steps=dp.skipped_steps + extra.get("async", {}).get("skipped", 0),
                   sync=args.sync, balance=extra.pop("balance", None), **extra,
                   **({"auto": dp.sync.report or undecided}
                      if args.sync == "auto" else {}),
                   bytes_sent_per_step=dp.sync.bytes_sent / max(dp.global_step, 1),
                   scores=scores, best=job.best.summary() if job.best else None)
    return finish(comm, args, metrics, dp.model, data, "bit-identical (checked)")


def _fit_async(job: _Job, dp: DataParallel, data: D.Data, spec: RunSpec) -> tuple[list, dict]:
    """``--sync async-ps``: train asynchronously, then evaluate; one history entry per epoch
    (the workers' training loss as the server received it) and the server's summary."""
    t0 = time.perf_counter()
    ps = AsyncPS(dp.model, dp.optimizer, dp.loss, job.comm, job.args.max_staleness,
                 job.args.on_nonfinite, dp.timer)
    stats = fit_async(ps, data.train, spec=spec)
    history = [{"epoch": e + 1, "loss": s / c, "accuracy": None, "seconds": None}
               for e, (s, c) in sorted((int(k), v) for k, v in stats.epoch_loss.items())]
    if not history:
        raise C.MpidpError("async-ps applied no update (every push was dropped or skipped)")
    ev = dp.evaluate(data.test.X, data.test.y) if data.test.n_total else None
    if ev is not None:
        history[-1].update(test_loss=ev.loss,
                           test_accuracy=ev.accuracy if data.classification else None)
    history[-1]["seconds"] = time.perf_counter() - t0
    _Report(job.comm, job.args.epochs)(history[-1])
    return history, {"async": stats.summary()}


def _announce(comm, args, data: D.Data, *lines: str) -> None:
    mpi = C.mpi_info(comm)
    say(comm, f"mpidp train: {O.mode_of(args)} on {comm.size} rank(s), "
        f"{' '.join(mpi['library'].split())} (mpi4py {mpi['mpi4py']})",
        f"data: {data.name}, {data.train.n_total} train / {data.test.n_total} test samples, "
        f"{_features(data)}, {data.n_outputs} outputs", *lines)


def _features(data: D.Data) -> str:
    if len(data.sample_shape) == 1:
        return f"{data.n_features} features"
    return f"samples of shape {'x'.join(map(str, data.sample_shape))}"


def _train_model_parallel(job: _Job) -> dict | None:
    """``--parallel pipeline|hybrid``: every rank loads the whole training set (the first
    stage needs the inputs, the last the targets) and builds only its own stage. Read as
    one rank's local rows, so a file that can be mapped is (unless ``--copy-data``): the
    ranks of a node then share one copy in the page cache instead of one each."""
    args, comm = job.args, job.comm
    with job.loading():
        data = C.run_agreed(comm, D.load, C.self_comm(), args.dataset, distribute="local",
                            copy=args.copy_data, seed=args.seed,
                            test_fraction=args.test_fraction, val_fraction=args.val_fraction,
                            dtype=args.dtype,
                            n_classes=args.n_classes, n_samples=args.n_samples,
                            n_features=args.n_features,
                            regression=args.model == "linear" and args.dataset == "synthetic")
    C.run_agreed(comm, _fits, args, data, 1.0 / max(comm.size // 2, 1), C.local_ranks(comm))
    layers, loss = C.run_agreed(comm, _layers, args, data)
    _check_inputs(comm, args, layers, data)
    optimizer = _optimizer(args, data.train.n_total)()
    pipe = make_trainer(args.parallel, layers, data.sample_shape, optimizer, loss, comm,
                        dtype=args.dtype, micro_batches=args.micro_batches,
                        schedule=args.schedule, on_nonfinite=args.on_nonfinite)
    pipe.init_(np.random.default_rng(args.seed))  # the same initial model as --parallel data
    if args.standardize and pipe.first:  # every rank holds the whole training set
        pipe.model.layers[0].fit_(*moments(data.train.X))
    if data.val is not None:
        job.best = _Best(comm, args, lambda: _whole_model(job, pipe, data),
                         _model_meta(args, data))
    apply_slowdown(args, comm, pipe.timer)
    watch = Watch(comm, outputs(args), pipe.timer, job.config)
    watch.check_steps(args.epochs * steps_per_epoch(data.train.n_total, args.batch_size,
                                                    args.drop_last))
    _announce(comm, args, data, f"{pipe.n_stages} stages x {pipe.n_replicas} replicas, "
              f"{args.micro_batches} micro-batches, {args.schedule}; stage bounds (layers) "
              f"{pipe.plan.bounds}")
    resume = job.resume(pipe.restore(args.checkpoint_dir) if args.resume else None, watch)
    try:
        held = {name: (shard.X, shard.y) for name, shard in
                (("val", data.val), ("test", data.test)) if shard is not None}
        history = fit_pipeline(pipe, (data.train.X, data.train.y), test=held,
                               spec=job.spec(watch, resume=resume))
        watch.finish(history)
        pipe.check_replicas()
    finally:
        watch.close_history()
    return _pipeline_metrics(job, pipe, data, history)


def _whole_model(job: _Job, pipe, data: D.Data) -> nn.Sequential | None:
    """The whole model on rank 0 (stage 0 of replica 0), None elsewhere: every stage's
    parameters gathered, the layer state (a Standardize in front) from stage 0. Collective."""
    full = pipe.gather_params(0)
    if job.comm.rank != 0:
        return None
    model = nn.Sequential(_layers(job.args, data)[0], data.sample_shape, job.args.dtype)
    model.params[...] = full
    model.state[:pipe.model.n_state] = pipe.model.state  # only stage 0 holds state
    return model


def _pipeline_metrics(job: _Job, pipe, data: D.Data, history: list[dict]) -> dict | None:
    """Gather the whole model and the per-rank figures; on rank 0 write the outputs."""
    args, comm = job.args, job.comm
    model = _whole_model(job, pipe, data)
    scores = {}
    for name, shard in (("val", data.val), ("test", data.test)):
        if shard is not None and shard.n_total:  # each replica its block of the rows
            lo, hi = block_range(shard.n_total, pipe.n_replicas, pipe.replica)
            scores[name] = pipe.evaluate(shard.X[lo:hi], shard.y[lo:hi]).scores
    timings = gather_timings(comm, pipe.timer)
    held = C.gather_rows(comm, np.array(list(pipe.memory().values()), np.float64))
    if comm.rank != 0:
        return None
    metrics = job.metrics(history, model.n_params, pipe.global_step, timings)
    metrics.update(parallel=args.parallel, stages=pipe.n_stages, replicas=pipe.n_replicas,
                   stage_bounds=pipe.plan.bounds, skipped_steps=pipe.policy.skipped,
                   memory_per_rank=[dict(zip(pipe.memory(), map(int, row))) for row in held],
                   scores=scores, best=job.best.summary() if job.best else None)
    same = "bit-identical (checked)" if pipe.n_replicas > 1 else "one replica (nothing to compare)"
    return finish(comm, args, metrics, model, data, same)


def finish(comm: C.Comm, args: argparse.Namespace, metrics: dict, model: nn.Sequential,
           data: D.Data, replicas: str) -> dict:
    """On rank 0: write ``model.npz``, ``metrics.json`` and ``config.toml`` (all of them or,
    when one fails, none: :func:`mpidp.atomic.write_together`) and print the summary."""
    meta = _model_meta(args, data)
    texts = {"metrics.json": json.dumps(metrics, indent=2).encode(),
             "config.toml": config_file.dumps(O.applying(metrics["config"])).encode()}
    write_together([(os.path.join(args.out, "model.npz"),
                     lambda path: nn.save(model, path, meta=meta)),
                    *((os.path.join(args.out, name), lambda path, text=text: write_atomic(
                        path, lambda f: f.write(text))) for name, text in texts.items())],
                   what="--out")
    last = metrics["history"][-1]
    final = f"final: loss {last['loss']:.4f}"
    if last.get("test_accuracy") is not None:
        final += f", test accuracy {last['test_accuracy']:.4f}"
    test = metrics.get("scores", {}).get("test", {})
    if "f1_macro" in test:
        final += f", macro F1 {test['f1_macro']:.4f}"
    elif test.get("r2") is not None:
        final += f", test R^2 {test['r2']:.4f}"
    if metrics.get("best"):
        b = metrics["best"]
        final += f"; best validation loss {b['val_loss']:.4f} at epoch {b['epoch']} ({BEST})"
    per_epoch = [h["balance"]["per_rank"] for h in metrics["history"]  # this world's epochs
                 if len(h.get("balance", {}).get("per_rank", ())) == comm.size]
    wait = [sum(e[r]["wait_s"] for e in per_epoch) for r in range(comm.size)] if per_epoch \
        else None
    say(comm, final, f"replicas: {replicas}", "per rank, whole run:",
        format_timings(metrics["timings"], wait), f"wrote {args.out}/: model.npz, metrics.json, "
        f"config.toml, history.jsonl{', ' + BEST if metrics.get('best') else ''} "
        f"({metrics['wall_s']:.1f}s)")
    return metrics
