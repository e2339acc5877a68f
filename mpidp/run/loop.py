"""The one epoch loop, for every trainer: data parallel (each gradient-exchange strategy),
pipelines and hybrids. Every guarantee is written here once:

per step: fault injection (``MPIDP_FAULT``) -> ``trainer.step`` (which applies the NaN
policy before its update) -> the step mark the watchdog reports -> the replica check every
``check_every`` steps -> a checkpoint when due (outside accumulation groups, excused from
the watchdog) -> an agreed stop on SIGTERM/SIGUSR1 (checkpoint, then :class:`Preempted`);
per epoch: global totals, load-balance figures, evaluation, history, ``on_epoch``.

The same global batches for any world size; the same number of steps on every rank.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .. import comm as C
from ..data.balance import Partition, Plan
from ..data.distribute import Shard
from ..data.partition import steps_per_epoch
from ..errors import MpidpError
from .checkpoint import State
from .faults import Injector
from .signals import Preempted, StopSignals
from .stats import StepStats


class _Progress:
    """A progress bar on stderr: tqdm when installed, otherwise a line per 10% of the epoch."""

    def __init__(self, total: int, desc: str, enabled: bool, initial: int = 0) -> None:
        self.total, self.desc, self.enabled, self.n, self._bar = total, desc, enabled, initial, None
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", leave=True,
                                 file=sys.stderr, dynamic_ncols=True, mininterval=0.1)
            except ImportError:
                pass

    def update(self, loss: float) -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        elif self.enabled and (self.n == self.total or self.n % max(self.total // 10, 1) == 0):
            print(f"{self.desc}: {self.n}/{self.total} steps, loss {loss:.4f}",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclass
class Checkpointing:
    """Where and how often :func:`fit` saves checkpoints (root rank writes them)."""

    directory: str
    every: int  # steps between checkpoints (a final one is written at the end too)
    keep: int = 3
    config: dict = field(default_factory=dict)
    run_id: str | None = None  # the folder's owner (mpidp.run.checkpoint.claim); None: unchecked

    def __post_init__(self) -> None:
        if self.every < 1 or self.keep < 1:
            raise ValueError(f"checkpoint every/keep must be >= 1, got {self.every}/{self.keep}")


class Trainer(Protocol):
    """What the loop needs of a trainer (:class:`~mpidp.DataParallel`,
    :class:`~mpidp.parallel.Pipeline`)."""

    world: C.Comm
    global_step: int

    def step(self, *batch: Any, last_of_epoch: bool = False) -> StepStats: ...

    def check_replicas(self) -> None: ...

    def poison_(self) -> None: ...

    def nudge_(self) -> None: ...

    def at_boundary(self) -> bool: ...

    def epoch_totals(self, totals: np.ndarray) -> np.ndarray: ...

    def save_checkpoint(self, directory: str, state: State, keep: int,
                        run_id: str | None = None) -> None: ...


class Feed(Protocol):
    """Where a trainer's batches come from, epoch by epoch."""

    n_steps: int

    def batches(self, epoch: int, first: int) -> Iterator[tuple]: ...

    def end_epoch(self) -> dict | None: ...

    def evaluate(self) -> StepStats | None: ...


@dataclass
class Loop:
    """Settings of :func:`run` beyond the trainer and its feed."""

    epochs: int
    labelled: bool = True
    checkpoint: Checkpointing | None = None
    resume: State | None = None
    check_every: int = 0
    progress: bool = False
    on_epoch: Callable[[dict], None] | None = None
    on_step: Callable[[int, StepStats], None] | None = None
    stop: StopSignals | None = None
    watchdog: C.Watchdog | None = None
    extra_state: Callable[[], dict] | None = None  # e.g. adaptive capacities, saved with state


