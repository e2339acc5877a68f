"""Progress of an epoch's steps on rank 0's stderr (no MPI).

Under ``mpiexec`` a rank's stderr is a pipe to the launcher, so whether a person watches is
the launcher's business: ``auto`` draws a live bar when this process's stderr, or that of
the launcher it is forwarded through, is a terminal, and writes a plain line every
:data:`LINE_SECONDS` otherwise (a batch log gets a few lines, not thousands).
"""

from __future__ import annotations

import os
import sys
import time

MODES = ("auto", "bar", "lines", "none")
#: Seconds between two plain progress lines (``MPIDP_PROGRESS_SECONDS`` overrides it).
LINE_SECONDS = 10.0


def watched(pid: int | None = None, depth: int = 8) -> bool:
    """True when stderr of process ``pid`` (this one by default), or of the first process
    up its chain of parents whose stderr is not a pipe (the launcher's, through which a
    rank's output is forwarded), is a terminal. Linux ``/proc``; False where unknown."""
    pid = os.getpid() if pid is None else pid
    for _ in range(depth):
        try:
            target = os.readlink(f"/proc/{pid}/fd/2")
        except OSError:
            return sys.stderr.isatty() if pid == os.getpid() else False
        if target.startswith(("/dev/pts/", "/dev/tty")):
            return True
        if not target.startswith("pipe:"):
            return False  # a file or a socket: nobody watches
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rpartition(")")[2].split()[1])  # the parent's pid
        except (OSError, ValueError, IndexError):
            return False
        if pid <= 1:
            return False
    return False


def resolve(mode: str | bool) -> str:
    """``mode`` (one of :data:`MODES`, or True/False for auto/none) as what to draw here:
    ``bar``, ``lines`` or ``none``."""
    if mode is True or mode is False:
        mode = "auto" if mode else "none"
    if mode not in MODES:
        raise ValueError(f"unknown progress {mode!r}; expected one of {MODES}")
    if mode == "auto":
        return "bar" if watched() else "lines"
    return mode


class Progress:
    """The progress of one epoch of ``total`` steps (``initial`` already done), drawn as
    ``mode`` (``bar``, ``lines`` or ``none``, see :func:`resolve`): a tqdm bar (a line per
    :data:`LINE_SECONDS` without tqdm), or a plain line every :data:`LINE_SECONDS`."""

    def __init__(self, total: int, desc: str, mode: str = "none", initial: int = 0,
                 clock=time.monotonic) -> None:
        self.total, self.desc, self.n, self._bar, self.clock = total, desc, initial, None, clock
        self.mode = mode
        if mode == "bar":
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", leave=True,
                                 file=sys.stderr, dynamic_ncols=True, mininterval=0.1)
            except ImportError:
                self.mode = "lines"
        self.every = float(os.environ.get("MPIDP_PROGRESS_SECONDS", LINE_SECONDS))
        self.t0 = self.last = clock()
        self.first = initial

    def update(self, loss: float) -> None:
        self.n += 1
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            return
        now = self.clock()
        if self.mode == "lines" and now - self.last >= self.every and self.n < self.total:
            self.last = now
            rate = (self.n - self.first) / max(now - self.t0, 1e-9)
            print(f"{self.desc}: {self.n}/{self.total} steps, loss {loss:.4f}, "
                  f"{rate:.1f} steps/s", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
