"""Checkpoints that survive crashes: written atomically by one rank, verified by checksum,
independent of the number of ranks (parameters are replicated; positions are global).

A checkpoint is an ``.npz`` of ``params``, the optimizer's flat state arrays
(``opt.<name>``), a JSON ``meta`` (position, optimizer step count, running totals,
history, configuration, run id), the best epoch's model file when the run keeps one
(``best``: its bytes; its epoch and loss in ``meta["best"]``) and a BLAKE2 ``checksum`` over
all of them. A folder belongs to one run at a time (:func:`claim`); a checkpoint is only ever
replaced by a newer one (:func:`save`). Each records the run's settings and
:func:`data_fingerprint`, which a resume must agree with (:mod:`mpidp.cli.settings`)."""

from __future__ import annotations

import contextlib
import copy
import glob
import hashlib
import json
import os
import re
import sys
import uuid
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import comm as C
from ..atomic import check_place, write_atomic
from ..data.sources import metadata_fingerprint as data_fingerprint  # noqa: F401
from ..errors import is_whole, setting
from ..nn import Optimizer, Sequential
from . import folders as F
from .nonfinite import NonFiniteError, all_finite, overflow_advice

PATTERN = "ckpt-{:010d}.npz"
DAMAGED_PREFIX = "damaged-"
VERSION = 1


def _digest(meta: str, arrays: dict[str, np.ndarray]) -> str:
    h = hashlib.blake2b(meta.encode(), digest_size=16)
    for key in sorted(arrays):
        a = np.ascontiguousarray(arrays[key])
        h.update(f"{key}:{a.dtype.str}:{a.shape}".encode())
        h.update(a.view(np.uint8).reshape(-1))
    return h.hexdigest()


@dataclass
class State:
    """What a checkpoint restores: position, optimizer step count and running totals."""

    epoch: int = 0            # epoch in progress (0-based)
    step: int = 0             # steps of that epoch already done
    global_step: int = 0      # steps done since the start of training
    totals: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # loss, count, correct
    history: list[dict] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    partition: dict[str, Any] = field(default_factory=dict)  # e.g. adaptive capacities
    source: str | None = None  # the checkpoint file it was read from (not saved)
    #: the best epoch's model file: ``epoch``, ``val_loss`` and (on the root rank) ``file``,
    #: its bytes (see :class:`mpidp.BestModel`); None: the run keeps none (yet)
    best: dict[str, Any] | None = None


def claim(directory: str, run_id: str, *, resume: bool, restart: bool = False) -> F.Claim:
    """Take checkpoint folder ``directory`` for run ``run_id`` (on the root rank, before
    anything is read or written there); release the :class:`~mpidp.run.folders.Claim` at the
    end. The folder is created, locked (another live job's is refused) and cleaned of stale
    ``.tmp-*`` files; then ``restart`` deletes its checkpoints and ``run.json``, ``resume``
    keeps its run (``Claim.run_id``: the one its ``run.json`` names), neither refuses a
    folder holding checkpoints: ValueError naming it and the way forward (lock let go)."""
    if resume and restart:
        raise ValueError(f"{setting('resume')} continues the run in {directory} and "
                         f"{setting('restart')} deletes it: give one of them")
    try:
        os.makedirs(directory, exist_ok=True)
        fd = F.lock_folder(directory)
    except OSError as exc:
        raise ValueError(f"{setting('checkpoint_dir')} {directory}: cannot use it as a "
                         f"checkpoint folder ({exc})") from exc
    try:
        held = F.Claim(directory, run_id, _fd=fd)
        held.cleaned = F.clean_stale_tmp(directory, max_age_s=60.0)
        owner, found = F.read_run(directory), list_checkpoints(directory)
        if restart:
            held.wiped = _wipe(directory)
        elif found and not resume:
            whose = "another run"
            if owner and owner.get("run_id"):
                whose += (f" (run {owner['run_id']}, started {owner.get('created', '?')} on "
                          f"{owner.get('host', '?')})")
            raise ValueError(f"checkpoint folder {directory} already holds checkpoints of "
                             f"{whose}, the newest {os.path.basename(found[-1])}: give this run "
                             f"another {setting('checkpoint_dir')}, continue that run with "
                             f"{setting('resume')}, or add {setting('restart')} to delete its "
                             f"checkpoints and start over")
        if resume and owner is not None and owner.get("run_id"):
            held.run_id, held.continued = owner["run_id"], True
        else:
            held.continued = bool(resume and found)
            F.write_run(directory, run_id)
    except BaseException:
        F.unlock_folder(fd)
        raise
    return held