def run(trainer: Trainer, feed: Feed, loop: Loop) -> list[dict]:
    """Train until ``loop.epochs`` epochs are done. Collective. Returns the history (one
    dict per epoch: ``epoch, loss, accuracy, seconds`` and, when measured, ``balance``,
    ``test_loss``, ``test_accuracy``), the same on every rank."""
    if loop.check_every < 0:
        raise MpidpError(f"check_every must be >= 0, got {loop.check_every}")
    state = loop.resume or State()
    trainer.global_step = state.global_step
    history, world = list(state.history), trainer.world
    faults = Injector(world.rank)
    tracer = getattr(getattr(trainer, "timer", None), "tracer", None)
    if loop.watchdog is not None:
        loop.watchdog.start()
    save_due = False
    try:
        for epoch in range(state.epoch, loop.epochs):
            t0 = time.perf_counter()
            first = state.step if epoch == state.epoch else 0
            totals = np.array(state.totals if first else (0.0, 0.0, 0.0), np.float64)
            bar = _Progress(feed.n_steps, f"epoch {epoch + 1}", loop.progress and world.rank == 0,
                            initial=first)
            for step, batch in enumerate(feed.batches(epoch, first), start=first):
                C.set_step(trainer.global_step)
                if tracer is not None:
                    tracer.step, tracer.epoch = trainer.global_step, epoch
                faults.apply(trainer.global_step, trainer)
                t_step = time.perf_counter()
                s = trainer.step(*batch, last_of_epoch=step == feed.n_steps - 1)
                if not s.skipped:
                    totals += (s.loss_sum, s.count, s.correct)
                bar.update(s.loss)
                if loop.watchdog is not None:
                    loop.watchdog.step_done(time.perf_counter() - t_step)
                if loop.check_every and trainer.global_step % loop.check_every == 0:
                    trainer.check_replicas()
                if loop.on_step is not None:
                    loop.on_step(epoch, s)
                save_due |= bool(loop.checkpoint) and trainer.global_step % loop.checkpoint.every == 0
                stopping = loop.stop is not None and loop.stop.agreed(world)
                if (save_due or stopping) and trainer.at_boundary():
                    if loop.checkpoint:
                        _save(trainer, loop, State(epoch, step + 1, trainer.global_step,
                                                   totals.tolist(), history))
                    save_due = False
                    if stopping:
                        raise Preempted(trainer.global_step, loop.checkpoint)
            bar.close()
            history.append(_record(trainer, feed, loop, epoch, totals, t0, tracer))
            if loop.on_epoch is not None:
                loop.on_epoch(history[-1])
        if loop.checkpoint:
            _save(trainer, loop, State(loop.epochs, 0, trainer.global_step, [0.0, 0.0, 0.0],
                                       history))
    except (SystemExit, KeyboardInterrupt) as exc:  # from a callback: never leave others waiting
        _end_job(world, exc)
    return history


def _span(tracer, name: str, track: str):
    return tracer.span(name, name, track) if tracer is not None else nullcontext()


def _record(trainer, feed, loop: Loop, epoch: int, totals: np.ndarray, t0: float,
            tracer=None) -> dict:
    totals = trainer.epoch_totals(totals)
    record = {"epoch": epoch + 1, "loss": totals[0] / totals[1] if totals[1] else float("nan"),
              "accuracy": totals[2] / totals[1] if loop.labelled and totals[1] else None,
              "seconds": time.perf_counter() - t0}
    balance = feed.end_epoch()
    if balance is not None:
        record["balance"] = balance
    with _span(tracer, "evaluate", "eval"):
        ev = feed.evaluate()
    if ev is not None:
        record.update(test_loss=ev.loss, test_accuracy=ev.accuracy if loop.labelled else None)
    return record


def _save(trainer, loop: Loop, state: State) -> None:
    state.config = loop.checkpoint.config
    if loop.extra_state is not None:
        state.partition = loop.extra_state()
    tracer = getattr(getattr(trainer, "timer", None), "tracer", None)
    with C.excused("writing a checkpoint"), _span(tracer, "checkpoint", "io"):
        trainer.save_checkpoint(loop.checkpoint.directory, state, loop.checkpoint.keep,
                                loop.checkpoint.run_id)


