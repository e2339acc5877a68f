"""One ``mpidp train`` job: its options, communicator and what watches over it, the
:class:`~mpidp.RunSpec` its options ask for, the checkpoint it resumes from, the best model
it keeps and the figures of its ``metrics.json``."""

from __future__ import annotations

import argparse
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

from .. import comm as C
from ..data import distribute as D
from ..observe.best import BestModel
from ..observe.report import EpochReport
from ..observe.watch import Watch
from ..run import checkpoint as ck
from ..run.early_stopping import EarlyStopping, ReduceOnPlateau
from ..run.signals import StopSignals
from ..run.spec import Checkpointing, RunSpec
from . import options as O
from .outputs import BEST, model_meta
from .settings import resumed


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

    @contextmanager
    def loading(self):
        """Loading the data: watched (up to ten watchdog timeouts: a file system that does
        not answer ends the job), and a stop signal ends the job at once."""
        if self.watchdog is not None:
            self.watchdog.start()
        with self.stop.during("loading the data"), C.excused("loading the data"):
            yield

    def keep_best(self, model, data: D.Data) -> None:
        """Keep OUT/best.npz when there is a validation set (``model``: see
        :class:`~mpidp.observe.best.BestModel`)."""
        if data.val is not None:
            self.best = BestModel(os.path.join(self.args.out, BEST), model, comm=self.comm,
                                  meta=model_meta(self.args, data))

    def spec(self, watch: Watch, **settings) -> RunSpec:
        """The run specification the options ask for (``settings``: what the mode adds,
        e.g. its partition and the checkpoint to resume from)."""
        a = self.args
        checkpoint = (Checkpointing(a.checkpoint_dir, a.checkpoint_every, a.keep_checkpoints,
                                    self.config, self.run_id, self.best)
                      if a.checkpoint_dir else None)
        return RunSpec(a.epochs, a.batch_size, a.seed, not a.no_shuffle, a.drop_last,
                       **{"check_every": a.check_every, "checkpoint": checkpoint,
                          "progress": "none" if a.no_progress or a.quiet else a.progress,
                          "on_epoch": _all(self._report(a.epochs), watch.epoch,
                                            *([self.best] if self.best else [])),
                          "early_stopping": (EarlyStopping(a.early_stopping, a.min_delta)
                                             if a.early_stopping else None),
                          "max_skipped": a.max_skipped,
                          "plateau": (ReduceOnPlateau(a.plateau_factor, a.plateau_patience,
                                                      a.min_delta)
                                      if a.lr_schedule == "plateau" else None),
                          "on_step": watch.step, "stop": self.stop, "watchdog": self.watchdog,
                          **settings})

    def _report(self, epochs: int) -> EpochReport:
        self.report = EpochReport(self.comm, epochs)  # kept: an elastic run moves it
        return self.report

    def resume(self, found, watch: Watch) -> ck.State | None:
        """The state to resume from (``--resume``), given what restoring ``found``."""
        state = (resumed(self.comm, self.args.checkpoint_dir, self.config, found)
                 if self.args.resume else None)
        watch.epoch_index = state.epoch if state is not None else 0
        if state is not None and self.best is not None:
            self.best.resume(state.history, state.best)
        return state

    def metrics(self, history: list[dict], n_params: int, steps: int, timings, scores: dict,
                **mode) -> dict:
        """``metrics.json``: the figures of every mode, then ``mode``'s own."""
        last = history[-1]
        return {"world_size": self.comm.size, "mode": O.mode_of(self.args),
                "epochs": self.args.epochs, "final_loss": last["loss"],
                "train_accuracy": last["accuracy"], "test_loss": last.get("test_loss"),
                "test_accuracy": last.get("test_accuracy"), "params_in_sync": True,
                "n_params": n_params, "wall_s": time.perf_counter() - self.t_start,
                "history": history, "steps": steps, "timings": timings,
                "mpi": C.mpi_info(self.comm), "config": self.config, **mode, "scores": scores,
                "best": self.best.summary() if self.best else None}



def _all(*callbacks):
    def call(record: dict) -> None:
        for cb in callbacks:
            cb(record)
    return call
