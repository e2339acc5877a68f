"""Failing loudly: an error on one rank ends the whole job, never leaves the others waiting."""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback

from mpi4py import MPI

from .runtime import SHM_DIR, Comm

#: Seconds for mpiexec to forward our output before the abort; for the abort to end us.
_FORWARD_S, _ABORT_GRACE_S = 0.3, 10.0


#: Name prefixes of the shared-memory files each MPI keeps in /dev/shm while a job runs:
#: MPICH's ``mpich_shm_*``; Open MPI 5's ``sm_segment.*`` (``vader_segment.*`` in 4.x),
#: which its launcher also removes after an abort, unless the launcher itself is killed.
_SHM_PREFIXES = {"MPICH": ("mpich_shm_",), "Open MPI": ("sm_segment.", "vader_segment.")}


def _unlink_shm_segments() -> None:
    """Remove the names of the MPI library's shared-memory files this process maps (after
    ``MPI_Abort`` nobody would, and they hold RAM until reboot), by the vendor's prefixes."""
    prefixes = tuple(f"{SHM_DIR}/{p}" for p in _SHM_PREFIXES.get(MPI.get_vendor()[0], ()))
    if not prefixes:
        return
    try:
        with open("/proc/self/maps") as f:
            paths = {path for path in (line.split(None, 5)[5].strip().removesuffix(" (deleted)")
                                       for line in f if f"{SHM_DIR}/" in line)
                     if path.startswith(prefixes)}
    except (OSError, IndexError):
        return
    for path in paths:
        with contextlib.suppress(OSError):
            os.unlink(path)


def abort_job(comm: Comm, code: int) -> None:
    """``MPI_Abort`` the job, and leave this process within seconds even if the launcher
    cannot be reached (a rank cut off from its job by a dead link must not live on)."""
    import threading
    sys.stderr.flush()
    sys.stdout.flush()
    _unlink_shm_segments()
    time.sleep(_FORWARD_S)
    threading.Timer(_ABORT_GRACE_S, os._exit, args=(code,)).start()
    comm.Abort(code)
    os._exit(code)


def _abort_hook(exc_type, exc, tb) -> None:
    comm = MPI.COMM_WORLD
    if comm.size == 1 or issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)  # nobody waits on us: exit the normal way
        return
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(f"[mpidp] rank {comm.rank}/{comm.size} failed; aborting the job.\n{text}")
    abort_job(comm, 1)


def abort_on_error(enable: bool = True) -> None:
    """Install (or with ``enable=False`` remove) a ``sys.excepthook`` that prints the rank
    and traceback, then ``MPI_Abort``s the whole job, so that an uncaught exception on one
    rank does not leave the others waiting forever. ``import mpidp.comm`` installs it
    (``MPIDP_ABORT_ON_ERROR=0`` opts out). Idempotent."""
    if not enable:
        if sys.excepthook is _abort_hook:
            sys.excepthook = sys.__excepthook__
    elif MPI.Is_initialized() and not MPI.Is_finalized():
        sys.excepthook = _abort_hook
