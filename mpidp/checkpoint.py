"""Checkpoints that survive crashes: written atomically by one rank, verified by checksum,
independent of the number of ranks (parameters are replicated; positions are global).

A checkpoint is an ``.npz`` holding ``params``, the optimizer's flat state arrays
(``opt.<name>``), a JSON ``meta`` (epoch, step, optimizer step count, the epoch's running
totals, history, configuration) and a BLAKE2 ``checksum`` over all of them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import comm as C
from .nn import Optimizer, Sequential

PATTERN = "ckpt-{:010d}.npz"
VERSION = 1


def write_atomic(path: str, write) -> None:
    """Write ``path`` via a temporary file in the same folder: write, flush, fsync, rename.

    A crash at any moment leaves either the old file or the complete new one.
    """
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


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


def save(directory: str, model: Sequential, optimizer: Optimizer, state: State, keep: int = 3) -> str:
    """Write a checkpoint for ``state`` into ``directory``; keep the newest ``keep``. Not
    collective: call it on one rank. Returns the file's path."""
    return save_flat(directory, model.params, optimizer.state, optimizer, state, keep)


def save_flat(directory: str, params: np.ndarray, opt_state: dict[str, np.ndarray],
              optimizer: Optimizer, state: State, keep: int = 3) -> str:
    """:func:`save` from the whole model's flat ``params`` and optimizer state arrays (as a
    pipeline gathers them from its stages); ``optimizer`` gives the type and step count.
    The file is the same whoever wrote it, so any layout may resume it."""
    os.makedirs(directory, exist_ok=True)
    arrays = {"params": params, **{f"opt.{k}": v for k, v in opt_state.items()}}
    meta = json.dumps({"version": VERSION, "epoch": state.epoch, "step": state.step,
                       "global_step": state.global_step, "totals": state.totals,
                       "history": state.history, "config": state.config,
                       "partition": state.partition,
                       "n_params": int(params.size), "dtype": str(params.dtype),
                       "optimizer": {"type": type(optimizer).__name__, "t": optimizer.t,
                                     "state": {k: list(v.shape) for k, v in opt_state.items()}}})
    path = os.path.join(directory, PATTERN.format(state.global_step))
    write_atomic(path, lambda f: np.savez(f, meta=meta, checksum=_digest(meta, arrays), **arrays))
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        os.unlink(old)
    return path


def list_checkpoints(directory: str) -> list[str]:
    """Checkpoint files in ``directory``, oldest first."""
    return sorted(glob.glob(os.path.join(directory, "ckpt-*.npz")))


def read(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """``(meta, arrays)`` of a checkpoint, after verifying its checksum.

    Raises ValueError naming the file if it is truncated, corrupted or not a checkpoint.
    """
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
    return json.loads(meta), arrays


def read_latest(directory: str) -> tuple[str, dict, dict[str, np.ndarray]] | None:
    """The newest checkpoint in ``directory`` that verifies; falls back to older ones and
    says so on stderr. None if there is none; ValueError if every one is damaged."""
    files = list_checkpoints(directory)
    problems = []
    for path in reversed(files):
        try:
            meta, arrays = read(path)
        except ValueError as exc:
            problems.append(str(exc))
            print(f"[mpidp] {exc}; trying the previous checkpoint", file=sys.stderr, flush=True)
            continue
        if problems:
            print(f"[mpidp] resuming from the previous good checkpoint {path}", file=sys.stderr,
                  flush=True)
        return path, meta, arrays
    if problems:
        raise ValueError(f"no usable checkpoint in {directory}: " + "; ".join(problems))
    return None


def restore(comm: C.Comm, directory: str, model: Sequential, optimizer: Optimizer,
            root: int = 0) -> tuple[str, State] | None:
    """Load the newest good checkpoint on ``root`` and give every rank its contents.

    Collective: ``root`` reads and checks the file; parameters and optimizer state reach the
    other ranks by ``Bcast`` (no shared filesystem needed). Returns ``(path, state)``, or
    None when ``directory`` holds no checkpoint. Any rank count may resume any checkpoint.
    """
    held: dict = {}

    def load_on_root():
        found = read_latest(directory) if os.path.isdir(directory) else None
        if found is None:
            return None
        path, meta, arrays = found
        check_fits(path, meta, model.n_params, model.dtype, optimizer)
        held["arrays"] = arrays
        return path, meta

    found = C.root_decides(comm, load_on_root, root=root)
    if found is None:
        return None
    path, meta = found
    arrays = held.pop("arrays", {})
    if comm.rank == root:
        model.params[...] = arrays["params"]
    C.bcast_(comm, model.params, root)
    optimizer.state = {}
    for name, shape in meta["optimizer"]["state"].items():
        buf = arrays[f"opt.{name}"] if comm.rank == root else np.empty(shape, model.dtype)
        optimizer.state[name] = C.bcast_(comm, np.ascontiguousarray(buf, model.dtype), root)
    optimizer.t = meta["optimizer"]["t"]
    return path, state_of(meta)


def state_of(meta: dict) -> State:
    """The :class:`State` recorded in a checkpoint's ``meta``."""
    return State(meta["epoch"], meta["step"], meta["global_step"], meta["totals"],
                 meta["history"], meta["config"], meta.get("partition", {}))


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
