"""What a ``mpidp train`` run shows while it runs and leaves behind: log lines (rank 0,
quiet or verbose), ``OUT/history.jsonl`` (one line per epoch, and every ``log_every``
steps), TensorBoard scalars, and the per-rank timeline (``trace``)."""

from __future__ import annotations

import logging
import os
import platform
import sys
import time
from dataclasses import dataclass

import numpy as np

from .. import comm as C
from ..atomic import check_file, check_folder
from ..errors import setting
from .history import History, need_tensorboard
from .trace import Tracer, parse_window
from .trace import write as write_trace

log = logging.getLogger("mpidp")


@dataclass(frozen=True)
class Outputs:
    """Where a run's live outputs go: ``out`` (the folder of ``history.jsonl``), a history
    line every ``log_every`` steps (None: per epoch only), TensorBoard event files in
    ``tensorboard``, a timeline in ``trace`` of the global steps ``trace_steps`` (``"A:B"``)."""

    out: str
    log_every: int | None = None
    tensorboard: str | None = None
    trace: str | None = None
    trace_steps: str | None = None


def setup_logging(quiet: bool = False, verbose: bool = False) -> None:
    """Messages to stdout, plain; ``quiet`` keeps warnings and errors, ``verbose`` adds details."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.propagate = False
    log.setLevel(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)


def say(comm: C.Comm, *lines: str) -> None:
    """Log ``lines`` once, from rank 0."""
    if comm.rank == 0:
        log.info("\n".join(lines))


class Watch:
    """The run's live outputs. Collective to create (every rank of ``comm``)."""

    def __init__(self, comm: C.Comm, outputs: Outputs, timer, config: dict) -> None:
        self.comm, self.outputs, self.timer, self.config = comm, outputs, timer, config
        self.t0, self._history = time.perf_counter(), None
        self.tracer = None
        if outputs.trace:
            self.tracer = Tracer(comm.rank, platform.node(),
                                 steps=parse_window(outputs.trace_steps))
            timer.tracer = self.tracer
        self._last = np.zeros(2)  # compute, comm seconds at the last step line
        self.epoch_index = 0  # the epoch in progress (0-based; a resumed run sets it)
        self.written = 0  # epoch lines in the history file (rank 0)
        self._resumed: list[dict] = []  # a checkpoint's epochs, not written yet

    @staticmethod
    def check(outputs: Outputs) -> None:
        """Up front, on one rank: the outputs asked for can be written."""
        if outputs.trace:
            check_file(outputs.trace, setting("trace"), "trace.json")
            parse_window(outputs.trace_steps)
        if outputs.tensorboard:
            check_folder(outputs.tensorboard, setting("tensorboard"))
            try:
                import tensorboardX  # noqa: F401
            except ImportError:
                raise need_tensorboard() from None

    def check_steps(self, total: int) -> None:
        """Raise :class:`~mpidp.comm.MpidpError` (on every rank: the same figures everywhere)
        when the ``trace_steps`` window starts at or after ``total``, the number of global
        steps the run takes: the timeline would hold none of them."""
        window = None if self.tracer is None else self.tracer.window
        if window is not None and window[0] >= total:
            raise C.MpidpError(f"{setting('trace_steps', f'{window[0]}:{window[1]}')}: this run "
                               f"has {total} steps (0 to {total - 1}), so the timeline would "
                               f"hold none of them: give a range that starts below {total}")

    def history(self) -> History | None:
        """Rank 0's history file, opened on first use (after the run's checks passed)."""
        if self.comm.rank != 0:
            return None
        if self._history is None:  # History makes the folder
            self._history = History(os.path.join(self.outputs.out, "history.jsonl"),
                                    self.outputs.tensorboard, what="out")
            self._history.config(self.config)
        return self._history

    def epoch(self, record: dict) -> None:
        """``on_epoch`` (every rank): the epoch's line, with per-rank figures when known."""
        pending, self._resumed = self._resumed, []
        for done in pending:
            self.epoch(done)
        self.epoch_index = record["epoch"]  # 1-based epoch done = the next one's index
        h = self.history()
        if h is None:
            return
        line = {k: v for k, v in record.items() if k != "balance"}
        line["elapsed_s"] = time.perf_counter() - self.t0
        if per_rank := record.get("balance", {}).get("per_rank"):
            for key in ("compute_s", "comm_s", "wait_s", "samples"):
                line[key] = [d[key] for d in per_rank]
            line["samples_per_s"] = sum(line["samples"]) / record["seconds"]
            line["imbalance"] = record["balance"]["imbalance"]
        h.epoch(line)
        self.written += 1

    def resumed(self, history: list[dict]) -> None:
        """A resumed run's history file starts with its checkpoint's epochs, so that it holds every
        epoch of the run (new folder or not): written with the first new line or at the end."""
        self._resumed = list(history)

    def step(self, step: int, stats) -> None:
        """``on_step`` (every rank; collective every ``log_every`` global steps)."""
        every = self.outputs.log_every
        if not every or step % every:
            return
        now = np.array([self.timer.compute_s, self.timer.comm_s])
        rows = C.allgather_rows(self.comm, np.append(now - self._last, self.timer.samples))
        self._last = now
        if (h := self.history()) is not None:
            h.steps({"step": step, "epoch": self.epoch_index + 1, "loss": stats.loss,
                     "compute_s": rows[:, 0].tolist(), "comm_s": rows[:, 1].tolist(),
                     "samples_per_s": float(rows[:, 2].sum() / max(time.perf_counter() - self.t0,
                                                                   1e-9))})

    def finish(self, history: list[dict]) -> None:
        """At the end of training (every rank; collective): write the trace (a failure, or a
        ``trace_steps`` window no step fell in, is a warning), and the epoch lines not written
        yet (a mode that learns its epochs only at the end: async-ps)."""
        if self.tracer is not None:
            try:
                n = write_trace(self.comm, self.tracer, self.outputs.trace)
                say(self.comm, f"wrote timeline {self.outputs.trace} ({n} spans)")
                if (missed := self.tracer.missed()) and self.comm.rank == 0:
                    log.warning(f"mpidp: warning: {missed}")
            except OSError as exc:
                log.warning(f"mpidp: could not write the timeline {self.outputs.trace}: {exc}")
        if self.comm.rank == 0:
            self._resumed = []  # ``history`` holds them too
            for record in history[self.written:]:
                self.epoch(record)

    def close_history(self) -> None:
        """Close the history file (rank 0; also after a failure: it keeps every line)."""
        if self._history is not None:
            self._history.close()
            self._history = None
