"""The epoch loop: same global batches for any world size, same number of steps on every rank."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .balance import Partition, Plan
from .checkpoint import State, save
from .data import Shard
from .faults import Injector
from .parallel import DataParallel
from .partition import steps_per_epoch


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

    def __post_init__(self) -> None:
        if self.every < 1 or self.keep < 1:
            raise ValueError(f"checkpoint every/keep must be >= 1, got {self.every}/{self.keep}")


def fit(dp: DataParallel, train: Shard, epochs: int, batch_size: int, seed: int = 0,
        shuffle: bool = True, drop_last: bool = False, test: Shard | None = None,
        progress: bool = False, on_epoch: Callable[[dict], None] | None = None,
        checkpoint: Checkpointing | None = None, resume: State | None = None,
        partition: Partition | Plan | None = None) -> list[dict]:
    """Train until ``epochs`` epochs of global batches of ``batch_size`` samples are done.

    Collective. Epoch ``e`` visits positions in :func:`mpidp.partition.epoch_order` order,
    so the global batches do not depend on the number of ranks. ``resume`` (from
    :func:`mpidp.checkpoint.restore`) continues mid-epoch exactly where the checkpoint was
    taken. Returns the history, one dict per epoch: ``epoch, loss, accuracy, test_loss,
    test_accuracy, seconds`` (global figures). Only rank 0 shows ``progress``;
    ``on_epoch`` is called on every rank.

    ``partition`` (a :class:`mpidp.balance.Partition`, or a :class:`~mpidp.balance.Plan` to
    keep its trace) decides which rank owns which samples, epoch by epoch; rows move between
    ranks when that changes. Each record also has ``balance``: the epoch's load-balance
    figures (:func:`mpidp.balance.balance_figures`), the same on every rank.
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    state = resume or State()
    dp.global_step = state.global_step
    history = list(state.history)
    n_steps = steps_per_epoch(train.n_total, batch_size, drop_last)
    show = progress and dp.comm.rank == 0
    labelled = dp.loss.classification or train.y.dtype.kind in "iu"
    faults = Injector(dp.comm.rank)
    plan = partition if isinstance(partition, Plan) else Plan(
        dp.comm, partition, train.n_total, batch_size, seed, shuffle, drop_last)
    if state.partition.get("capacities") is not None:
        plan.capacities = np.asarray(state.partition["capacities"], np.float64)
    if resume is not None:
        dp.sync.after_restore(dp)  # e.g. a sharded optimizer takes its slice of the state
    save_due = False
    for epoch in range(state.epoch, epochs):
        t0 = time.perf_counter()
        first = state.step if epoch == state.epoch else 0
        totals = np.array(state.totals if first else (0.0, 0.0, 0.0), np.float64)
        bar = _Progress(n_steps, f"epoch {epoch + 1}", show, initial=first)
        for step, (X, y) in enumerate(plan.batches(train, epoch, dp.timer, first), start=first):
            if faults.steps:
                X = faults.apply(dp.global_step, X, dp.model.params)
            s = dp.step(X, y, last_of_epoch=step == n_steps - 1)
            if not s.skipped:
                totals += (s.loss_sum, s.count, s.correct)
            bar.update(s.loss)
            save_due |= bool(checkpoint) and dp.global_step % checkpoint.every == 0
            if save_due and dp.sync.at_boundary():  # not inside an accumulation group
                _save(dp, checkpoint, plan, State(epoch, step + 1, dp.global_step,
                                                  totals.tolist(), history))
                save_due = False
        bar.close()
        record = {"epoch": epoch + 1, "loss": totals[0] / totals[1],
                  "accuracy": totals[2] / totals[1] if labelled else None,
                  "seconds": time.perf_counter() - t0}
        train = plan.shard
        record["balance"] = plan.end_epoch(dp.timer)
        if test is not None and test.n_total:
            ev = dp.evaluate(test.X, test.y)
            record.update(test_loss=ev.loss, test_accuracy=ev.accuracy if labelled else None)
        history.append(record)
        if on_epoch is not None:
            on_epoch(record)
    if checkpoint:
        _save(dp, checkpoint, plan, State(epochs, 0, dp.global_step, [0.0, 0.0, 0.0], history))
    return history


def _save(dp: DataParallel, checkpoint: Checkpointing, plan: Plan, state: State) -> None:
    dp.sync.before_checkpoint(dp)  # collective: a sharded optimizer state is gathered to root
    if dp.comm.rank == dp.root:
        state.config = checkpoint.config
        state.partition = {"strategy": plan.strategy, "capacities": plan.capacities.tolist()}
        save(checkpoint.directory, dp.model, dp.optimizer, state, checkpoint.keep)
    dp.sync.after_checkpoint(dp)
