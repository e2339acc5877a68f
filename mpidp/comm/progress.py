"""Communication that moves while this process computes (MPI moves a started collective only while
some thread is inside MPI): :class:`BackgroundAllreduce`, a communication thread (needs
``MPI_THREAD_MULTIPLE``), and :func:`test_some`/:class:`StartedSums`, requests advanced between pieces
of work. The watchdog watches the calling thread only: waiting for the communication thread is watched."""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np
from mpi4py import MPI

from .agreement import MpidpError
from .collectives import MAX_COUNT, allreduce_sum_
from .elastic import LOST, revoke
from .runtime import Comm, duplicate, fresh_tag, watched

_END = None  # queued by wait(): the thread ends once everything before it is summed

#: What :meth:`StartedSums.abandon` left to MPI (requests and the buffers they write):
#: kept alive, since a revoked communicator's calls need not end at once.
_ABANDONED: list = []


def threads_supported() -> bool:
    """True if MPI runs with ``MPI_THREAD_MULTIPLE`` (:class:`BackgroundAllreduce` needs it)."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def test_some(requests: list[MPI.Request]) -> int:
    """Advance ``requests`` (``MPI_Testsome``, never blocks; completed ones become
    ``MPI_REQUEST_NULL``); returns how many are complete now."""
    if requests:
        MPI.Request.Testsome(requests)
    return sum(r == MPI.REQUEST_NULL for r in requests)


def wait_yielding(request: MPI.Request, longest_sleep: float) -> None:
    """Complete ``request``, sleeping between tests (10 us doubling up to ``longest_sleep``)
    to leave the core to working ranks (``longest_sleep <= 0``: a plain ``Wait``)."""
    if longest_sleep <= 0:
        request.Wait()
        return
    pause = 1e-5
    while not request.Test():
        time.sleep(pause)
        pause = min(2 * pause, longest_sleep)


#: The communication thread's sum: :func:`allreduce_sum_` unwatched (see the module).
_sum_in_place = allreduce_sum_.__wrapped__


class BackgroundAllreduce:
    """In-place sums over the ranks of ``comm`` by a communication thread, one blocking ``Allreduce``
    per buffer in order, on a duplicate of ``comm`` (collective to create and to :meth:`close`). Every
    rank :meth:`submit`-s the same buffer sizes; a buffer is the thread's until :meth:`wait`, which
    raises its failure as :class:`MpidpError`. ``pending``/``completed``: buffers unsummed/summed so far."""

    def __init__(self, comm: Comm, name: str = "mpidp-allreduce") -> None:
        if not threads_supported():
            raise MpidpError("a communication thread needs MPI_THREAD_MULTIPLE, but MPI runs "
                             "with a lower thread level; use the single-thread progress "
                             "(progress='test')")
        self._comm, self.name = comm.Dup(), name
        self._cv = threading.Condition()
        self._queue: deque[np.ndarray | None] = deque()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.pending, self.completed = 0, 0

    @property
    def running(self) -> bool:
        """True while the communication thread exists (between a submit and its wait)."""
        return self._thread is not None

    def submit(self, buf: np.ndarray) -> None:
        """Queue the in-place sum of contiguous ``buf``; returns at once (starts the thread if none runs)."""
        if self._comm is None:
            raise MpidpError(f"{self.name} is closed: make a new one to reduce again")
        with self._cv:
            self._raise_failure()
            self._queue.append(buf)
            self.pending += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
            self._cv.notify()

    @watched("an Allreduce (on the communication thread)")
    def wait(self) -> None:
        """Block until every submitted buffer is summed, then end the thread; raises its failure."""
        with self._cv:
            thread = self._thread
            if thread is not None:
                self._queue.append(_END)
                self._cv.notify()
        while thread is not None and thread.is_alive():
            thread.join(0.5)  # sleeps; wakes to let signal handlers run
        with self._cv:
            self._raise_failure()

    def close(self) -> None:
        """Complete what is pending and free the duplicate communicator. Collective."""
        if self._comm is not None:
            try:
                self.wait()
            finally:
                self._comm.Free()
                self._comm = None

    def abandon(self) -> None:
        """After a lost rank: revoke the duplicate (a sum there fails on every rank, not waiting for
        the dead) and let the thread end, not waiting for its queued sums; closed then. Local."""
        if self._comm is None:
            return
        revoke(self._comm)
        with self._cv:
            self._queue.clear()
            self._queue.append(_END)  # a thread waiting for work ends
            self._cv.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(1.0)  # a sum on the revoked duplicate fails at once
        self._comm = None

    def __enter__(self) -> BackgroundAllreduce:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise MpidpError(f"the communication thread {self.name!r} failed: "
                             f"{type(self._error).__name__}: {self._error}; this step's "
                             "sums are incomplete") from self._error

    def _work(self) -> None:
        """The thread: sum the queued buffers in order until an end mark finds the queue empty."""
        comm, cv = self._comm, self._cv
        while True:
            with cv:
                while not self._queue:
                    cv.wait()
                buf = self._queue.popleft()
                if buf is _END:
                    if self._queue:  # buffers submitted after an interrupted wait: go on
                        continue
                    self._thread = None
                    return
            try:
                _sum_in_place(comm, buf)
            except BaseException as exc:  # handed to the calling thread, which raises it
                with cv:
                    self._error, self._thread = exc, None
                    self._queue.clear()
                    cv.notify_all()
                return
            with cv:
                self.pending -= 1
                self.completed += 1
                cv.notify_all()


def _own_error(call, requests: list[MPI.Request]):
    """``call(requests, statuses)`` (``Waitall``, ``Testsome``), a failed request's error
    raised as its own (the most telling: a lost rank's) instead of ``MPI_ERR_IN_STATUS``."""
    statuses = [MPI.Status() for _ in requests]
    try:
        return call(requests, statuses)
    except MPI.Exception as exc:
        codes = [s.Get_error() for s in statuses] if (
            exc.Get_error_class() == MPI.ERR_IN_STATUS) else ()
        codes = sorted((c for c in codes if c not in (MPI.SUCCESS, MPI.ERR_PENDING)),
                       key=lambda c: MPI.Get_error_class(c) not in LOST)
        if not codes:
            raise
        raise MPI.Exception(codes[0]) from exc


#: Tags of :class:`StartedSums`'s exchanges, taken in turn on a communicator
#: (:func:`~mpidp.comm.runtime.fresh_tag`) so that several never match each other's messages.
PAIR_TAGS = (0x4000, 0x3000)


class StartedSums:
    """In-place sums over ``comm`` of parts of one buffer, started one at a time, completed in
    any order, moved by :meth:`advance`: an ``Iallreduce`` each, or at two ranks one exchange
    (one round; rank 0's part added first). Every rank starts the same parts in order; only
    they may use :data:`PAIR_TAGS` on ``comm`` (or ``private=True``: a duplicate of their own)."""

    def __init__(self, comm: Comm, buf: np.ndarray, private: bool = False) -> None:
        if buf.ndim != 1 or not buf.flags.c_contiguous or not buf.flags.writeable:
            raise MpidpError(f"started sums need a writable contiguous 1-D buffer, got shape "
                             f"{buf.shape} (contiguous: {buf.flags.c_contiguous}, writable: "
                             f"{buf.flags.writeable})")
        self.private = bool(private)  # sums on a duplicate of comm, freed by close()
        self.comm, self.buf = (duplicate(comm) if private else comm), buf
        self.pairwise = comm.size == 2
        self.peer = 1 - comm.rank if self.pairwise else None
        self.tag = fresh_tag(self.comm, *PAIR_TAGS) if self.pairwise else None
        self.scratch: np.ndarray | None = None
        self.live = 0  # sums started and not yet complete
        self.requests: list[MPI.Request] = []  # every started request, in order
        self._owner: list[int] = []  # per request: the index of its sum
        self._spans: list[tuple[int, int, bool]] = []  # per sum: its part, and if an exchange
        self._left: list[int] = []  # per sum: requests not yet complete

    def start(self, lo: int, hi: int) -> int:
        """Start summing ``buf[lo:hi]``; returns the sum's index (0, 1, ... since :meth:`clear`)."""
        if not 0 <= lo <= hi <= self.buf.size:
            raise MpidpError(f"started sums: part [{lo}, {hi}) is not within the buffer's "
                             f"{self.buf.size} values")
        i, part = len(self._spans), self.buf[lo:hi]
        paired = self.pairwise and hi - lo <= MAX_COUNT
        if paired:
            if self.scratch is None:
                self.scratch = np.empty_like(self.buf)
            reqs = [self.comm.Irecv(self.scratch[lo:hi], source=self.peer, tag=self.tag),
                    self.comm.Isend(part, dest=self.peer, tag=self.tag)]
        else:
            reqs = [self.comm.Iallreduce(MPI.IN_PLACE, part, op=MPI.SUM)]
        self._spans.append((lo, hi, paired))
        self._left.append(len(reqs))
        self.requests += reqs
        self._owner += [i] * len(reqs)
        self.live += 1
        self.advance()
        return i

    def advance(self) -> None:
        """Let the started sums move (``MPI_Testsome``, never blocks); finish those complete."""
        if self.live:
            for k in _own_error(MPI.Request.Testsome, self.requests) or ():
                self._finish(self._owner[k])

    def done(self, i: int) -> bool:
        """True once sum ``i`` is complete (as of the last :meth:`advance` or wait)."""
        return self._left[i] == 0

    @watched("a Waitany (started sums)")
    def wait_any(self) -> None:
        """Block until one more request is complete, then :meth:`advance`; :class:`MpidpError`
        if no sum is in flight."""
        k = MPI.Request.Waitany(self.requests) if self.live else MPI.UNDEFINED
        if k == MPI.UNDEFINED:
            raise MpidpError("no started sum is in flight to wait for")
        self._finish(self._owner[k])
        self.advance()

    @watched("a Waitall (started sums)")
    def wait_all(self) -> None:
        """Complete every started sum."""
        if self.live:
            _own_error(MPI.Request.Waitall, self.requests)
            for i, n in enumerate(self._left):
                if n:
                    self._finish(i, n)

    def clear(self) -> None:
        """Forget the sums (all complete): the next :meth:`start` is sum 0."""
        if self.live:
            raise MpidpError(f"{self.live} started sum(s) still in flight")
        self.requests, self._owner, self._spans, self._left = [], [], [], []

    def release(self) -> None:
        """Forget the sums (all complete) and free the scratch."""
        self.clear()
        self.scratch = None

    def abandon(self) -> None:
        """After a lost rank: revoke the communicator (a sum there fails on every rank instead
        of waiting for the dead) and forget the sums in flight, not waiting for them. Local."""
        revoke(self.comm)
        if self.live:
            _ABANDONED.append((self.requests, self.buf, self.scratch))
        self.live = 0
        self.release()

    def close(self) -> None:
        """:meth:`release`, and free the private duplicate, if any (collective then)."""
        self.release()
        if self.private and self.comm != MPI.COMM_NULL:
            self.comm.Free()

    def _finish(self, i: int, requests: int = 1) -> None:
        """``requests`` more of sum ``i``'s are complete; when all are, an exchange adds the
        other rank's part to this one's."""
        self._left[i] -= requests
        if self._left[i]:
            return
        self.live -= 1
        lo, hi, paired = self._spans[i]
        if paired:
            own, other = self.buf[lo:hi], self.scratch[lo:hi]
            # rank 0's part first on both ranks: the same bits, NaN payloads included
            np.add(*((own, other) if self.comm.rank == 0 else (other, own)), out=own)
