"""Digests of array bytes, to tell whether two arrays (on two ranks, or in two files) are
bit-identical without moving them. Pure, no MPI."""

from __future__ import annotations

import hashlib

import numpy as np


def checksum(array: np.ndarray) -> int:
    """A 63-bit digest of ``array``'s C-order bytes, equal for bit-identical arrays; an int64 >= 0."""
    digest = hashlib.blake2b(np.ascontiguousarray(array).view(np.uint8), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def state_of(optimizer: object) -> str:
    """What identifies an optimizer's state (moments, velocities): each array's name and
    :func:`checksum`, sorted; "none" when it holds none yet."""
    state = getattr(optimizer, "state", None) or {}
    return ", ".join(f"{k} {checksum(v):016x}" for k, v in sorted(state.items())) or "none"


def settings_of(obj: object, skip: tuple[str, ...] = ()) -> str:
    """What identifies ``obj``'s settings: its class and plain attributes (and the ``config()``
    of those that have one), sorted; ``skip``: attributes that count what was done."""
    plain = (int, float, str, bool, type(None), np.number)
    parts = []
    for name, value in sorted(vars(obj).items()) if hasattr(obj, "__dict__") else ():
        if name.startswith("_") or name in skip:
            continue
        if isinstance(value, plain) or isinstance(value, tuple) and all(
                isinstance(v, plain) for v in value):
            parts.append(f"{name}={value!r}")
        elif callable(getattr(value, "config", None)):
            parts.append(f"{name}={type(value).__name__}{value.config()!r}")
    return f"{type(obj).__name__}({', '.join(parts)})"


def dtype_name(dtype: object) -> str:
    """``dtype``'s NumPy name, else its ``repr`` (so a bad value is compared, not raised on one rank)."""
    try:
        return np.dtype(dtype).name
    except TypeError:
        return repr(dtype)
