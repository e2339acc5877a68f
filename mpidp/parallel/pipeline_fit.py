"""Feeding pipelines (and hybrids) the same global batches as :func:`mpidp.fit`.

Every rank passes the whole training set; each global batch is the next ``batch_size``
positions of :func:`mpidp.data.partition.epoch_order`, replica ``r`` takes its block of it
(:func:`mpidp.data.partition.block_range`), the first stage reads its rows of ``X`` and the last
its targets. Training itself is the one loop, :func:`mpidp.run.loop.run`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from .. import comm as C
from ..data.partition import block_counts, block_range, epoch_order, steps_per_epoch
from ..run.checkpoint import State
from ..run.loop import Checkpointing, Loop, run
from ..run.signals import StopSignals
from ..run.stats import StepStats
from .pipeline import Pipeline


def check_batches(n: int, batch_size: int, drop_last: bool, n_replicas: int,
                  micro_batches: int) -> None:
    """``ValueError`` unless every replica's part of every batch has >= ``micro_batches``
    samples (pure arithmetic: every rank reaches the same verdict)."""
    steps = steps_per_epoch(n, batch_size, drop_last)
    if steps == 0:
        raise ValueError(f"no full batch of {batch_size} in {n} samples (drop_last)")
    sizes = [min(batch_size, n - s * batch_size) for s in range(steps)]
    smallest = int(block_counts(min(sizes), n_replicas).min())
    if smallest < micro_batches:
        where = "" if n_replicas == 1 else f" per replica ({n_replicas} replicas)"
        raise ValueError(f"more micro-batches ({micro_batches}) than samples in a batch: the "
                         f"smallest batch has {smallest} samples{where}; use --micro-batches "
                         f"<= {smallest}, a larger batch size, or --drop-last")


class PipelineFeed:
    """A :class:`mpidp.run.loop.Feed` for ``pipe`` over the whole training set ``(X, y)``."""

    def __init__(self, pipe: Pipeline, X: np.ndarray, y: np.ndarray, batch_size: int,
                 seed: int, shuffle: bool, drop_last: bool, X_test=None, y_test=None) -> None:
        C.run_agreed(pipe.world, check_batches, len(y), batch_size, drop_last, pipe.n_replicas,
                     pipe.micro_batches)
        self.pipe, self.X, self.y, self.batch_size = pipe, X, y, batch_size
        self.seed, self.shuffle, self.X_test, self.y_test = seed, shuffle, X_test, y_test
        self.n_steps = steps_per_epoch(len(y), batch_size, drop_last)

    def batches(self, epoch: int, first: int) -> Iterator[tuple]:
        pipe, b = self.pipe, self.batch_size
        order = epoch_order(len(self.y), epoch, self.seed, self.shuffle)
        for s in range(first, self.n_steps):
            pos = order[s * b:(s + 1) * b]
            lo, hi = block_range(len(pos), pipe.n_replicas, pipe.replica)
            idx = pos[lo:hi]
            yield (self.X[idx] if pipe.first else None, self.y[idx] if pipe.last else None,
                   len(idx))

    def end_epoch(self) -> None:
        return None

    def evaluate(self) -> StepStats | None:
        if self.X_test is None or self.y_test is None or not len(self.y_test):
            return None
        lo, hi = block_range(len(self.y_test), self.pipe.n_replicas, self.pipe.replica)
        return self.pipe.evaluate(self.X_test[lo:hi], self.y_test[lo:hi])


def fit_pipeline(pipe: Pipeline, X: np.ndarray, y: np.ndarray, epochs: int, batch_size: int,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 X_test: np.ndarray | None = None, y_test: np.ndarray | None = None,
                 on_epoch: Callable[[dict], None] | None = None,
                 checkpoint: Checkpointing | None = None, resume: State | None = None,
                 check_every: int = 0, stop: StopSignals | None = None,
                 watchdog: C.Watchdog | None = None,
                 on_step: Callable[[int, StepStats], None] | None = None) -> list[dict]:
    """Train ``pipe`` until ``epochs`` epochs of global batches of ``batch_size`` samples
    are done (:func:`mpidp.run.loop.run`, so with faults, NaN policy, replica checks,
    checkpoints and signals as in data-parallel training).

    Collective. ``X`` ``(n_samples, n_features)`` and ``y`` are the whole training set on
    every rank. Returns the history (one dict per epoch: ``epoch, loss, accuracy,
    seconds`` and, with a test set, ``test_loss, test_accuracy``) on every rank.
    ``resume`` (from :func:`restore_checkpoint`) continues mid-epoch where a checkpoint
    was taken.
    """
    feed = PipelineFeed(pipe, X, y, batch_size, seed, shuffle, drop_last, X_test, y_test)
    labelled = pipe.loss.classification or y.dtype.kind in "iu"
    return run(pipe, feed, Loop(epochs, labelled, checkpoint, resume, check_every,
                                on_epoch=on_epoch, on_step=on_step, stop=stop,
                                watchdog=watchdog))


def restore_checkpoint(pipe: Pipeline, directory: str) -> tuple[str, State] | None:
    """:meth:`Pipeline.restore`: the newest good checkpoint of any layout. Collective."""
    return pipe.restore(directory)
