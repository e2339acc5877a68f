"""The one epoch loop, for every trainer. Per step: fault injection -> ``trainer.step`` ->
the watchdog's mark -> the replica check -> a checkpoint when due -> an agreed stop on
SIGTERM/SIGUSR1; per epoch: global totals, load balance, evaluation, history, ``on_epoch``.
The same global batches for any world size, the same steps on every rank."""

from __future__ import annotations

import dataclasses
import numbers
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any, Protocol

import numpy as np

from .. import comm as C
from ..errors import setting
from ..observe.progress import Progress, resolve
from .checkpoint import State, check_position
from .elastic import TooFewRanks
from .faults import Injector
from .nonfinite import NonFiniteError
from .signals import Preempted
from .spec import Checkpointing, RunSpec
from .stats import StepStats

__all__ = ["Checkpointing", "Feed", "RunSpec", "Trainer", "run"]


class Trainer(Protocol):
    """What the loop needs of a trainer (:class:`~mpidp.DataParallel`, a pipeline ...), and may use:
    ``timer`` (its ``tracer`` gets the loop's spans), ``policy`` (the NaN/Inf policy, whose ``skipped``
    count records report), ``optimizer`` (its ``lr_at``, and the ``lr_scale`` the plateau rule sets)."""

    world: C.Comm
    global_step: int
    stop_requested: bool | None  # this rank's stop request, sent with the next step

    def step(self, *batch: Any, last_of_epoch: bool = False) -> StepStats: ...
    def check_replicas(self) -> None: ...
    def poison_(self) -> None: ...  # the faults' "nan"
    def nudge_(self) -> None: ...  # the faults' "desync"
    def at_boundary(self) -> bool: ...  # replicas agree here (between synchronisations)
    def epoch_totals(self, totals: np.ndarray) -> np.ndarray: ...
    def save_checkpoint(self, directory: str, state: State, keep: int,
                        run_id: str | None = None) -> None: ...


class Feed(Protocol):
    """Where a trainer's batches come from, epoch by epoch, and what the loop must know."""

    n_steps: int
    labelled: bool  # accuracy means something (classification, or integer targets)

    def batches(self, epoch: int, first: int) -> Iterator[tuple]: ...
    def end_epoch(self) -> dict | None: ...  # the epoch's load-balance figures
    def evaluate(self) -> StepStats | None: ...
    def state(self) -> dict: ...  # what a checkpoint keeps of it (a partition's capacities)


def run(trainer: Trainer, feed: Feed, spec: RunSpec) -> list[dict]:
    """Train until ``spec.epochs`` epochs are done, or a callback asks to stop. Collective.
    Returns the history, the same on every rank: a dict per epoch (``epoch, loss, accuracy,
    seconds`` and, when measured, ``balance``, ``test_loss``, ``test_accuracy``;
    ``stopped_at``, the global step, when a callback's stop cut it short: it ends the run
    normally, with a checkpoint where they are on, not :class:`Preempted` as a signal does)."""
    job = _Run(trainer, feed, spec)
    try:  # NaN and Inf are the NaN policy's to report, in one line: no NumPy warnings
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            job.epochs()
    except (SystemExit, KeyboardInterrupt) as exc:  # from a callback: never leave others waiting
        _end_job(trainer.world, exc)
    return job.history


@contextmanager
def watched_run(spec: RunSpec, comm: C.Comm, own: C.Watchdog | None = None):
    """``spec`` with its watchdog (see :class:`RunSpec`) made real for one run over ``comm``
    (collective; closed at the end); ``own``: the trainer's, which then serves."""
    dog, made = spec.watchdog, False
    if isinstance(dog, str) and own is not None:
        dog = None  # the trainer's watchdog is already running
    elif isinstance(dog, str) or isinstance(dog, numbers.Real) and not isinstance(dog, bool) \
            and dog > 0:
        dog, made = C.Watchdog(comm, None if isinstance(dog, str) else float(dog)), True
    elif not isinstance(dog, C.Watchdog):
        dog = None
    try:
        yield dataclasses.replace(spec, watchdog=dog)
    finally:
        if made:
            dog.close()


class _Stopped(Exception):
    """A callback's stop, agreed by every rank."""


