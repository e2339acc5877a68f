"""Failing loudly: an error on one rank ends the whole job (:func:`abort_on_error`), as does a
stalled rank, named. Every MPI call marks this process as waiting in MPI
(:func:`~.runtime.watched`); a thread per rank checks the mark and past the timeout holds a roll
call on a private duplicate of the communicator (docs/reliability.md, "The watchdog")."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import time
import traceback

import numpy as np
from mpi4py import MPI

from .runtime import CALLS, COMPUTING, EXCUSED, IN_MPI, MARK, SHM_DIR, STATE_NAMES, USER_CODE

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


def abort_job(code: int) -> None:
    """``MPI_Abort`` the whole job (``COMM_WORLD``, whatever communicator a run uses, so
    the launcher exits with ``code``), and leave this process within seconds even if the
    launcher cannot be reached (a rank cut off from its job by a dead link must not live on)."""
    sys.stderr.flush()
    sys.stdout.flush()
    _unlink_shm_segments()
    time.sleep(_FORWARD_S)
    threading.Timer(_ABORT_GRACE_S, os._exit, args=(code,)).start()
    MPI.COMM_WORLD.Abort(code)
    os._exit(code)


def _abort_hook(exc_type, exc, tb) -> None:
    comm = MPI.COMM_WORLD
    if comm.size == 1 or issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)  # nobody waits on us: exit the normal way
        return
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    sys.stderr.write(f"[mpidp] rank {comm.rank}/{comm.size} failed; aborting the job.\n{text}")
    abort_job(1)


def abort_on_error(enable: bool = True) -> None:
    """Install (``enable=False``: remove) a ``sys.excepthook`` that prints the rank and
    traceback and ``MPI_Abort``s the job, so no rank waits forever. Idempotent."""
    if not enable:
        if sys.excepthook is _abort_hook:
            sys.excepthook = sys.__excepthook__
    elif MPI.Is_initialized() and not MPI.Is_finalized():
        sys.excepthook = _abort_hook


_ROLL, _REPLY = 71, 72
EXIT_CODE = 3
GRACE = 6.0  # s a roll call waits for answers: a rank starved of CPU still answers in it
EXCUSED_TIMEOUTS = 10  # how many timeouts excused work (and an MPI call inside it) may last


class Watchdog:
    """Watch this rank of ``comm`` for stalls longer than ``timeout`` seconds. Collective to
    create (it duplicates ``comm``); :meth:`start` it on every rank, :meth:`stop` at the end.
    ``timeout=None``: ``max(floor, steps * median step)`` of the times :meth:`step_done` gets.
    ``grace``: seconds a roll call waits for the others' answers (None: :data:`GRACE`)."""

    def __init__(self, comm: MPI.Comm, timeout: float | None, grace: float | None = None,
                 floor: float = 600.0, steps: int = 50) -> None:
        grace = GRACE if grace is None else grace
        if timeout is not None and not timeout > 0:
            raise ValueError(f"watchdog timeout must be > 0 seconds, got {timeout}")
        if not grace > 0:
            raise ValueError(f"watchdog grace must be > 0 seconds, got {grace}")
        self.comm, self.grace = comm, float(grace)
        self.auto, self.floor, self.n_steps = timeout is None, float(floor), int(steps)
        self.timeout = float(timeout) if timeout is not None else self.floor
        self._durations: list[float] = []
        self.side = comm.Dup()
        self.threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def step_done(self, seconds: float) -> None:
        """Report a step's duration (auto timeout: ``max(floor, steps * median)``)."""
        if self.auto:
            self._durations.append(seconds)
            if len(self._durations) % 16 == 1:
                self.timeout = max(self.floor, self.n_steps * float(np.median(self._durations)))

    def start(self) -> Watchdog:
        if self._thread is None:
            MARK.since = time.monotonic()
            self._thread = threading.Thread(target=self._run, name="mpidp-watchdog", daemon=True)
            self._thread.start()
            atexit.register(self.stop)  # before MPI finalizes: no receive left posted
        return self

    def stop(self) -> None:
        """Stop watching (not collective; late roll calls to this rank go unanswered)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def close(self) -> None:
        """Stop watching and free the duplicated communicator. Collective."""
        self.stop()
        if self.side != MPI.COMM_NULL:
            self.side.Free()

    # --- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        call = np.zeros(1, np.int64)
        listen = self.side.Irecv(call, source=MPI.ANY_SOURCE, tag=_ROLL) if self.threaded else None
        replies: list = []
        next_check = 0.0
        try:
            while not self._stop.wait(min(0.1, self.timeout / 8)):
                if listen is not None:
                    listen, replies = self._answer(listen, call, replies)
                now = time.monotonic()
                age = now - MARK.since
                limit = self.timeout * (EXCUSED_TIMEOUTS if MARK.state == EXCUSED else 1)
                if age > limit and now >= next_check:
                    if not self.threaded:
                        self._abort(f"rank {self.comm.rank} stalled for {age:.1f}s "
                                    f"({self._describe(self._mine())}); ranks not named "
                                    "(MPI lacks MPI_THREAD_MULTIPLE)")
                    listen, replies = self._roll_call(listen, call, replies)
                    next_check = time.monotonic() + self.timeout
        finally:
            if listen is not None:
                listen.Cancel()
                listen.Wait()

    def _mine(self) -> np.ndarray:
        m = MARK
        return np.array([m.state, m.call, int((time.monotonic() - m.since) * 1000), m.step,
                         m.spanned], np.int64)

    def _answer(self, listen, call, replies):
        status = MPI.Status()
        while listen.Test(status):
            mine = self._mine()
            replies.append((self.side.Isend(mine, dest=status.Get_source(), tag=_REPLY), mine))
            listen = self.side.Irecv(call, source=MPI.ANY_SOURCE, tag=_ROLL)
        return listen, [(r, b) for r, b in replies if not r.Test()]

    def _roll_call(self, listen, call, replies):
        """Ask every other rank for its mark and judge the answers; returns the listening
        request and the replies in flight. A :meth:`stop` meanwhile ends it without a verdict."""
        comm, me = self.side, self.side.rank
        others = [r for r in range(comm.size) if r != me]
        ping = np.array([me], np.int64)
        sent = [comm.Isend(ping, dest=r, tag=_ROLL) for r in others]
        got = {r: np.full(5, -1, np.int64) for r in others}
        pending = {r: comm.Irecv(got[r], source=r, tag=_REPLY) for r in others}
        deadline = time.monotonic() + self.grace  # all answered: the loop ends at once
        while pending and time.monotonic() < deadline and not self._stop.is_set():
            listen, replies = self._answer(listen, call, replies)
            pending = {r: q for r, q in pending.items() if not q.Test()}
            time.sleep(0.002)
        if not self._stop.is_set():
            marks = {r: got[r] for r in others if r not in pending}
            marks[me] = self._mine()
            self._judge(sorted(pending), marks)
        # the answers not in: withdraw their receives and complete them (cancelled, or
        # matched by a late answer), so no request outlives the roll call; the pings are
        # tested with the replies in flight until they complete (a rank that never reads
        # its ping is named above, and the job ends)
        late = list(pending.values())
        for q in late:
            q.Cancel()
        MPI.Request.Waitall(late)
        replies += [(q, ping) for q in sent if not q.Test()]
        return listen, replies

    def _describe(self, mark: np.ndarray) -> str:
        state, call, ms, step, _ = (int(v) for v in mark)
        where = f" in {CALLS[call]}" if state == IN_MPI and 0 <= call < len(CALLS) else ""
        if state in (EXCUSED, USER_CODE):
            where = f" ({MARK.excuse or 'excused'})"
        at = f" at step {step}" if step >= 0 else ""
        return f"{STATE_NAMES[state]}{where} for {ms / 1000:.1f}s{at}"

    def _judge(self, silent: list[int], marks: dict[int, np.ndarray]) -> None:
        t_ms = self.timeout * 1000
        stuck = [r for r, m in marks.items()
                 if (m[0] in (COMPUTING, USER_CODE) and m[2] > t_ms)
                 or (m[0] == EXCUSED and m[2] > EXCUSED_TIMEOUTS * t_ms)]
        table = "; ".join(f"rank {r}: {self._describe(m)}" for r, m in sorted(marks.items()))
        if silent or stuck:
            named = sorted(set(silent) | set(stuck))
            why = [f"{silent} did not answer within {self.grace:g}s (stopped, killed, already "
                   "finished, or stuck outside Python)"] if silent else []
            why += [f"{stuck} made no progress for over {self.timeout:.1f}s"] if stuck else []
            self._abort(f"stalled rank(s) {named}: " + " and ".join(why) + f". {table}")
        if all(m[0] == IN_MPI and m[2] > t_ms * (EXCUSED_TIMEOUTS if m[4] else 1)
               for m in marks.values()):
            self._abort(f"every rank has waited in MPI for over {self.timeout:.1f}s "
                        f"(mismatched collectives?): {table}")

    def _abort(self, message: str) -> None:
        sys.stderr.write(f"[mpidp] watchdog (rank {self.comm.rank}/{self.comm.size}, timeout "
                         f"{self.timeout:.1f}s): {message}. Aborting the job.\n")
        abort_job(EXIT_CODE)