@contextlib.contextmanager
def claimed(comm: C.Comm, out: str, checkpoint_dir: str | None, *, resume: bool,
            restart: bool) -> Iterator[str | None]:
    """Hold a run's folders: ``out`` (rank 0 locks its path: two jobs on a host never write
    one) and ``checkpoint_dir`` (:func:`claim`). Yields the run id (None: no checkpoints)."""
    held: dict = {}

    def take() -> str | None:
        held["out"] = F.hold_folder(out, "out")
        if checkpoint_dir:
            held["claim"] = claim(checkpoint_dir, uuid.uuid4().hex, resume=resume, restart=restart)
        return held["claim"].run_id if checkpoint_dir else None

    try:
        yield C.root_decides(comm, take)
    finally:
        if "claim" in held:
            held["claim"].release()
        if held.get("out") is not None:
            os.close(held["out"])


def _wipe(directory: str) -> list[str]:
    """Delete the checkpoints (good or set aside) and ``run.json`` in ``directory``."""
    removed = []
    paths = list_checkpoints(directory) + glob.glob(os.path.join(directory, DAMAGED_PREFIX + "ckpt-*"))
    for path in paths + [os.path.join(directory, F.RUN_FILE)]:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed


def list_checkpoints(directory: str) -> list[str]:
    """Checkpoint files in ``directory``, oldest first."""
    return sorted(p for p in glob.glob(os.path.join(directory, "ckpt-*.npz"))
                  if re.fullmatch(r"ckpt-\d{10}\.npz", os.path.basename(p)))


def newest_step(directory: str) -> int | None:
    """Global step of the newest checkpoint file in ``directory`` (None if there is none)."""
    found = list_checkpoints(directory)
    return int(os.path.basename(found[-1])[5:15]) if found else None


def save(directory: str, model: Sequential, optimizer: Optimizer, state: State, keep: int = 3,
         *, run_id: str | None = None) -> str:
    """Write a checkpoint for ``state`` into ``directory``; keep the newest ``keep``. Not
    collective: call it on one rank. Returns the file's path. See :func:`save_flat`."""
    arrays = {"params": model.params, **({"state": model.state} if model.n_state else {})}
    return _write(directory, arrays, optimizer, state, keep, run_id)


def save_flat(directory: str, params: np.ndarray, optimizer: Optimizer, state: State,
              keep: int = 3, *, run_id: str | None = None) -> str:
    """:func:`save` from the whole model's flat ``params`` and an ``optimizer`` holding the
    whole model's state arrays (as a pipeline gathers them): any layout may resume it.
    Raises ValueError, writing nothing, if ``state`` is behind the newest checkpoint (a
    smaller ``global_step``, or the same at an earlier ``(epoch, step)``), or if ``run_id``
    is given and the folder's ``run.json`` names another run."""
    return _write(directory, {"params": params}, optimizer, state, keep, run_id)


