"""Collective assertions: all ranks pass or all ranks fail, never one rank alone."""

from __future__ import annotations


def all_ranks(comm, ok: bool, message: str = "") -> None:
    """Assert ``ok`` on every rank: fails everywhere (naming the ranks) if it fails anywhere."""
    oks = comm.allgather(bool(ok))
    msgs = comm.allgather(message if not ok else "")
    bad = [r for r, o in enumerate(oks) if not o]
    assert not bad, f"failed on ranks {bad}: " + "; ".join(m for m in msgs if m)


def raises_everywhere(comm, exc_type, fn, match: str | None = None):
    """Call ``fn`` on every rank; assert every rank raised ``exc_type`` (with ``match``)."""
    try:
        fn()
        err = None
    except exc_type as exc:
        err = exc
    ok = err is not None and (match is None or match in str(err))
    all_ranks(comm, ok, f"rank {comm.rank}: got {err!r}, expected {exc_type.__name__} with {match!r}")
    return err


class CountingComm:
    """Forwards to a communicator and records the names of the calls made on it."""

    def __init__(self, comm):
        self._comm, self.calls, self._attrs = comm, [], {}

    def Get_attr(self, keyval):  # a communicator of its own: its companion is its own too
        return self._attrs.get(keyval)

    def Set_attr(self, keyval, value) -> None:
        self._attrs[keyval] = value

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if callable(attr):
            def wrapped(*args, **kwargs):
                self.calls.append(name)
                return attr(*args, **kwargs)
            return wrapped
        return attr


def file_map(a):
    """The ``mmap.mmap`` whose pages hold array ``a``, or None when ``a`` owns its memory."""
    import mmap

    import numpy as np
    while isinstance(a, np.ndarray):
        a = a.base
    if isinstance(a, memoryview):
        a = a.obj
    return a if isinstance(a, mmap.mmap) else None
