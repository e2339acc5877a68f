"""A run's hold on its folders (:func:`claimed`: the output folder and the checkpoint
folder), and the checkpoint it resumes from, checked to fit the run (:func:`resumed`)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from .. import comm as C
from ..observe.watch import say
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
        held["out"] = hold_folder(out, "--out")
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


def resumed(comm: C.Comm, directory: str, config: dict, found) -> ck.State | None:
    """The state to resume from, ``found`` (``(path, state)``, or None: none in
    ``directory``), after checking that the checkpoint fits this run of settings ``config``
    (:func:`mpidp.run.checkpoint.compare_resume`: same settings and data, not more epochs
    done than asked); announces changed hyperparameters (and another ``--sync``) and
    records them in ``config["resume_changes"]``."""
    if found is None:
        say(comm, f"no checkpoint in {directory}: starting from the beginning")
        return None
    path, state = found
    state.source = state.source or path  # what a refusal of its position names
    changed, refusal = ck.compare_resume(state.config, config, state=state, path=path)
    if refusal:
        raise C.MpidpError(refusal)
    if changed:
        config["resume_changes"] = changed
        say(comm, ck.format_changes(changed))
    say(comm, f"resumed from {path}: epoch {state.epoch + 1}, step {state.step}, "
        f"{state.global_step} steps done (written with "
        f"{state.config.get('world_size', '?')} ranks, now {comm.size})")
    return state
