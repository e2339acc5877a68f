"""The epoch loop for pipelines (and hybrids): the same global batches as :func:`mpidp.fit`.

Every rank passes the whole training set; each global batch is the next ``batch_size``
positions of :func:`mpidp.partition.epoch_order`, replica ``r`` takes its block of it
(:func:`mpidp.partition.block_range`), the first stage reads its rows of ``X`` and the last
its targets. Loss figures live on the last stage; they reach every rank once per epoch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from . import comm as C
from .checkpoint import State, check_fits, read_latest, save_flat, state_of
from .parallel.pipeline import Pipeline
from .partition import block_counts, block_range, epoch_order, steps_per_epoch
from .loop import Checkpointing


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
                 on_epoch: Callable[[dict], None] | None = None,
                 checkpoint: Checkpointing | None = None,
                 resume: State | None = None) -> list[dict]:
    """Train ``pipe`` until ``epochs`` epochs of global batches of ``batch_size`` samples
    are done.

    Collective. ``X`` ``(n_samples, n_features)`` and ``y`` are the whole training set on
    every rank. Returns the history (one dict per epoch: ``epoch, loss, accuracy,
    seconds`` and, with a test set, ``test_loss, test_accuracy``) on every rank.
    ``checkpoint`` saves every ``checkpoint.every`` steps and at the end
    (:func:`save_checkpoint`); ``resume`` (from :func:`restore_checkpoint`) continues
    mid-epoch where a checkpoint was taken.
    """
    n = len(y)
    C.run_agreed(pipe.world, check_batches, n, batch_size, drop_last, pipe.n_replicas,
                 pipe.micro_batches)
    labelled = pipe.loss.classification or y.dtype.kind in "iu"
    state = resume or State()
    pipe.global_step = state.global_step
    history = list(state.history)
    n_steps = steps_per_epoch(n, batch_size, drop_last)
    for epoch in range(state.epoch, epochs):
        t0 = time.perf_counter()
        order = epoch_order(n, epoch, seed, shuffle)
        first = state.step if epoch == state.epoch else 0
        totals = np.array(state.totals if first else (0.0, 0.0, 0.0), np.float64)
        for s in range(first, n_steps):
            pos = order[s * batch_size:(s + 1) * batch_size]
            lo, hi = block_range(len(pos), pipe.n_replicas, pipe.replica)
            idx = pos[lo:hi]
            stats = pipe.step(X[idx] if pipe.first else None, y[idx] if pipe.last else None,
                              len(idx))
            totals += (stats.loss_sum, stats.count, stats.correct)
            if checkpoint and pipe.global_step % checkpoint.every == 0:
                save_checkpoint(pipe, checkpoint, State(epoch, s + 1, pipe.global_step,
                                                        totals.tolist(), history))
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
    if checkpoint:
        save_checkpoint(pipe, checkpoint, State(epochs, 0, pipe.global_step, [0.0, 0.0, 0.0],
                                                history))
    return history


def _stage_counts(pipe: Pipeline) -> list[int]:
    b = pipe.plan.bounds
    return [int(sum(pipe.plan.n_params[b[s]:b[s + 1]])) for s in range(pipe.n_stages)]


def save_checkpoint(pipe: Pipeline, checkpoint: Checkpointing, state: State) -> None:
    """Gather the whole model's parameters and optimizer state from the stages of replica 0
    and write them on world rank 0 as one checkpoint, the same file data-parallel training
    writes, so it resumes with any number of stages, replicas or with ``--parallel data``.
    Collective over replica 0 (the other replicas hold copies and do nothing).

    ``state.totals`` are taken from the last stage, where the loss figures live.
    """
    if pipe.replica != 0:
        return
    totals = C.bcast_(pipe.pipe, np.array(state.totals, np.float64), pipe.n_stages - 1)
    params = C.gatherv(pipe.pipe, pipe.model.params, 0)
    opt = {k: C.gatherv(pipe.pipe, v, 0) for k, v in sorted(pipe.optimizer.state.items())}
    if pipe.world.rank == 0:
        state.totals, state.config = totals.tolist(), checkpoint.config
        save_flat(checkpoint.directory, params, opt, pipe.optimizer, state, checkpoint.keep)


def restore_checkpoint(pipe: Pipeline, directory: str) -> tuple[str, State] | None:
    """Load the newest good checkpoint in ``directory`` (written by a pipeline of any shape
    or by data-parallel training) into ``pipe``: world rank 0 reads and checks it, each stage
    of replica 0 receives its slice of the parameters and optimizer state (``Scatterv``; no
    rank holds the whole model but the reader), and the other replicas a copy of their
    stage's (``Bcast``). Collective. Returns ``(path, state)``, or None without a checkpoint.
    """
    n_total, dtype = int(sum(pipe.plan.n_params)), pipe.model.dtype
    held: dict = {}

    def load_on_root():
        found = read_latest(directory) if os.path.isdir(directory) else None
        if found is None:
            return None
        path, meta, arrays = found
        check_fits(path, meta, n_total, dtype, pipe.optimizer)
        odd = [k for k, shape in meta["optimizer"]["state"].items() if shape != [n_total]]
        if odd:
            raise ValueError(f"checkpoint {path}: optimizer state {odd} is not one value per "
                             f"parameter, so it cannot be split into pipeline stages")
        held["arrays"] = arrays
        return path, meta

    found = C.root_decides(pipe.world, load_on_root)
    if found is None:
        return None
    path, meta = found
    arrays, counts = held.pop("arrays", {}), _stage_counts(pipe)

    def my_slice(key: str) -> np.ndarray:
        if pipe.replica == 0:
            part = C.scatterv_rows(pipe.pipe, arrays.get(key), counts, (), dtype)
        else:
            part = np.empty(counts[pipe.stage], dtype)
        return C.bcast_(pipe.dp, part, 0)

    pipe.model.params[...] = my_slice("params")
    pipe.optimizer.state = {k: my_slice(f"opt.{k}") for k in sorted(meta["optimizer"]["state"])}
    pipe.optimizer.t = meta["optimizer"]["t"]
    return path, state_of(meta)
