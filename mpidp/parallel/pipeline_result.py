"""What a pipeline run hands back beyond its history, gathered from its stages: the whole
model (:func:`whole_model`), the held-out scores and each rank's memory (:func:`figures`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from .. import comm as C
from ..data.distribute import Shard
from ..data.partition import block_range
from ..nn.layers import Layer
from ..nn.model import Sequential
from .pipeline import Pipeline


def whole_model(pipe: Pipeline, make_layers: Callable[[], Sequence[Layer]]) -> Sequential | None:
    """The whole model on rank 0 (stage 0 of replica 0), None elsewhere: ``make_layers()``
    (fresh unbound layers, the pipeline's) holding every stage's parameters, gathered, and
    the layer state (a Standardize in front) of stage 0. Collective."""
    full = pipe.gather_params(0)
    if pipe.world.rank != 0:
        return None
    model = Sequential(make_layers(), pipe.plan.shapes[0], pipe.model.dtype)
    model.params[...] = full
    model.state[:pipe.model.n_state] = pipe.model.state  # only stage 0 holds state
    return model


def figures(pipe: Pipeline, held: dict[str, Shard | None]) -> tuple[dict, list[dict] | None]:
    """The scores of each non-empty held-out set of ``held`` (each replica evaluates its
    block of the rows), and on rank 0 the bytes each rank holds (None elsewhere: see
    :meth:`Pipeline.memory`). Collective."""
    scores = {}
    for name, shard in held.items():
        if shard is not None and shard.n_total:
            lo, hi = block_range(shard.n_total, pipe.n_replicas, pipe.replica)
            scores[name] = pipe.evaluate(shard.X[lo:hi], shard.y[lo:hi]).scores
    rows = C.gather_rows(pipe.world, np.array(list(pipe.memory().values()), np.float64))
    return scores, None if rows is None else [dict(zip(pipe.memory(), map(int, row)))
                                              for row in rows]
