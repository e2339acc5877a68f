"""A pipeline's run: :class:`PipelineFeed` (the global batches of :func:`mpidp.fit`, each
replica its block), :func:`fit_pipeline`, and what it hands back beyond its history
(:func:`whole_model`, :func:`figures`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from .. import comm as C
from ..data.distribute import Shard
from ..data.partition import block_range, epoch_order, steps_per_epoch
from ..nn.layers import Layer
from ..nn.model import Sequential
from ..run.loop import run, watched_run
from ..run.spec import RunSpec
from ..run.stats import StepStats
from .pipeline import Pipeline
from .stages import check_batches


def _set_length(data, what: str) -> int:
    """The rows of ``data``, a tuple ``(X, y)`` of as many rows each; ValueError if not."""
    if not isinstance(data, (tuple, list)) or len(data) != 2 or any(a is None for a in data):
        got = type(data).__name__ if not isinstance(data, (tuple, list)) else \
            f"({', '.join(type(a).__name__ for a in data)})"
        raise ValueError(f"{what} must be a tuple (X, y) of the whole set on every rank, "
                         f"got {got}")
    X, y = data
    if len(X) != len(y):
        raise ValueError(f"{what}: X has {len(X)} rows but y has {len(y)}")
    return len(y)


def _same_sets(comm: C.Comm, train, test) -> None:
    """Raise on every rank unless ``train`` and ``test`` (or None) are ``(X, y)`` tuples of
    the same lengths on every rank."""
    n = C.run_agreed(comm, lambda: [_set_length(train, "train"),
                                    -1 if test is None else _set_length(test, "test")])
    for what, lengths in zip(("train", "test"), C.allgather_rows(comm, n).astype(np.int64).T):
        C.agree(comm, None if len(set(lengths.tolist())) == 1 else
                f"the {what} set has {lengths.tolist()} rows on ranks 0..{comm.size - 1}: "
                f"a pipeline needs the whole set, the same, on every rank")


class PipelineFeed:
    """A :class:`mpidp.run.loop.Feed` for ``pipe`` over the whole training set ``train``
    ``(X, y)`` (every rank holds all of it) and test set ``test`` (or None)."""

    def __init__(self, pipe: Pipeline, train: tuple, test: tuple | dict | None,
                 spec: RunSpec) -> None:
        sets = dict(test) if isinstance(test, dict) else {"test": test}
        for name, held in sets.items():
            if isinstance(held, (tuple, list)) and len(held) == 2 and held[1] is None:
                sets[name] = None  # (X, None): no such set
            _same_sets(pipe.world, train, sets[name])
        X, y = train
        C.run_agreed(pipe.world, check_batches, len(y), spec.batch_size, spec.drop_last,
                     pipe.n_replicas, pipe.micro_batches)
        self.pipe, self.X, self.y, self.spec = pipe, X, y, spec
        self.test = {name: held for name, held in sets.items() if held is not None and len(held[1])}
        self.n_steps = steps_per_epoch(len(y), spec.batch_size, spec.drop_last)
        self.labelled = pipe.loss.classification or y.dtype.kind in "iu"

    def batches(self, epoch: int, first: int) -> Iterator[tuple]:
        pipe, b = self.pipe, self.spec.batch_size
        order = epoch_order(len(self.y), epoch, self.spec.seed, self.spec.shuffle)
        for s in range(first, self.n_steps):
            pos = order[s * b:(s + 1) * b]
            lo, hi = block_range(len(pos), pipe.n_replicas, pipe.replica)
            idx = pos[lo:hi]
            yield (self.X[idx] if pipe.first else None, self.y[idx] if pipe.last else None,
                   len(idx))

    def end_epoch(self) -> None:
        self.pipe.timer.take_records()  # per-step rows: no load balance to draw from them

    def evaluate(self) -> dict[str, StepStats]:
        """Every held-out set's figures, by name; each replica its block. Collective."""
        out, pipe = {}, self.pipe
        for name, (X, y) in self.test.items():
            lo, hi = block_range(len(y), pipe.n_replicas, pipe.replica)
            out[name] = pipe.evaluate(X[lo:hi], y[lo:hi])
        return out

    def state(self) -> dict:
        return {}


def fit_pipeline(pipe: Pipeline, train: tuple, epochs: int | None = None,
                 batch_size: int | None = None, *, test: tuple | None = None,
                 spec: RunSpec | None = None, **settings) -> list[dict]:
    """Train ``pipe`` as :func:`mpidp.fit` does (no ``partition``) on ``train`` (and ``test``, or
    None), ``(X, y)``, the whole set on every rank. Collective. The history, on every rank."""
    spec = RunSpec.of(spec, epochs=epochs, batch_size=batch_size, **settings)
    C.agree_same(pipe.world, "fit_pipeline", spec.agreed())  # the sets: checked below
    C.agree(pipe.world, None if spec.partition is None else
            "partition does not apply to a pipeline: every stage sees the whole batch")
    with watched_run(spec, pipe.world) as spec:
        return run(pipe, PipelineFeed(pipe, train, test, spec), spec)


def whole_model(pipe: Pipeline, make_layers: Callable[[], Sequence[Layer]]) -> Sequential | None:
    """The whole model on rank 0, None elsewhere: ``make_layers()`` (fresh unbound layers)
    holding every stage's parameters and stage 0's layer state. Collective."""
    full = pipe.gather_params(0)
    if pipe.world.rank != 0:
        return None
    model = Sequential(make_layers(), pipe.plan.shapes[0], pipe.model.dtype)
    model.params[...] = full
    model.state[:pipe.model.n_state] = pipe.model.state  # only stage 0 holds state
    return model


def figures(pipe: Pipeline, held: dict[str, Shard | None]) -> tuple[dict, list[dict] | None]:
    """The scores of each non-empty set of ``held``, and on rank 0 each rank's
    :meth:`Pipeline.memory` (None elsewhere). Collective."""
    scores = {}
    for name, shard in held.items():
        if shard is not None and shard.n_total:
            lo, hi = block_range(shard.n_total, pipe.n_replicas, pipe.replica)
            scores[name] = pipe.evaluate(shard.X[lo:hi], shard.y[lo:hi]).scores
    rows = C.gather_rows(pipe.world, np.array(list(pipe.memory().values()), np.float64))
    return scores, None if rows is None else [dict(zip(pipe.memory(), map(int, row)))
                                              for row in rows]
