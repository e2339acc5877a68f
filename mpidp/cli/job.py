"""One ``mpidp train`` job (:class:`Job`): its data, loaded and partitioned, the
:class:`~mpidp.RunSpec` its options ask for, and what it writes in ``--out``: checked before
any work (:func:`check_out`), then the live outputs, and at the end ``model.npz``,
``metrics.json`` and ``config.toml``."""

from __future__ import annotations

import argparse
import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from .. import comm as C
from .. import nn
from ..atomic import check_folder, check_place, numpy_kind, write_atomic, write_together
from ..comm.elastic import known_members
from ..data import distribute as D
from ..data.balance import Partition
from ..data.partition import steps_per_epoch
from ..observe.best import BestModel
from ..observe.report import EpochReport, announce, summary
from ..observe.watch import Outputs, Watch, say
from ..run import checkpoint as ck
from ..run import faults
from ..run.early_stopping import EarlyStopping, ReduceOnPlateau
from ..run.signals import StopSignals
from ..run.spec import Checkpointing, RunSpec
from . import config as config_file
from . import options as O
from .settings import resumed

BEST = "best.npz"  # the best validation epoch's model, in OUT


def _costs_arg(path: str):
    if path in ("auto", "uniform"):
        return None
    check_place(path, "--costs")
    try:  # only a .npy file goes to NumPy (see numpy_kind)
        if numpy_kind(path) == ".npy":
            return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--costs {path!r}: cannot read a .npy file ({exc})") from exc
    raise ValueError(f"--costs {path!r} is not a .npy file: give one cost per dataset row, "
                     f"as np.save writes them")


def load_settings(args: argparse.Namespace) -> dict:
    """Keyword arguments for :func:`mpidp.load` that every mode gives."""
    return dict(copy=args.copy_data, seed=args.seed, test_fraction=args.test_fraction,
                val_fraction=args.val_fraction, dtype=args.dtype, n_classes=args.n_classes,
                n_samples=args.n_samples, n_features=args.n_features,
                regression=args.model == "linear" and args.dataset == "synthetic")


def load_data(comm: C.Comm, args: argparse.Namespace, server: int | None) -> D.Data:
    """Load the dataset over all ranks, or (dedicated parameter server) over the workers only,
    the server getting empty shards. Collective."""
    def load(over: C.Comm) -> D.Data:
        return D.load(over, args.dataset, distribute=args.distribute, **load_settings(args),
                      partition=args.partition, capacities=args.capacities,
                      costs=C.run_agreed(over, _costs_arg, args.costs))
    return load(comm) if server is None else D.load_on_workers(comm, server, load, args.dtype)


def partition_of(args: argparse.Namespace, data: D.Data) -> Partition | None:
    """The training partition the options ask for; None with a dedicated server (the
    shards stay as loaded, over the workers)."""
    if O.dedicated_server(args):
        return None
    costs = None if args.costs == "uniform" else data.costs
    return Partition(args.partition, costs, args.capacities, args.adapt_every, args.seed)


def check_out(args: argparse.Namespace) -> None:
    """ValueError unless every output can be written and ``OUT/config.toml`` can record the
    settings."""
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out!r} exists and is not a folder")
    check_folder(args.out, "--out")
    if args.checkpoint_dir:
        check_folder(args.checkpoint_dir, "--checkpoint-dir")
    config_file.check_recordable(O.applying(vars(args)))
    Watch.check(outputs(args))


def outputs(args: argparse.Namespace) -> Outputs:
    """Where the run's live outputs go, from the options."""
    return Outputs(args.out, args.log_every, args.tensorboard, args.trace, args.trace_steps)


def model_meta(args: argparse.Namespace, data: D.Data) -> dict:
    """What ``model.npz`` (and ``best.npz``) records of the run besides the model."""
    return {"model": args.model, "hidden": list(args.hidden), "n_features": data.n_features,
            "sample_shape": list(data.sample_shape), "n_outputs": data.n_outputs,
            "classification": data.classification, "standardized": bool(args.standardize)}


