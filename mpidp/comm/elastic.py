"""Surviving a lost rank: Open MPI's User-Level Failure Mitigation (ULFM) calls.

With ``MPI.ERRORS_RETURN`` a collective that meets a dead rank raises on the survivors
(:func:`is_lost_rank`); they shrink the communicator to themselves (:func:`shrink`) and
agree on where to go on (:func:`agree_min`). Which MPI can: :func:`ulfm_problem`
(docs/reliability.md).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from ..errors import MpidpError
from .runtime import Comm

#: the mpiexec options under which Open MPI notices a dead rank (see :func:`ulfm_problem`)
MPIEXEC_OPTIONS = "--with-ft ulfm --mca btl tcp,self"


def ulfm_problem(comm: Comm) -> str | None:
    """Why this MPI cannot keep a run going past a lost rank, or None. The same on every
    rank of a job (the library and the launcher's settings are the job's). Pure."""
    vendor = MPI.get_vendor()[0]
    if vendor != "Open MPI" or not hasattr(comm, "Shrink"):
        return (f"surviving a lost rank needs Open MPI's ULFM (User-Level Failure "
                f"Mitigation), and this MPI is {vendor}: use Open MPI 5 under "
                f"mpiexec {MPIEXEC_OPTIONS}")
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes"):
        return (f"surviving a lost rank needs Open MPI's ULFM switched on: start the job "
                f"with mpiexec {MPIEXEC_OPTIONS}")
    btl = os.environ.get("OMPI_MCA_btl", "")
    names = set(btl.lstrip("^").split(","))
    shared = "sm" not in names if btl.startswith("^") else bool(names & {"sm", "vader"})
    if not btl or shared or not btl.startswith("^") and "tcp" not in names:
        return (f"surviving a lost rank needs Open MPI's TCP transport (with shared memory "
                f"a dead rank is never noticed): start the job with mpiexec {MPIEXEC_OPTIONS}")
    return None


def hosts_problem(comm: Comm) -> str | None:
    """Why this job's ranks on several hosts cannot go on past a lost rank, or None: Open
    MPI's hierarchical collectives (``han``, chosen across hosts) do not survive a failure.
    Collective (the same answer on every rank)."""
    coll = os.environ.get("OMPI_MCA_coll", "")
    names = set(coll.lstrip("^").split(","))
    if coll and coll.startswith("^") == ("han" in names) or len(set(processor_names(comm))) < 2:
        return None
    return ("across hosts, surviving a lost rank needs Open MPI's hierarchical collectives "
            f"(han) off: start the job with mpiexec {MPIEXEC_OPTIONS} --mca coll ^han")


def errors_return(*comms: Comm) -> None:
    """Make MPI errors on ``comms`` raise :class:`mpi4py.MPI.Exception` (a dead rank among
    them included) instead of ending the job."""
    for comm in comms:
        comm.Set_errhandler(MPI.ERRORS_RETURN)
    if threading.excepthook is not _quiet_watchdog:
        _quiet_watchdog.previous = threading.excepthook
        threading.excepthook = _quiet_watchdog


def _quiet_watchdog(hook: threading.ExceptHookArgs) -> None:
    """A watchdog thread whose communicator lost a rank ends quietly: :func:`rewatch`
    starts another over the survivors."""
    if getattr(hook.thread, "name", None) != "mpidp-watchdog" or not is_lost_rank(hook.exc_value):
        _quiet_watchdog.previous(hook)


#: the error classes that say a rank of the communicator is lost (where this MPI has them)
LOST = tuple(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                              "ERR_REVOKED") if hasattr(MPI, name))


def is_lost_rank(exc: BaseException | None, comm: Comm | None = None) -> bool:
    """True when ``exc``, or an error it was raised from, says a rank of the communicator
    died (or another survivor revoked it because one did): the failures :func:`shrink`
    recovers from (a communication thread's among them, raised again by the caller). With
    ``comm``, also any other MPI error once a rank of ``comm`` is known dead (waiting up to
    ``FAILED_WAIT`` s for that): a nonblocking collective may report a lost rank so."""
    errors = []
    while exc is not None:
        if isinstance(exc, MPI.Exception):
            if exc.Get_error_class() in LOST:
                return True
            errors.append(exc)
        exc = exc.__cause__
    if not errors or comm is None or not hasattr(comm, "Get_failed"):
        return False
    until = time.monotonic() + FAILED_WAIT
    while comm.Get_failed().size == 0:
        if time.monotonic() > until:
            return False
        time.sleep(0.01)
    return True


#: How long :func:`is_lost_rank` waits for a dead rank to be known after an MPI error.
FAILED_WAIT = 2.0


def revoke(*comms: Comm) -> None:
    """Revoke ``comms`` (a rank lost): every rank's pending and next call on them fails,
    so no survivor waits there. Local; a communicator revoked already is let be."""
    for comm in comms:
        with contextlib.suppress(MPI.Exception):
            comm.Revoke()


def shrink(comm: Comm) -> tuple[Comm, list[int]]:
    """The survivors of ``comm`` in a new communicator with the same error handling, and the
    ranks of ``comm`` that are gone (confirmed by ``MPI_Comm_agree``). Collective over them."""
    revoke(comm)  # every survivor's pending and next call on comm fails: all come here
    comm.Ack_failed()
    new = comm.Shrink()
    errors_return(new)
    mine = np.arange(new.size, dtype=np.int32)
    old = np.asarray(MPI.Group.Translate_ranks(new.Get_group(), mine, comm.Get_group()))
    first, hosts = known_members(comm)
    new.Set_attr(_key(), ([first[int(r)] for r in old], hosts))
    lost = sorted(set(range(comm.size)) - set(int(r) for r in old))
    # every survivor must see the same set: bitwise AND of "mine equals the smallest view"
    view = np.array([len(lost), sum(lost)], np.int64)
    if not new.Agree(int(np.array_equal(view, agree_min(new, view)))):
        raise MpidpError(f"the survivors disagree on which ranks were lost ({lost} here)")
    return new, lost


def agree_min(comm: Comm, values) -> np.ndarray:
    """The elementwise minimum of every rank's ``values`` (int64). Collective."""
    out = np.asarray(values, np.int64).copy()
    comm.Allreduce(MPI.IN_PLACE, out, op=MPI.MIN)
    return out


def processor_names(comm: Comm) -> list[str]:
    """Every rank's processor name (host). Collective."""
    return comm.allgather(MPI.Get_processor_name())


def members(comm: Comm) -> tuple[list[int], dict[int, str]]:
    """Each rank of ``comm``'s rank in the job's first communicator, and the host of each of
    those, kept on ``comm`` (and by :func:`shrink` on the survivors'). Collective the first
    time on a communicator, local after."""
    if comm.Get_attr(_key()) is None:
        comm.Set_attr(_key(), (list(range(comm.size)), dict(enumerate(processor_names(comm)))))
    return known_members(comm)


def known_members(comm: Comm) -> tuple[list[int], dict[int, str]]:
    """What :func:`members` keeps on ``comm`` (without it: the ranks as they are, no host). Local."""
    kept = comm.Get_attr(_key())
    return kept if kept is not None else (list(range(comm.size)), {})


@functools.cache
def _key() -> int:
    """The attribute key under which :func:`members` keeps its answer on a communicator."""
    return MPI.Comm.Create_keyval()


def rewatch(dog, comm: Comm) -> None:
    """Point the watchdog ``dog`` at ``comm`` (the survivors): its old thread and private
    communicator, which a dead rank broke, are dropped. Collective over ``comm``."""
    dog._stop.set()
    if dog._thread is not None:
        dog._thread.join(timeout=2.0)
    dog._thread, dog.comm = None, comm
    dog.side = comm.Dup()
    dog._stop.clear()
    dog.start()


def end_quietly_at_exit(comm: Comm, status: int = 0) -> None:
    """After a run that lost ranks: at the interpreter's exit, meet the survivors, then
    leave with ``status`` without ``MPI_Finalize`` (which may wait for the dead ranks
    forever). Output is flushed first. Called again, the last ``comm`` and ``status`` hold."""
    if not _LEAVING:
        atexit.register(_leave)
    _LEAVING[:] = [comm, status]


_LEAVING: list = []


def exit_with(status: int) -> None:
    """A process that leaves at exit after lost ranks (:func:`end_quietly_at_exit`) leaves
    with ``status`` instead: the run failed after them (e.g. replicas found out of sync)."""
    if _LEAVING:
        _LEAVING[1] = status


def _leave() -> None:
    comm, status = _LEAVING
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        comm.Barrier()
        time.sleep(0.5)  # the others complete the barrier before this process goes
    finally:
        os._exit(status)