def _write(directory: str, model_arrays: dict[str, np.ndarray], optimizer: Optimizer,
           state: State, keep: int, run_id: str | None) -> str:
    """:func:`save_flat` of ``params`` and, for a model with layer state, ``state``."""
    params = model_arrays["params"]
    if not all(all_finite(a) for a in model_arrays.values()):
        n, kept = state.global_step, list_checkpoints(directory)
        raise NonFiniteError(
            f"the parameters after {n} step{'s' * (n != 1)} are not finite (an update "
            f"overflowed), so no checkpoint is written of them; "
            f"{overflow_advice(os.path.basename(kept[-1]) if kept else None)}")
    os.makedirs(directory, exist_ok=True)
    _check_not_behind(directory, state)
    if run_id is not None:
        owner = F.read_run(directory) or {}
        if owner.get("run_id") != run_id:
            raise ValueError(f"checkpoint folder {directory} belongs to run "
                             f"{owner.get('run_id')}, not to this run ({run_id}): another job "
                             f"took it over; this run writes no more checkpoints there")
    opt_state = optimizer.state
    arrays = {**model_arrays, **{f"opt.{k}": v for k, v in opt_state.items()}}
    best = None
    if state.best is not None and state.best.get("file") is not None:
        arrays["best"] = np.frombuffer(state.best["file"], np.uint8)
        best = {"epoch": state.best["epoch"], "val_loss": state.best["val_loss"]}
    n_state = int(model_arrays["state"].size) if "state" in model_arrays else 0
    meta = json.dumps({"version": VERSION, "epoch": state.epoch, "step": state.step,
                       "global_step": state.global_step, "totals": state.totals,
                       "history": state.history, "config": state.config,
                       "partition": state.partition, "run_id": run_id, "best": best,
                       "n_params": int(params.size), "n_state": n_state,
                       "dtype": str(params.dtype),
                       "optimizer": {"type": type(optimizer).__name__, "t": optimizer.t,
                                     "state": {k: list(v.shape) for k, v in opt_state.items()}}})
    path = os.path.join(directory, PATTERN.format(state.global_step))
    write_atomic(path, lambda f: np.savez(f, meta=meta, checksum=_digest(meta, arrays), **arrays))
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(old)
    return path


def _check_not_behind(directory: str, state: State) -> None:
    """ValueError unless ``state`` may be written beside the newest checkpoint (see save)."""
    newest = newest_step(directory)
    if newest is None or state.global_step > newest:
        return
    held = f"step {newest}"
    if state.global_step == newest:
        try:
            with np.load(os.path.join(directory, PATTERN.format(newest)), allow_pickle=False) as z:
                meta = json.loads(str(z["meta"]))
        except Exception:  # noqa: BLE001 - a damaged file of the same step may be replaced
            return
        if (state.epoch, state.step) >= (meta["epoch"], meta["step"]):
            return
        held += f" at epoch {meta['epoch']}, step {meta['step']}"
    raise ValueError(f"not writing a checkpoint of step {state.global_step} (epoch "
                     f"{state.epoch}, step {state.step}) into {directory}: it holds {held} "
                     f"already, and a checkpoint is only ever replaced by a newer one")


def read(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """``(meta, arrays)`` of a checkpoint, after verifying its checksum and its contents
    (:func:`contents_problem`). Raises ValueError naming the file if it is truncated,
    corrupted, not a checkpoint, or inconsistent."""
    check_place(path, "checkpoint")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta, checksum = str(z["meta"]), str(z["checksum"])
            arrays = {k: z[k] for k in z.files if k not in ("meta", "checksum")}
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(f"checkpoint {path} is unreadable (truncated or corrupted): {exc}") from None
    except Exception as exc:  # noqa: BLE001 - zlib, struct ... errors from a damaged file
        raise ValueError(f"checkpoint {path} is unreadable: {type(exc).__name__}: {exc}") from None
    if _digest(meta, arrays) != checksum:
        raise ValueError(f"checkpoint {path} fails its checksum (corrupted)")
    try:
        meta = json.loads(meta)
    except ValueError as exc:
        raise ValueError(f"checkpoint {path} is unreadable: its meta is not JSON ({exc})") from None
    if problem := contents_problem(meta, arrays):
        raise ValueError(f"checkpoint {path} is inconsistent (edited, or written by another "
                         f"program): {problem}")
    return meta, arrays


def contents_problem(meta, arrays: dict[str, np.ndarray]) -> str | None:
    """Why checkpoint contents ``(meta, arrays)`` whose checksum holds (a hand-edited file)
    are unusable; None if :func:`restore` can load them (counters, totals, the arrays)."""
    if not isinstance(meta, dict):
        return "its meta is not a JSON object"
    for key, what in (("epoch", "epoch"), ("step", "step"), ("global_step", "global step"),
                      ("n_params", "parameter count"), ("n_state", "layer state size")):
        value = meta.get(key, 0 if key == "n_state" else None)
        if not is_whole(value):
            return f"its {what} is {value!r}, not an integer >= 0"
    totals = meta.get("totals")
    if not (isinstance(totals, list) and len(totals) == 3
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in totals)):
        return f"its running totals are {totals!r}, not three numbers (loss, count, correct)"
    for key, kind in (("history", list), ("config", dict), ("partition", dict)):
        if not isinstance(meta.get(key, kind()), kind):
            return f"its {key} is a {type(meta[key]).__name__}, not a {kind.__name__}"
    opt = meta.get("optimizer")
    if not (isinstance(opt, dict) and isinstance(opt.get("type"), str)
            and isinstance(opt.get("state"), dict) and isinstance(meta.get("dtype"), str)):
        return "its optimizer record (type, update count, state) or its dtype is missing"
    if not is_whole(opt.get("t")):
        return f"its optimizer's update count is {opt.get('t')!r}, not an integer >= 0"
    return _arrays_problem(meta, arrays)