class _Run:
    """One call of :func:`run`: where it is, and what it has done."""

    def __init__(self, trainer: Trainer, feed: Feed, spec: RunSpec) -> None:
        self.trainer, self.feed, self.spec = trainer, feed, spec
        self.state = spec.resume or State()
        if problem := check_position(self.state, feed.n_steps):  # the same figures everywhere
            raise C.MpidpError(problem)
        trainer.global_step = self.state.global_step
        self.history = list(self.state.history)
        self.faults = Injector(trainer.world.rank)
        self.tracer = getattr(getattr(trainer, "timer", None), "tracer", None)
        self.save_due = False
        self.check_due = False  # a replica check waits for the next synchronisation
        self.asked = False  # a callback on this rank asked to stop
        self.carries_stop = spec.stop is not None or spec.on_step is not None
        self.progress = resolve(spec.progress) if trainer.world.rank == 0 else "none"
        self.first_step, self.skipped_before = trainer.global_step, _skipped(trainer)
        self.elastic = spec.elastic if hasattr(spec.elastic, "recover") else None
        self.replay()

    def epochs(self) -> None:
        spec, state = self.spec, self.state
        if isinstance(spec.watchdog, C.Watchdog):
            spec.watchdog.start()
        epoch, first = state.epoch, state.step
        totals = np.array(state.totals if first else (0.0, 0.0, 0.0), np.float64)
        if self.stopped_early and epoch < spec.epochs:
            es = spec.early_stopping
            if self.trainer.world.rank == 0:
                print(f"[mpidp] the run had already finished: early stopping ended it after "
                      f"epoch {epoch} ({spec.monitor} had not improved for {es.bad_epochs} "
                      f"epochs, its patience {es.patience}); nothing more to train", flush=True)
            return
        if spec.resume is not None and epoch >= spec.epochs and self.trainer.world.rank == 0:
            print(f"[mpidp] the run had already finished: all {spec.epochs} epochs were done; "
                  f"nothing more to train", flush=True)
        while epoch < spec.epochs:
            t0 = time.perf_counter()
            try:
                self.steps(epoch, first, totals)
                self.mark(epoch, self.feed.n_steps, totals, whole=True)
                ended = self.end_epoch(epoch, totals, t0)
            except _Stopped:
                self.end_epoch(epoch, totals, t0, stopped_at=self.trainer.global_step)
                return
            except Exception as exc:  # elastic: a lost rank, the survivors go on
                if self.elastic is None:
                    raise
                epoch, first, totals = self.recover(exc)
                continue
            if ended:
                break
            epoch, first, totals = epoch + 1, 0, np.zeros(3)
        if spec.checkpoint:  # the epochs done: up to the one that ended training, at most all
            self.save(State(min(epoch + 1, spec.epochs), 0, self.trainer.global_step))

    def mark(self, epoch: int, step: int, totals: np.ndarray, whole: bool = False) -> None:
        """Elastic runs: where this rank is, before step ``step`` of ``epoch``."""
        if self.elastic is not None:
            self.elastic.mark(self.trainer.global_step, epoch, step, totals, len(self.history),
                              whole)

    def recover(self, exc: Exception) -> tuple[int, int, np.ndarray]:
        """Elastic runs: go on over the survivors of a lost rank (else raise ``exc``)."""
        try:
            mark = self.elastic.recover(exc)
        except TooFewRanks as short:  # the run ends here, from a checkpoint where they are on
            m = short.mark
            del self.history[m.history:]
            if not self.spec.checkpoint:
                raise
            self.save(State(m.epoch, m.step, m.global_step, m.totals.tolist()))
            raise TooFewRanks(f"{short}; a checkpoint of step {m.global_step} is in "
                              f"{self.spec.checkpoint.directory}: add {setting('resume')} "
                              f"to go on", m, short.first) from None
        C.set_step(mark.global_step)
        del self.history[mark.history:]
        return mark.epoch, mark.step, mark.totals.copy()

    def steps(self, epoch: int, first: int, totals: np.ndarray) -> None:
        """The epoch's steps from ``first`` on, their figures added to ``totals``."""
        bar = Progress(self.feed.n_steps, f"epoch {epoch + 1}", self.progress, initial=first)
        try:
            for step, batch in enumerate(self.feed.batches(epoch, first), start=first):
                self.mark(epoch, step, totals)
                s = self.step(epoch, step, batch)
                if not s.skipped:
                    totals += (s.loss_sum, s.count, s.correct)
                bar.update(s.loss)
                self.after_step(epoch, step, s, totals)
        finally:
            bar.close()

    def end_epoch(self, epoch: int, totals: np.ndarray, t0: float, **extra) -> bool:
        """Record the epoch, judge it (early stopping, plateau rule), call ``on_epoch``; True
        when training ends here (early stopping, or some rank's ``on_epoch``: agreed)."""
        record = _record(self.trainer, self.feed, epoch, totals, t0, self.tracer)
        skipped = _skipped(self.trainer)
        if skipped is not None:
            record["skipped"], self.skipped_before = skipped - self.skipped_before, skipped
        self.history.append(record | extra)
        if self.elastic is not None:
            self.elastic.report(self.history[-1])  # the ranks lost in this epoch
        enough = self.judge(self.history[-1])
        if self.spec.on_epoch is not None:  # (the epoch is reported before any failure)
            asked = bool(self.spec.on_epoch(self.history[-1]))
            enough = bool(C.allreduce_max(self.trainer.world, [asked])[0]) or enough
        self.check_skipped(skipped)
        return enough

    def check_skipped(self, skipped: int | None) -> None:
        """Fail on every rank (the counts are global) when the NaN/Inf policy skipped more
        than ``spec.max_skipped`` of this run's steps."""
        steps = self.trainer.global_step - self.first_step
        if skipped and steps and skipped > self.spec.max_skipped * steps:
            raise NonFiniteError(
                f"{skipped} of the run's {steps} steps had a NaN/Inf loss or gradient and were "
                f"skipped, more than the {self.spec.max_skipped:g} allowed "
                f"({setting('max_skipped')}): the model is not learning; lower the learning "
                f"rate or check the data")

    def judge(self, record: dict) -> bool:
        """Early stopping and the plateau rule on ``record``'s monitored figure; marks the
        record ``improved`` (the best so far) and ``lr_scale``; True: stop."""
        spec, stop = self.spec, False
        if spec.early_stopping is None and spec.plateau is None:
            return False
        if spec.monitor not in record:
            raise C.MpidpError(f"early stopping and the plateau rule watch {spec.monitor!r}, "
                               f"which the epoch does not report (it has "
                               f"{', '.join(sorted(k for k in record if k != 'balance'))}): "
                               f"give a validation set (test={{'val': shard}}) or another "
                               f"monitor")
        value = _figure(record, spec.monitor)
        if spec.early_stopping is not None:
            record["improved"] = spec.early_stopping.improves(value)
            stop = spec.early_stopping.update(value)
        if spec.plateau is not None:
            record["lr_scale"] = spec.plateau.update(value)
            self.plateau_optimizer().lr_scale = record["lr_scale"]
        return stop

    def plateau_optimizer(self):
        """The trainer's optimizer, whose ``lr_scale`` the plateau rule sets."""
        optimizer = getattr(self.trainer, "optimizer", None)
        if optimizer is None:
            raise C.MpidpError(f"the plateau rule sets an optimizer's lr_scale, and this "
                               f"trainer ({type(self.trainer).__name__}) has no optimizer")
        return optimizer

    def replay(self) -> None:
        """A resumed run's early stopping and plateau rule, fed the epochs already done;
        ``stopped_early``: early stopping had ended the run at its last epoch."""
        self.stopped_early = False
        for record in self.history:
            value = _figure(record, self.spec.monitor)
            if self.spec.early_stopping is not None:
                self.stopped_early = self.spec.early_stopping.update(value)
            if self.spec.plateau is not None:
                self.plateau_optimizer().lr_scale = self.spec.plateau.update(value)

    def step(self, epoch: int, step: int, batch: tuple) -> StepStats:
        """Faults, the trainer's step, the watchdog's mark and the replica check."""
        trainer, spec = self.trainer, self.spec
        C.set_step(trainer.global_step)
        if self.tracer is not None:
            self.tracer.step, self.tracer.epoch = trainer.global_step, epoch
        self.faults.apply(trainer.global_step, trainer)
        t_step = time.perf_counter()
        if self.carries_stop:  # the request rides in the step's own collective
            trainer.stop_requested = self.asked or (spec.stop is not None and spec.stop.requested)
        s = trainer.step(*batch, last_of_epoch=step == self.feed.n_steps - 1)
        if isinstance(spec.watchdog, C.Watchdog):
            spec.watchdog.step_done(time.perf_counter() - t_step)
        # replicas are equal only between synchronisations (local SGD's differ in between)
        self.check_due |= bool(spec.check_every) and trainer.global_step % spec.check_every == 0
        if self.check_due and trainer.at_boundary():
            self.check_due = False
            trainer.check_replicas()
        return s

    def after_step(self, epoch: int, step: int, s: StepStats, totals: np.ndarray) -> None:
        """``on_step``, then a checkpoint when due and an agreed stop, at a boundary."""
        trainer, spec = self.trainer, self.spec
        if spec.on_step is not None and getattr(trainer, "settle", None) is not None:
            trainer.settle()  # the callback may read the parameters: the update is whole
        if spec.on_step is not None and spec.on_step(trainer.global_step, s):
            self.asked = True
        self.save_due |= bool(spec.checkpoint) and trainer.global_step % spec.checkpoint.every == 0
        if (self.save_due or s.stop) and trainer.at_boundary():
            # why the ranks stop: a signal on any rank (one small Allreduce, once per run)
            signalled = s.stop and bool(C.allreduce_max(trainer.world, [
                spec.stop is not None and spec.stop.requested])[0])
            if spec.checkpoint:
                self.save(State(epoch, step + 1, trainer.global_step, totals.tolist()))
            self.save_due = False
            if signalled:
                raise Preempted(trainer.global_step, spec.checkpoint)
            if s.stop:
                raise _Stopped

    def save(self, state: State) -> None:
        """Write a checkpoint of ``state`` with the history so far. Collective."""
        ck = self.spec.checkpoint
        state.history, state.config, state.partition = self.history, ck.config, self.feed.state()
        self.faults.apply("checkpoint")
        state.best = ck.best.kept() if ck.best is not None else None
        with writing_checkpoint(self.tracer):
            self.trainer.save_checkpoint(ck.directory, state, ck.keep, ck.run_id)


