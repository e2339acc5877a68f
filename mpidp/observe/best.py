"""Keeping the best model of a run: :class:`BestModel`, an ``on_epoch`` callback."""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from ..atomic import write_atomic
from ..nn.model import Sequential, save


class BestModel:
    """An ``on_epoch`` callback (it never asks to stop) that keeps in file ``path`` the model
    of the epoch with the lowest ``val_loss`` so far, by :func:`mpidp.nn.save` with ``meta``,
    epoch and val_loss. ``model``: the model, or a callable returning it, called on every
    rank when an epoch improves (it may be collective). Only rank 0 of ``comm`` writes (None:
    this process). Each checkpoint carries the file (:meth:`kept`; a
    :class:`mpidp.run.spec.Checkpointing`'s ``best``); :meth:`resume` writes it again."""

    def __init__(self, path: str, model: Sequential | Callable[[], Sequential | None], *,
                 comm=None, meta: dict | None = None) -> None:
        self.path, self.comm, self.meta = path, comm, dict(meta or {})
        self.model = (lambda: model) if isinstance(model, Sequential) else model
        self.val_loss, self.epoch = math.inf, None
        self.file: bytes | None = None  # what the writer wrote to ``path`` (None elsewhere)
        self.written = False

    def resume(self, history: list[dict], carried: dict | None = None) -> None:
        """Take the best validation epoch of ``history`` (the epochs done); with ``carried``
        (a checkpoint's :attr:`~mpidp.run.checkpoint.State.best`), write its file again."""
        for record in history:
            if record.get("val_loss") is not None and record["val_loss"] < self.val_loss:
                self.val_loss, self.epoch = record["val_loss"], record["epoch"]
        if carried is not None:
            self.val_loss, self.epoch = carried["val_loss"], carried["epoch"]
            if self._writes() and carried.get("file") is not None:
                self.file = carried["file"]
                os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
                write_atomic(self.path, lambda f: f.write(self.file), "the best model")
            self.written = True

    def kept(self) -> dict | None:
        """What a checkpoint carries: the kept ``epoch``, ``val_loss`` and ``file`` (the
        written file's bytes on the writer, None elsewhere); None while none is written."""
        return {"epoch": self.epoch, "val_loss": self.val_loss,
                "file": self.file} if self.written else None

    def _writes(self) -> bool:
        return self.comm is None or self.comm.rank == 0

    def __call__(self, record: dict) -> None:
        loss = record.get("val_loss")
        if loss is None or not loss < self.val_loss:  # a global figure: one verdict everywhere
            return
        self.val_loss, self.epoch = loss, record["epoch"]
        model = self.model()
        if self._writes():
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            save(model, self.path, meta={**self.meta, "epoch": self.epoch, "val_loss": loss})
            with open(self.path, "rb") as f:
                self.file = f.read()
        self.written = True

    def summary(self) -> dict | None:
        return None if not self.written else {
            "file": os.path.basename(self.path), "epoch": self.epoch, "val_loss": self.val_loss}
