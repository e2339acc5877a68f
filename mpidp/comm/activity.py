"""What this process is doing, as the watchdog sees it: computing, waiting in an MPI call
(every call of :mod:`mpidp.comm` marks itself with :func:`watched`), or excused (work that
may outlast a step, like writing a checkpoint). Plain attribute writes: cheap enough for
every call."""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager

COMPUTING, IN_MPI, EXCUSED = 0, 1, 2
STATE_NAMES = ("computing", "waiting in MPI", "excused")

#: Names of the watched calls, in definition order (identical in every process).
CALLS: list[str] = ["(nothing yet)"]


class _Mark:
    """This process's state, read by the watchdog thread (plain attributes: cheap)."""

    __slots__ = ("state", "call", "since", "step", "excuse")

    def __init__(self) -> None:
        self.state, self.call, self.since, self.step, self.excuse = COMPUTING, 0, time.monotonic(), -1, ""


MARK = _Mark()


def watched(what: str):
    """Decorator for the MPI calls of :mod:`mpidp.comm`: mark this rank as waiting in
    ``what`` while the call runs (a nested call keeps the outer mark; within an excused span
    it still counts as waiting in MPI)."""
    CALLS.append(what)
    code = len(CALLS) - 1

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            m = MARK
            if m.state == IN_MPI:  # nested in another watched call: the outer one counts
                return fn(*args, **kwargs)
            outer, outer_since = m.state, m.since
            m.state, m.call, m.since = IN_MPI, code, time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:  # back to computing, or to the excused span (whose clock runs on)
                m.state = outer
                m.since = outer_since if outer == EXCUSED else time.monotonic()
        return call
    return wrap


def set_step(step: int) -> None:
    """Record the training step this rank is at (shown in the watchdog's report)."""
    MARK.step = step


@contextmanager
def excused(what: str):
    """Work that may take longer than a step (writing a checkpoint): other ranks waiting
    meanwhile are not a stall, up to ten timeouts."""
    m = MARK
    prev = m.state, m.excuse
    m.state, m.excuse, m.since = EXCUSED, what, time.monotonic()
    try:
        yield
    finally:
        (m.state, m.excuse), m.since = prev, time.monotonic()
