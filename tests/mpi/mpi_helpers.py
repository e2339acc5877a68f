"""Collective assertions: all ranks pass or all ranks fail, never one rank alone."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np


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


def record_timer_sleeps(monkeypatch, slots: int = 1, slot=lambda: 0):
    """Record every sleep of mpidp's step timer (its ``slowdown``) by ``slot()``, one of
    ``slots``: returns float64 arrays ``(asked, slept)`` of the seconds asked for and those
    taken (wall clock), summed per slot and filled in as the timer sleeps."""
    from mpidp.observe import metrics
    asked, slept = np.zeros(slots), np.zeros(slots)

    def sleep(seconds):
        i, t = slot(), time.perf_counter()
        time.sleep(seconds)
        asked[i] += seconds
        slept[i] += time.perf_counter() - t
    monkeypatch.setattr(metrics, "time", SimpleNamespace(
        perf_counter=time.perf_counter, process_time=time.process_time, sleep=sleep))
    return asked, slept


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
