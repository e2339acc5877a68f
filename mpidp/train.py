"""The epoch loop: same global batches for any world size, same number of steps on every rank."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np

from .balance import Partition, Plan
from .data import Shard
from .parallel import DataParallel
from .partition import steps_per_epoch


class _Progress:
    """A progress bar on stderr: tqdm when installed, otherwise a line per 10% of the epoch."""

    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.total, self.desc, self.enabled, self.n, self._bar = total, desc, enabled, 0, None
        if enabled:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc=desc, unit="step", leave=True,
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


def fit(dp: DataParallel, train: Shard, epochs: int, batch_size: int, seed: int = 0,
        shuffle: bool = True, drop_last: bool = False, test: Shard | None = None,
        progress: bool = False, on_epoch: Callable[[dict], None] | None = None,
        start_epoch: int = 0, partition: Partition | Plan | None = None) -> list[dict]:
    """Train for ``epochs`` epochs of global batches of ``batch_size`` samples.

    Collective. Epoch ``e`` visits positions in :func:`mpidp.partition.epoch_order` order,
    so the global batches do not depend on the number of ranks. Returns one dict per epoch:
    ``epoch, loss, accuracy, test_loss, test_accuracy, seconds`` (global figures). Only
    ``comm`` rank 0 shows ``progress``; ``on_epoch`` is called on every rank.

    ``partition`` (a :class:`mpidp.balance.Partition`, or a :class:`~mpidp.balance.Plan` to
    keep its trace) decides which rank owns which samples, epoch by epoch; rows move between
    ranks when that changes. Each record also has ``balance``: the epoch's load-balance
    figures (:func:`mpidp.balance.balance_figures`), the same on every rank.
    """
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    history = []
    n_steps = steps_per_epoch(train.n_total, batch_size, drop_last)
    show = progress and dp.comm.rank == 0
    labelled = dp.loss.classification or train.y.dtype.kind in "iu"
    plan = partition if isinstance(partition, Plan) else Plan(
        dp.comm, partition, train.n_total, batch_size, seed, shuffle, drop_last)
    for epoch in range(start_epoch, start_epoch + epochs):
        t0 = time.perf_counter()
        bar = _Progress(n_steps, f"epoch {epoch + 1}", show)
        total = np.zeros(3)
        for X, y in plan.batches(train, epoch, dp.timer):
            s = dp.step(X, y)
            total += (s.loss_sum, s.count, s.correct)
            bar.update(s.loss)
        bar.close()
        record = {"epoch": epoch + 1, "loss": total[0] / total[1],
                  "accuracy": total[2] / total[1] if labelled else None,
                  "seconds": time.perf_counter() - t0}
        train = plan.shard
        record["balance"] = plan.end_epoch(dp.timer)
        if test is not None and test.n_total:
            ev = dp.evaluate(test.X, test.y)
            record.update(test_loss=ev.loss,
                          test_accuracy=ev.accuracy if labelled else None)
        history.append(record)
        if on_epoch is not None:
            on_epoch(record)
    return history
