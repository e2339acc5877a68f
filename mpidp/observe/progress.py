"""Progress of an epoch's steps on rank 0's stderr (no MPI): ``auto`` draws a live bar when
this process's stderr, or that of the MPI launcher it is piped to, is a terminal, else a
plain line every :data:`LINE_SECONDS` (a batch log gets a few lines, not thousands)."""

from __future__ import annotations

import math
import os
import sys
import time

from ..errors import MpidpError

#: Draw a bar when someone watches, else lines (see :func:`watched`).
AUTO = "auto"
MODES = (AUTO, "bar", "lines", "none")
#: Seconds between two plain progress lines, unless :data:`SECONDS_VAR` in the environment says.
LINE_SECONDS = 10.0
SECONDS_VAR = "MPIDP_PROGRESS_SECONDS"
#: MPI launchers (as ``/proc/PID/comm`` names them): MPICH's and Intel MPI's Hydra, MPICH's
#: gforker, Open MPI 4's ``orterun`` and Open MPI 5's ``prterun``.
LAUNCHERS = frozenset({"mpiexec", "mpirun", "mpiexec.hydra", "mpiexec.gforker", "orterun",
                       "prterun", "prte"})
#: The per-node daemons a launcher starts ranks through (their parent is the launcher on
#: its own node).
PROXIES = frozenset({"hydra_pmi_proxy", "pmi_proxy", "orted", "prted"})


def line_seconds() -> float:
    """The seconds between two plain progress lines: ``MPIDP_PROGRESS_SECONDS`` if set (a
    finite number above 0, else :class:`~mpidp.errors.MpidpError`), or :data:`LINE_SECONDS`."""
    text = os.environ.get(SECONDS_VAR)
    if text is None:
        return LINE_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise MpidpError(f"{SECONDS_VAR}={text!r}: expected the seconds between two progress "
                         f"lines, a finite number above 0 (unset: {LINE_SECONDS:g})")
    return seconds


def _stderr(pid: int) -> str | None:
    """Where process ``pid``'s stderr leads (``/dev/pts/3``, ``pipe:[…]``, a path), or None."""
    try:
        return os.readlink(f"/proc/{pid}/fd/2")
    except OSError:
        return None


def _is_terminal(target: str | None) -> bool:
    return target is not None and target.startswith(("/dev/pts/", "/dev/tty"))


def _proc(pid: int, name: str) -> str:
    """The text of ``/proc/PID/NAME``; "" where unknown."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _parent(pid: int) -> int:
    """The parent of process ``pid``; 0 where unknown."""
    try:
        return int(_proc(pid, "stat").rpartition(")")[2].split()[1])
    except (ValueError, IndexError):
        return 0


def _launcher(pid: int, depth: int = 8) -> int | None:
    """The MPI launcher that process ``pid``'s stderr pipe leads to: the first process up
    its chain of parents named in :data:`LAUNCHERS`, or the parent of one named in
    :data:`PROXIES`, each reached through processes whose stderr is a pipe; None if none."""
    for _ in range(depth):
        parent = _parent(pid)
        if parent <= 1:
            return None
        name = _proc(parent, "comm").strip()
        if name in LAUNCHERS:
            return parent
        if name in PROXIES:
            launcher = _parent(parent)
            return launcher if launcher > 1 else None
        if not (_stderr(parent) or "").startswith("pipe:"):
            return None  # the output ends here, at no launcher
        pid = parent
    return None


def watched() -> bool:
    """True when this process's stderr is a terminal, or a pipe to an MPI launcher whose own
    stderr is a terminal (Linux ``/proc``; else whether stderr is a terminal)."""
    target = _stderr(os.getpid())
    if target is None:
        return sys.stderr.isatty()
    if _is_terminal(target):
        return True
    if not target.startswith("pipe:"):
        return False  # a file or a socket: nobody watches
    launcher = _launcher(os.getpid())
    return launcher is not None and _is_terminal(_stderr(launcher))


def resolve(mode: str | bool) -> str:
    """``mode`` (one of :data:`MODES`, or True/False for auto/none) as what to draw here:
    ``bar``, ``lines`` or ``none``."""
    if mode is True or mode is False:
        mode = AUTO if mode else "none"
    if mode not in MODES:
        raise ValueError(f"unknown progress {mode!r}; expected one of {MODES}")
    if mode == AUTO:
        return "bar" if watched() else "lines"
    return mode


class Progress:
    """The progress of one epoch of ``total`` steps (``initial`` already done), drawn as
    ``mode`` (:func:`resolve`): a tqdm bar (lines without tqdm), or a line every
    :func:`line_seconds`, whose error every rank raises alike, whatever it draws."""

    def __init__(self, total: int, desc: str, mode: str = "none", initial: int = 0,
                 clock=time.monotonic) -> None:
        self.every = line_seconds()  # on every rank, whatever it draws: the same error on each
        self.total, self.desc, self.n, self._bar, self.clock = total, desc, initial, None, clock
        self.mode, self.first = mode, initial
        if mode == "bar":
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, initial=initial, desc=desc, unit="step", leave=True,
                                 file=sys.stderr, dynamic_ncols=True, mininterval=0.1)
            except ImportError:
                self.mode = "lines"
        self.t0 = self.last = clock()

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