def _arrays_problem(meta: dict, arrays: dict[str, np.ndarray]) -> str | None:
    """:func:`contents_problem` of the arrays, for a ``meta`` whose records are well formed."""
    n, n_state, opt = meta["n_params"], meta.get("n_state", 0), meta["optimizer"]
    expected = {"params": (n,), **({"state": (n_state,)} if n_state else {})}
    if isinstance(meta.get("best"), dict) and "best" in arrays:  # a file of any length
        expected["best"] = arrays["best"].shape
    for name, shape in opt["state"].items():
        if not (isinstance(shape, list) and all(is_whole(d) for d in shape)):
            return f"its optimizer state {name!r} has the shape {shape!r}"
        expected[f"opt.{name}"] = tuple(shape)
    for key, shape in expected.items():
        if key not in arrays:
            return f"it holds no array {key}, which its meta records"
        if arrays[key].shape != shape:
            return (f"its array {key} has the shape {arrays[key].shape} but its meta records "
                    f"{shape}")
        if key.startswith("opt.") and shape != (n,):
            return (f"its optimizer state {key[4:]!r} has the shape {shape}, but an optimizer "
                    f"holds one value per parameter: ({n},)")
    if extra := sorted(set(arrays) - set(expected)):
        return f"it holds arrays its meta does not record: {', '.join(extra)}"
    if str(arrays["params"].dtype) != meta["dtype"]:
        return f"its params are {arrays['params'].dtype}, its meta records {meta['dtype']}"
    return None


def read_latest(directory: str) -> tuple[str, dict, dict[str, np.ndarray]] | None:
    """The newest checkpoint in ``directory`` that verifies, else older ones (said on
    stderr); None if there is none, ValueError if every one is damaged. Damaged newer ones
    are renamed ``damaged-ckpt-*.npz``: the resumed run may write those steps again."""
    problems, damaged = [], []
    for path in reversed(list_checkpoints(directory)):
        try:
            meta, arrays = read(path)
        except ValueError as exc:
            problems.append(str(exc))
            damaged.append(path)
            print(f"[mpidp] {exc}; trying the previous checkpoint", file=sys.stderr, flush=True)
            continue
        if problems:
            print(f"[mpidp] resuming from the previous good checkpoint {path}", file=sys.stderr,
                  flush=True)
        for bad in damaged:
            aside = os.path.join(directory, DAMAGED_PREFIX + os.path.basename(bad))
            os.replace(bad, aside)
            print(f"[mpidp] set the damaged {bad} aside as {aside}", file=sys.stderr, flush=True)
        return path, meta, arrays
    if problems:
        raise ValueError(f"no usable checkpoint in {directory}: " + "; ".join(problems)
                         + f"; start over with {setting('restart')}, or give another "
                         f"{setting('checkpoint_dir')}")
    return None


