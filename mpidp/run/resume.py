"""A run's hold on its folders (:func:`claimed`: the output folder and the checkpoint
folder)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from .. import comm as C
from . import checkpoint as ck
from .folders import hold_folder


@contextmanager
def claimed(comm: C.Comm, out: str, checkpoint_dir: str | None, *, resume: bool,
            restart: bool) -> Iterator[str | None]:
    """Hold ``out`` (rank 0 locks its path, so two jobs on a host never write one) and
    ``checkpoint_dir`` for the run (see :func:`mpidp.run.checkpoint.claim`). Yields the
    run id (None without checkpoints). Collective."""
    held: dict = {}

    def take() -> str | None:
        held["out"] = hold_folder(out, "out")
        if not checkpoint_dir:
            return None
        held["claim"] = ck.claim(checkpoint_dir, uuid.uuid4().hex, resume=resume,
                                 restart=restart)
        return held["claim"].run_id

    try:
        yield C.root_decides(comm, take)
    finally:
        if "claim" in held:
            held["claim"].release()
        if held.get("out") is not None:
            os.close(held["out"])
