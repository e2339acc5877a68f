"""Clean ends on signals, decided together (docs/reliability.md). ``SIGTERM`` or ``SIGUSR1``:
every rank finishes the step, agrees to stop, writes a checkpoint where they are on and
exits with :data:`PREEMPTED_EXIT` (during the data load: at once). ``SIGINT`` to one rank
ends the whole job with status 130, even inside an MPI call (a thread reads a wakeup pipe)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

from ..errors import MpidpError, setting

#: Exit status after a stop on SIGTERM/SIGUSR1 (EX_TEMPFAIL: "try again": resume the run).
PREEMPTED_EXIT = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextmanager
def deferred_stops():
    """A stop signal (SIGTERM/SIGUSR1) inside the block is noted, not obeyed: the block yields
    the list of those noted. Wraps the start of MPI (a rank killed there leaves the library's
    shared memory behind). Main thread only."""
    noted: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # no handlers there
        yield noted
        return
    old = {s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in STOP_SIGNALS}
    try:
        yield noted
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


class Preempted(MpidpError):
    """Training stopped on SIGTERM/SIGUSR1 after a checkpoint (raised on every rank)."""

    def __init__(self, step: int, checkpoint) -> None:
        where = (f"checkpoint written to {checkpoint.directory}; continue with "
                 f"{setting('resume')}" if checkpoint
                 else f"no {setting('checkpoint_dir')}, so no checkpoint was saved and the "
                      f"run cannot be resumed")
        super().__init__(f"stopped by a signal after step {step}: {where}")


class StopSignals:
    """Install the handlers (main thread only); :attr:`requested` turns True on SIGTERM/SIGUSR1
    (this rank only: trainers agree on it in their step); :meth:`close` restores the old ones."""

    def __init__(self, comm) -> None:
        self.comm, self.requested = comm, False
        self.phase: str | None = None  # a phase with nothing to save: a stop ends the job
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        # the Python-level handlers do nothing: the thread reads the signals and acts
        self._old = {s: signal.signal(s, lambda signum, frame: None)
                     for s in (*STOP_SIGNALS, signal.SIGINT)}
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="mpidp-signals", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while True:
            try:
                got = os.read(self._read, 64)
            except OSError:
                return
            if not got:
                return
            for signum in got:
                if signum == signal.SIGINT:
                    self._abort("interrupted (SIGINT); ending the job.", 130)
                elif signum in STOP_SIGNALS:
                    self.requested = True
                    if self.phase is not None:
                        self._abort(f"stopped by {signal.Signals(signum).name} while "
                                    f"{self.phase}; nothing was trained or saved, so run the "
                                    f"same command again (exit {PREEMPTED_EXIT}).",
                                    PREEMPTED_EXIT)

    def _abort(self, why: str, code: int) -> None:
        from .. import comm as C
        sys.stderr.write(f"[mpidp] rank {self.comm.rank}/{self.comm.size}: {why}\n")
        C.abort_job(code)

    @contextmanager
    def during(self, phase: str):
        """A span with nothing to checkpoint (``phase``, e.g. "loading the data"): a stop
        signal ends the job at once, with :data:`PREEMPTED_EXIT`, even while this rank is
        blocked reading a file or waiting in MPI."""
        self.phase = phase
        try:
            yield
        finally:
            self.phase = None

    def close(self) -> None:
        signal.set_wakeup_fd(self._old_fd)
        for s, old in self._old.items():
            signal.signal(s, old)
        os.close(self._write)
        os.close(self._read)
