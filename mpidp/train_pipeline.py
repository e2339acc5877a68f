"""The epoch loop for pipelines (and hybrids): the same global batches as :func:`mpidp.fit`.

Every rank passes the whole training set; each global batch is the next ``batch_size``
positions of :func:`mpidp.partition.epoch_order`, replica ``r`` takes its block of it
(:func:`mpidp.partition.block_range`), the first stage reads its rows of ``X`` and the last
its targets. Loss figures live on the last stage; they reach every rank once per epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from . import comm as C
from .parallel.pipeline import Pipeline
from .partition import block_counts, block_range, epoch_order, steps_per_epoch


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


def fit_pipeline(pipe: Pipeline, X: np.ndarray, y: np.ndarray, epochs: int, batch_size: int,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                 X_test: np.ndarray | None = None, y_test: np.ndarray | None = None,
                 on_epoch: Callable[[dict], None] | None = None) -> list[dict]:
    """Train ``pipe`` for ``epochs`` epochs of global batches of ``batch_size`` samples.

    Collective. ``X`` ``(n_samples, n_features)`` and ``y`` are the whole training set on
    every rank. Returns the history (one dict per epoch: ``epoch, loss, accuracy,
    seconds`` and, with a test set, ``test_loss, test_accuracy``) on every rank.
    """
    n = len(y)
    C.run_agreed(pipe.world, check_batches, n, batch_size, drop_last, pipe.n_replicas,
                 pipe.micro_batches)
    labelled = pipe.loss.classification or y.dtype.kind in "iu"
    history = []
    for epoch in range(epochs):
        t0 = time.perf_counter()
        order = epoch_order(n, epoch, seed, shuffle)
        totals = np.zeros(3, np.float64)
        for s in range(steps_per_epoch(n, batch_size, drop_last)):
            pos = order[s * batch_size:(s + 1) * batch_size]
            lo, hi = block_range(len(pos), pipe.n_replicas, pipe.replica)
            idx = pos[lo:hi]
            stats = pipe.step(X[idx] if pipe.first else None, y[idx] if pipe.last else None,
                              len(idx))
            totals += (stats.loss_sum, stats.count, stats.correct)
        C.bcast_(pipe.pipe, totals, pipe.n_stages - 1)  # loss figures live on the last stage
        record = {"epoch": epoch + 1, "loss": totals[0] / totals[1],
                  "accuracy": totals[2] / totals[1] if labelled else None,
                  "seconds": time.perf_counter() - t0}
        if X_test is not None and y_test is not None and len(y_test):
            lo, hi = block_range(len(y_test), pipe.n_replicas, pipe.replica)
            ev = pipe.evaluate(X_test[lo:hi], y_test[lo:hi])
            record.update(test_loss=ev.loss, test_accuracy=ev.accuracy if labelled else None)
        history.append(record)
        if on_epoch is not None:
            on_epoch(record)
    return history
