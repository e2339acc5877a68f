"""Per-rank timers and their summary on root. Timers are local (no collective per step);
they are gathered once, at the end, with one small ``Gather``."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from . import comm as C

FIELDS = ("compute_s", "comm_s", "steps", "samples")


@dataclass
class StepTimer:
    """Accumulates seconds spent computing and communicating, steps and samples done here."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    steps: int = 0
    samples: int = 0
    _t: float = field(default=0.0, repr=False)

    @contextmanager
    def compute(self):
        t = time.perf_counter()
        yield
        self.compute_s += time.perf_counter() - t

    @contextmanager
    def communicate(self):
        t = time.perf_counter()
        yield
        self.comm_s += time.perf_counter() - t

    def as_row(self) -> np.ndarray:
        return np.array([getattr(self, f) for f in FIELDS], np.float64)


def gather_timings(comm: C.Comm, timer: StepTimer, root: int = 0) -> list[dict] | None:
    """Every rank's timer as a list of dicts (index = rank) on ``root``; None elsewhere.

    Collective (one ``Gather``). ``comm_fraction`` is comm / (compute + comm) per rank.
    """
    rows = C.gather_rows(comm, timer.as_row(), root)
    if rows is None:
        return None
    out = []
    for rank, row in enumerate(rows):
        d = {"rank": rank, **{f: float(v) for f, v in zip(FIELDS, row)}}
        d["steps"], d["samples"] = int(d["steps"]), int(d["samples"])
        busy = d["compute_s"] + d["comm_s"]
        d["comm_fraction"] = d["comm_s"] / busy if busy else 0.0
        out.append(d)
    return out


def format_timings(rows: list[dict]) -> str:
    """A short per-rank table: samples, compute and communication seconds and share."""
    lines = ["rank  samples  compute_s  comm_s  comm_share"]
    for d in rows:
        lines.append(f"{d['rank']:>4}  {d['samples']:>7}  {d['compute_s']:>9.3f}  "
                     f"{d['comm_s']:>6.3f}  {d['comm_fraction']:>9.1%}")
    return "\n".join(lines)
