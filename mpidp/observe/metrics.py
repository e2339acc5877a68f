"""Per-rank timers and their summary on root. Timers are local (no collective per step);
they are gathered once, at the end, with one small ``Gather``."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import comm as C

FIELDS = ("compute_s", "comm_s", "steps", "samples")
#: Columns of the per-step rows of :class:`StepTimer`, and their numbers.
STEP_FIELDS = ("t_begin", "compute_s", "compute_cpu_s", "comm_s", "update_s", "samples", "cost")
_T_BEGIN, _COMPUTE, _CPU, _COMM, _UPDATE, _SAMPLES, _COST = range(len(STEP_FIELDS))


@dataclass
class StepTimer:
    """Seconds spent computing and communicating, steps and samples done here, and one row
    per step (:data:`STEP_FIELDS`), kept local until :meth:`take_records`. ``slowdown`` > 1
    simulates a slower node by sleeping ``(slowdown - 1) x`` the local forward/backward.
    ``tracer`` (:class:`mpidp.observe.trace.Tracer`) gets every span on the ``compute`` and
    ``comm`` tracks."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    steps: int = 0
    samples: int = 0
    slowdown: float = 1.0
    tracer: Any = None
    _cur: np.ndarray = field(default_factory=lambda: np.zeros(len(STEP_FIELDS)), repr=False)
    _rows: list = field(default_factory=list, repr=False)

    @contextmanager
    def compute(self, name: str = "compute", local: bool | None = None, **args):
        """Time a piece of computation: per-sample work (``local``, stretched by ``slowdown``)
        or the replicated update; ``local`` None: per-sample work until the step communicates."""
        t, c = time.perf_counter(), time.process_time()
        if self._cur[_T_BEGIN] == 0.0:
            self._cur[_T_BEGIN] = t
        yield
        dt = time.perf_counter() - t
        cpu = time.process_time() - c  # the work's, not other threads' during the sleep below
        if local is None:
            local = self._cur[_COMM] == 0.0
        if local and self.slowdown > 1.0:
            time.sleep((self.slowdown - 1.0) * dt)
            dt = time.perf_counter() - t
        self.compute_s += dt
        if local:
            self._cur[_COMPUTE] += dt
            self._cur[_CPU] += cpu
        else:
            self._cur[_UPDATE] += dt
        if self.tracer is not None:
            self.tracer.add(name if local or name != "compute" else "update", "compute", "compute",
                            t, t + dt, **args)

    @contextmanager
    def communicate(self, name: str = "communicate", **args):
        """Time an exchange, also one that raises (``auto`` then exchanges another way:
        the step paid for both)."""
        t = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t
            self.comm_s += dt
            self._cur[_COMM] += max(dt, 1e-12)
            if self.tracer is not None:
                self.tracer.add(name, "communication", "comm", t, t + dt, **args)

    def note_cost(self, cost: float) -> None:
        """Record the cost of the samples of the step about to run (default: its samples)."""
        self._cur[_COST] = cost if cost > 0 else -1.0

    def end_step(self, n_samples: int) -> None:
        """Close the current step's row."""
        self.steps += 1
        self.samples += n_samples
        row = self._cur.copy()
        row[_SAMPLES] = n_samples
        row[_COST] = n_samples if row[_COST] == 0.0 else max(row[_COST], 0.0)
        self._rows.append(row)
        self._cur[:] = 0.0

    def recent(self, k: int) -> np.ndarray:
        """The last ``k`` rows not yet taken, float64 ``(<= k, len(STEP_FIELDS))``."""
        return np.array(self._rows[-k:], np.float64).reshape(-1, len(STEP_FIELDS))

    def take_records(self) -> np.ndarray:
        """The rows recorded since the last call, float64 ``(steps, len(STEP_FIELDS))``."""
        rows = np.array(self._rows, np.float64).reshape(-1, len(STEP_FIELDS))
        self._rows.clear()
        return rows

    def as_row(self) -> np.ndarray:
        return np.array([getattr(self, f) for f in FIELDS], np.float64)


def gather_timings(comm: C.Comm, timer: StepTimer, root: int = 0) -> list[dict] | None:
    """Every rank's timer as a list of dicts (index = rank, with ``comm_fraction``: comm over
    compute + comm) on ``root``; None elsewhere. Collective (one ``Gather``)."""
    rows = C.gather_rows(comm, timer.as_row(), root)
    if rows is None:
        return None
    return [{"rank": rank, "compute_s": float(c), "comm_s": float(m), "steps": int(s),
             "samples": int(n), "comm_fraction": float(m / (c + m)) if c + m else 0.0}
            for rank, (c, m, s, n) in enumerate(rows)]


def format_timings(rows: list[dict], wait: list[float] | None = None) -> str:
    """The per-rank table of a whole run: samples, compute and communication seconds (and ``wait``,
    the part of communication spent waiting for slower ranks, when measured), communication share."""
    lines = ["rank  samples  compute_s  comm_s" + ("  wait_s" if wait else "") + "  comm_share"]
    for d in rows:
        w = f"  {wait[d['rank']]:>6.3f}" if wait else ""
        lines.append(f"{d['rank']:>4}  {d['samples']:>7}  {d['compute_s']:>9.3f}  "
                     f"{d['comm_s']:>6.3f}{w}  {d['comm_fraction']:>10.1%}")
    return "\n".join(lines)
