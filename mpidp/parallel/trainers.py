"""Choosing a trainer by name: ``"data"``, ``"pipeline"`` or ``"hybrid"`` (a
:class:`~mpidp.parallel.pipeline.Pipeline` with several replicas)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .. import comm as C
from ..nn import Layer, Loss, Optimizer, Sequential
from .data_parallel import DataParallel
from .modes import MODES, PARALLEL
from .pipeline import Pipeline


def make_trainer(parallel: str, layers: Sequence[Layer], n_in: int, optimizer: Optimizer,
                 loss: Loss, comm: C.Comm | None = None, *, dtype: npt.DTypeLike = np.float32,
                 micro_batches: int = 1, schedule: str = "1f1b", n_stages: int | None = None,
                 **kwargs) -> DataParallel | Pipeline:
    """A trainer by name. Collective. ``"data"``: :class:`DataParallel` of ``Sequential(layers)``
    (:func:`mpidp.fit`); ``"pipeline"``: one pipeline over all ranks; ``"hybrid"``: pipelines
    of ``n_stages`` (default 2) stages (:func:`mpidp.parallel.pipeline_feed.fit_pipeline`;
    initialise with ``init_``)."""
    comm = comm if comm is not None else C.world()
    C.agree(comm, None if parallel in PARALLEL else
            f"unknown parallel mode {parallel!r}; expected one of {PARALLEL}")
    if parallel not in MODES:  # "data"
        model = C.run_agreed(comm, Sequential, layers, n_in, dtype)
        return DataParallel(model, optimizer, loss, comm, **kwargs)
    stages = MODES[parallel].stages  # None: every rank a stage of one pipeline
    if stages is None or n_stages is None:
        n_stages = comm.size if stages is None else stages
    return Pipeline(layers, n_in, optimizer, loss, comm, n_stages=n_stages,
                    micro_batches=micro_batches, schedule=schedule, dtype=dtype, **kwargs)
