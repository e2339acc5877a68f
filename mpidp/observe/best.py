"""Keeping the best model of a run: :class:`BestModel`, an ``on_epoch`` callback."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from ..nn.model import Sequential, save


class BestModel:
    """An ``on_epoch`` callback (see :class:`mpidp.RunSpec`) that keeps, in the file ``path``,
    the model of the epoch with the lowest ``val_loss`` so far (the loss on ``test={"val":
    ...}``), written by :func:`mpidp.nn.save` with ``meta`` plus ``epoch`` and ``val_loss``.
    It never asks the run to stop.

    ``model``: the model trained, or a callable returning it, called on every rank when an
    epoch improves (it may be collective). Only rank 0 of ``comm`` writes (``comm`` None: this
    process). :meth:`resume` takes the best of the epochs already done; :meth:`summary`: the
    file, epoch and loss kept, None until one is."""

    def __init__(self, path: str, model: Sequential | Callable[[], Sequential | None], *,
                 comm=None, meta: dict | None = None) -> None:
        self.path, self.comm, self.meta = path, comm, dict(meta or {})
        self.model = (lambda: model) if isinstance(model, Sequential) else model
        self.val_loss, self.epoch = math.inf, None

    def resume(self, history: list[dict]) -> None:
        """Take the best validation epoch of ``history`` (the records of the epochs done)."""
        for record in history:
            if record.get("val_loss") is not None and record["val_loss"] < self.val_loss:
                self.val_loss, self.epoch = record["val_loss"], record["epoch"]

    def __call__(self, record: dict) -> None:
        loss = record.get("val_loss")
        if loss is None or not loss < self.val_loss:  # a global figure: one verdict everywhere
            return
        self.val_loss, self.epoch = loss, record["epoch"]
        model = self.model()
        if self.comm is None or self.comm.rank == 0:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            save(model, self.path, meta={**self.meta, "epoch": self.epoch, "val_loss": loss})

    def summary(self) -> dict | None:
        return None if self.epoch is None else {
            "file": os.path.basename(self.path), "epoch": self.epoch, "val_loss": self.val_loss}