@contextmanager
def writing_checkpoint(tracer=None):
    """Around the writing of a checkpoint: excused from the watchdog (a slow disk is not a
    stall), and a ``checkpoint`` span on the ``io`` track of ``tracer`` (when given)."""
    with C.excused("writing a checkpoint"), _span(tracer, "checkpoint", "io"):
        yield


def _figure(record: dict, name: str) -> float:
    """The epoch's figure ``name`` as a float (NaN where the record has None)."""
    value = record.get(name)
    return float("nan") if value is None else float(value)


def _skipped(trainer: Trainer) -> int | None:
    """The steps the trainer's NaN/Inf policy has skipped so far (None: it keeps no count)."""
    policy = getattr(trainer, "policy", None)
    return None if policy is None else int(policy.skipped)


def _span(tracer, name: str, track: str):
    return tracer.span(name, name, track) if tracer is not None else nullcontext()


#: the figures of an evaluation an epoch's record keeps (the per-class lists and the
#: confusion matrix stay out of the history: they grow with the classes)
BRIEF = ("f1_macro", "precision_macro", "recall_macro", "top3_accuracy", "top5_accuracy",
         "log_loss", "mse", "mae", "r2")


def _record(trainer, feed: Feed, epoch: int, totals: np.ndarray, t0: float, tracer=None) -> dict:
    totals = trainer.epoch_totals(totals)
    record = {"epoch": epoch + 1, "loss": totals[0] / totals[1] if totals[1] else float("nan"),
              "accuracy": totals[2] / totals[1] if feed.labelled and totals[1] else None,
              "seconds": time.perf_counter() - t0}
    optimizer = getattr(trainer, "optimizer", None)
    if optimizer is not None and hasattr(optimizer, "lr_at"):  # the epoch's last update's
        record["lr"] = optimizer.lr_at(max(optimizer.t - 1, 0))
    if (balance := feed.end_epoch()) is not None:
        record["balance"] = balance
    with _span(tracer, "evaluate", "eval"):
        ev = feed.evaluate()
    for name, got in (ev if isinstance(ev, dict) else {"test": ev}).items():
        if got is not None:
            record[f"{name}_loss"] = got.loss
            record[f"{name}_accuracy"] = got.accuracy if feed.labelled else None
            record.update({f"{name}_{k}": got.scores[k] for k in BRIEF if k in (got.scores or {})})
    return record


def _end_job(world: C.Comm, exc: BaseException) -> None:
    """``sys.exit`` or Ctrl-C on one rank inside training: end the whole job (the others are
    inside a collective and would wait forever); a lone process just exits."""
    code = exc.code if isinstance(exc, SystemExit) else 130
    code = code if isinstance(code, int) else 1
    if world.size == 1:
        raise exc
    sys.stderr.write(f"[mpidp] rank {world.rank}/{world.size}: {type(exc).__name__}"
                     f"({code}) during training; ending the job.\n")
    C.abort_job(code or 1)