def restore(comm: C.Comm, directory: str, model: Sequential, optimizer: Optimizer,
            root: int = 0) -> tuple[str, State] | None:
    """Load the newest good checkpoint on ``root`` and ``Bcast`` its contents to every rank
    (no shared filesystem needed; any rank count may resume any checkpoint). Collective.
    Returns ``(path, state)``, or None when ``directory`` holds no checkpoint."""
    held: dict = {}

    def load_on_root():
        if (found := read_latest(directory)) is None:  # none, or no folder
            return None
        path, meta, arrays = found
        check_fits(path, meta, model.n_params, model.dtype, optimizer)
        if meta.get("n_state", 0) != model.n_state:
            raise ValueError(f"checkpoint {path} holds {meta.get('n_state', 0)} values of "
                             f"layer state (running statistics) but the model has "
                             f"{model.n_state}: a different model")
        held["arrays"] = arrays
        return path, meta

    found = C.root_decides(comm, load_on_root, root=root)
    if found is None:
        return None
    path, meta = found
    arrays = held.pop("arrays", {})
    for name in ("params", "state") if model.n_state else ("params",):
        if comm.rank == root:
            getattr(model, name)[...] = arrays[name]
        C.bcast_(comm, getattr(model, name), root)
    optimizer.state = {}
    for name, shape in meta["optimizer"]["state"].items():
        buf = arrays[f"opt.{name}"] if comm.rank == root else np.empty(shape, model.dtype)
        optimizer.state[name] = C.bcast_(comm, np.ascontiguousarray(buf, model.dtype), root)
    optimizer.t = meta["optimizer"]["t"]
    state = state_of(meta)
    state.source = path
    if state.best is not None and comm.rank == root:
        state.best["file"] = arrays["best"].tobytes()
    return path, state


def state_of(meta: dict) -> State:
    """The :class:`State` recorded in a checkpoint's ``meta``."""
    best = meta.get("best")
    return State(meta["epoch"], meta["step"], meta["global_step"], meta["totals"],
                 meta["history"], meta["config"], meta.get("partition", {}),
                 best=dict(best) if isinstance(best, dict) else None)


def check_fits(path: str, meta: dict, n_params: int, dtype: np.dtype, optimizer: Optimizer) -> None:
    """ValueError naming ``path`` unless its model size, dtype and optimizer type match."""
    if meta["n_params"] != n_params:
        raise ValueError(f"checkpoint {path} has {meta['n_params']} parameters but the model "
                         f"has {n_params}: a different model")
    if meta["dtype"] != str(np.dtype(dtype)):
        raise ValueError(f"checkpoint {path} holds {meta['dtype']} parameters, the model "
                         f"is {np.dtype(dtype)}")
    if meta["optimizer"]["type"] != type(optimizer).__name__:
        raise ValueError(f"checkpoint {path} was written with {meta['optimizer']['type']}, "
                         f"not {type(optimizer).__name__}")
    probe = copy.copy(optimizer)  # the state arrays its first update makes
    probe.state = {}
    try:
        probe._prepare(np.zeros(1, dtype))
    except Exception:  # noqa: BLE001 - an optimizer of another kind: nothing to compare
        return
    held, needed = set(meta["optimizer"]["state"]), set(probe.state)
    if held and needed and not needed <= held:  # (none held: the optimizer starts afresh)
        raise ValueError(f"checkpoint {path} is inconsistent (edited, or written by another "
                         f"program): it holds the {type(optimizer).__name__} state "
                         f"{sorted(held)}, but {type(optimizer).__name__} needs "
                         f"{sorted(needed)}; start over with {setting('restart')}")


def check_position(state: State, steps_per_epoch: int, path: str | None = None) -> str | None:
    """Why a run of ``steps_per_epoch`` steps an epoch cannot resume at ``state``'s step
    (past its epoch's end), or None; ``path`` names the checkpoint (``state.source``)."""
    if state.step <= steps_per_epoch:
        return None
    path = path or state.source or "the checkpoint"
    return (f"checkpoint {path} is at step {state.step} of epoch {state.epoch + 1}, but an "
            f"epoch of this run has {steps_per_epoch} steps: it was edited, or written for "
            f"other data or batches; start over with {setting('restart')}")