def _end_job(world: C.Comm, exc: BaseException) -> None:
    """``sys.exit`` or Ctrl-C on one rank inside training: end the whole job (the others are
    inside a collective and would wait forever); a lone process just exits."""
    code = exc.code if isinstance(exc, SystemExit) else 130
    code = code if isinstance(code, int) else 1
    if world.size == 1:
        raise exc
    sys.stderr.write(f"[mpidp] rank {world.rank}/{world.size}: {type(exc).__name__}"
                     f"({code}) during training; ending the job.\n")
    C.abort_job(world, code or 1)


class _PlanFeed:
    """A :class:`Feed` over this rank's shard, partitioned by a :class:`Plan`."""

    def __init__(self, dp, plan: Plan, train: Shard, test: Shard | None) -> None:
        self.dp, self.plan, self.shard, self.test = dp, plan, train, test
        self.n_steps = steps_per_epoch(train.n_total, plan.batch_size, plan.drop_last)

    def batches(self, epoch: int, first: int) -> Iterator[tuple]:
        yield from self.plan.batches(self.shard, epoch, self.dp.timer, first)
        self.shard = self.plan.shard

    def end_epoch(self) -> dict:
        return self.plan.end_epoch(self.dp.timer)

    def evaluate(self) -> StepStats | None:
        if self.test is None or not self.test.n_total:
            return None
        return self.dp.evaluate(self.test.X, self.test.y)


def fit(dp, train: Shard, epochs: int, batch_size: int, seed: int = 0,
        shuffle: bool = True, drop_last: bool = False, test: Shard | None = None,
        progress: bool = False, on_epoch: Callable[[dict], None] | None = None,
        checkpoint: Checkpointing | None = None, resume: State | None = None,
        partition: Partition | Plan | None = None, stop: StopSignals | None = None,
        watchdog: C.Watchdog | None = None,
        on_step: Callable[[int, StepStats], None] | None = None) -> list[dict]:
    """Train ``dp`` (a :class:`mpidp.DataParallel`) until ``epochs`` epochs of global batches
    of ``batch_size`` samples are done.

    Collective. Epoch ``e`` visits positions in :func:`mpidp.data.partition.epoch_order` order,
    so the global batches do not depend on the number of ranks. ``resume`` (from
    :func:`mpidp.run.checkpoint.restore`) continues mid-epoch exactly where the checkpoint was
    taken. Returns the history, one dict per epoch: ``epoch, loss, accuracy, test_loss,
    test_accuracy, seconds`` (global figures). Only rank 0 shows ``progress``;
    ``on_epoch`` is called on every rank.

    ``partition`` (a :class:`mpidp.data.balance.Partition`, or a :class:`~mpidp.data.balance.Plan` to
    keep its trace) decides which rank owns which samples, epoch by epoch; rows move between
    ranks when that changes. Each record also has ``balance``: the epoch's load-balance
    figures (:func:`mpidp.data.balance.balance_figures`), the same on every rank.

    ``stop`` (:class:`mpidp.run.signals.StopSignals`): stop cleanly on SIGTERM/SIGUSR1;
    ``watchdog`` (:class:`mpidp.comm.Watchdog`): end the job, naming the stalled ranks, when
    a rank makes no progress (a ``DataParallel(watchdog=...)`` already has one).
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    state = resume or State()
    plan = partition if isinstance(partition, Plan) else Plan(
        dp.comm, partition, train.n_total, batch_size, seed, shuffle, drop_last)
    if state.partition.get("capacities") is not None:
        plan.capacities = np.asarray(state.partition["capacities"], np.float64)
    if resume is not None:
        dp.sync.after_restore(dp)  # e.g. a sharded optimizer takes its slice of the state
    labelled = dp.loss.classification or train.y.dtype.kind in "iu"
    # check_every=0: DataParallel compares replicas in its own step (for users' own loops too)
    loop = Loop(epochs, labelled, checkpoint, resume, 0, progress, on_epoch,
                on_step=on_step, stop=stop, watchdog=watchdog, extra_state=lambda: {"strategy": plan.strategy,
                                                "capacities": plan.capacities.tolist()})
    return run(dp, _PlanFeed(dp, plan, train, test), loop)