@dataclass
class Job:
    """One ``mpidp train`` job: its options, communicator and what watches over it."""

    args: argparse.Namespace
    comm: C.Comm
    config: dict  # the settings recorded in checkpoints and OUT/config.toml
    run_id: str | None  # the checkpoint folder's owner (None: no checkpoints)
    watchdog: C.Watchdog | None
    stop: StopSignals
    t_start: float
    best: BestModel | None = None  # keeps OUT/best.npz when there is a validation set
    lost: list[dict] = field(default_factory=list)  # elastic: ranks lost before the first step
    started: bool = False  # the first step was taken

    def __post_init__(self) -> None:
        self.faults = faults.Injector(known_members(self.comm)[0][self.comm.rank])  # by the
        # rank in the first world (an elastic run's survivors prepare again)

    @contextmanager
    def loading(self):
        """Loading the data: excused by the watchdog, and ended at once by a stop signal."""
        if self.watchdog is not None:
            self.watchdog.start()
        with self.stop.during("loading the data"), C.excused("loading the data"):
            self.faults.apply("load")
            yield

    def watch(self, timer, data: D.Data, model, *lines: str) -> Watch:
        """The run's live outputs (``timer``'s), its trace window checked against the steps the
        run takes (async-ps counts its own), once OUT/best.npz is kept where there is a
        validation set (``model``: see BestModel); then the run announced (``lines`` last)."""
        a = self.args
        if data.val is not None:
            self.best = BestModel(os.path.join(a.out, BEST), model, comm=self.comm,
                                  meta=model_meta(a, data))
        watch = Watch(self.comm, outputs(a), timer, self.config)
        if O.mode_of(a) != "async-ps":
            watch.check_steps(a.epochs * steps_per_epoch(data.train.n_total, a.batch_size,
                                                         a.drop_last))
        announce(self.comm, O.mode_of(a), data, *lines)
        return watch

    def spec(self, watch: Watch, **settings) -> RunSpec:
        """The run specification the options ask for (``settings``: what the mode adds)."""
        a = self.args
        checkpoint = (Checkpointing(a.checkpoint_dir, a.checkpoint_every, a.keep_checkpoints,
                                    self.config, self.run_id, self.best)
                      if a.checkpoint_dir else None)
        self.report = EpochReport(self.comm, a.epochs)  # kept: an elastic run moves it
        return RunSpec(a.epochs, a.batch_size, a.seed, not a.no_shuffle, a.drop_last,
                       **{"check_every": a.check_every, "checkpoint": checkpoint,
                          "progress": "none" if a.no_progress or a.quiet else a.progress,
                          "on_epoch": _all(self.report, watch.epoch,
                                            *([self.best] if self.best else [])),
                          "early_stopping": (EarlyStopping(a.early_stopping, a.min_delta)
                                             if a.early_stopping else None),
                          "max_skipped": a.max_skipped,
                          "plateau": (ReduceOnPlateau(a.plateau_factor, a.plateau_patience,
                                                      a.min_delta)
                                      if a.lr_schedule == "plateau" else None),
                          "on_step": watch.step, "stop": self.stop, "watchdog": self.watchdog,
                          **settings})

    def resume(self, restoring, watch: Watch) -> ck.State | None:
        """The state to resume from (``--resume``), given what ``restoring()`` found."""
        state = (resumed(self.comm, self.args.checkpoint_dir, self.config, restoring())
                 if self.args.resume else None)
        watch.epoch_index = state.epoch if state is not None else 0
        if state is not None:
            watch.resumed(state.history)
        if state is not None and self.best is not None:
            self.best.resume(state.history, state.best)
        return state

    def finish(self, model: nn.Sequential, data: D.Data, verdict: str, history: list[dict],
               steps: int, timings, scores: dict, **mode) -> dict:
        """On rank 0: write ``model.npz``, ``metrics.json`` (with ``mode``'s own figures) and
        ``config.toml`` (all or none), print the summary; returns the metrics."""
        last, out, comm = history[-1], self.args.out, self.comm
        metrics = {"world_size": comm.size, "mode": O.mode_of(self.args),
                   "epochs": self.args.epochs, "final_loss": last["loss"],
                   "train_accuracy": last["accuracy"], "test_loss": last.get("test_loss"),
                   "test_accuracy": last.get("test_accuracy"), "params_in_sync": True,
                   "n_params": model.n_params, "wall_s": time.perf_counter() - self.t_start,
                   "history": history, "steps": steps, "timings": timings,
                   "mpi": C.mpi_info(comm), "config": self.config, **mode, "scores": scores,
                   "best": self.best.summary() if self.best else None}
        texts = {"metrics.json": json.dumps(metrics, indent=2).encode(),
                 "config.toml": config_file.dumps(O.applying(self.config)).encode()}
        write_together([(os.path.join(out, "model.npz"),
                         lambda path: nn.save(model, path, meta=model_meta(self.args, data))),
                        *((os.path.join(out, name), lambda path, text=text: write_atomic(
                            path, lambda f: f.write(text))) for name, text in texts.items())],
                       what="--out")
        say(comm, *summary(metrics, comm.size, out, verdict))
        return metrics


def _all(*callbacks):
    def call(record: dict) -> None:
        for cb in callbacks:
            cb(record)
    return call
