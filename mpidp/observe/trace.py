"""A timeline per rank, for Perfetto / ``chrome://tracing``: what each rank did, when.

Each rank records spans locally (:class:`Tracer`); :func:`write` gathers them once, at the
end, on rank 0's clock, into a Chrome trace-event file: a process per rank, a thread per
track, flow arrows between spans sharing a ``flow`` key. Importing this does not start MPI."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..atomic import write_atomic, write_error
from ..errors import setting

#: Tracks with fixed thread ids (in this order); other tracks follow, in order of first use.
TRACKS = ("compute", "comm", "wait", "eval", "io")
#: Tag of the clock-alignment messages (outside the range the trainers use).
CLOCK_TAG = 7919


class Tracer:
    """This rank's spans, kept in memory (~200 bytes each) until :func:`write`; ``steps=(a,
    b)``: only while ``a <= tracer.step < b``. The loop sets ``step`` and ``epoch``."""

    def __init__(self, rank: int, host: str, steps: tuple[int, int] | None = None) -> None:
        if steps is not None and not (0 <= steps[0] < steps[1]):
            raise ValueError(f"trace step window {steps[0]}:{steps[1]} is empty; give A:B "
                             "with 0 <= A < B")
        self.rank, self.host = rank, host
        self.window = None if steps is None else (int(steps[0]), int(steps[1]))
        self.epoch, self.events, self._step = 0, [], -1
        self.first_step: int | None = None  # the run's first and last global steps seen
        self.last_step: int | None = None
        self.on = self.window is None

    @property
    def step(self) -> int:
        """The current global step; spans outside the window are dropped."""
        return self._step

    @step.setter
    def step(self, k: int) -> None:
        self._step = k
        if k >= 0:
            self.first_step = k if self.first_step is None else self.first_step
            self.last_step = k
        self.on = self.window is None or self.window[0] <= k < self.window[1]

    def missed(self) -> str | None:
        """What to warn of when the step window holds none of the steps seen (a resumed
        run past it, early stopping before it); None when it holds some, or has none."""
        if self.window is None:
            return None
        a, b = self.window
        window = setting("trace_steps", f"{a}:{b}")
        if self.first_step is None:
            return f"{window}: the run took no step, so the timeline holds none"
        if self.last_step < a or self.first_step >= b:
            return (f"{window} recorded no step: this run's steps were "
                    f"{self.first_step} to {self.last_step}; give a range within them")
        return None

    @contextmanager
    def span(self, name: str, cat: str, track: str = "compute", flow: Any = None, **args):
        """Context manager recording the ``with`` body (also one that raises) as one span on
        ``track``. ``flow``: a key (hashable, picklable) shared with a span on another rank, to draw
        an arrow between them; ``args``: small JSON-able values shown with it (bytes, samples, ...)."""
        on, t0 = self.on, time.perf_counter()
        try:
            yield
        finally:
            if on:  # in the step window at both ends
                self.add(name, cat, track, t0, time.perf_counter(), flow=flow, **args)

    def add(self, name: str, cat: str, track: str, t0: float, t1: float, flow: Any = None,
            **args) -> None:
        """Record a span from ``t0`` to ``t1`` (:func:`time.perf_counter` seconds)."""
        if self.on:
            self.events.append((name, cat, track, t0, t1, self._step, self.epoch, flow,
                                args or None))


def clock_offsets(comm, rounds: int = 8) -> tuple[float, float]:
    """``(offset, uncertainty)`` in seconds of this rank's :func:`time.perf_counter` relative
    to rank 0's: rank-0 time = local time - offset. Collective. From ``rounds`` round trips
    with rank 0, the shortest: the answer's time is taken to be halfway, within half the trip."""
    from .. import comm as C
    buf, res = np.zeros(1, np.float64), np.zeros((comm.size, 2))
    if comm.rank == 0:
        for r in range(1, comm.size):
            trips = []
            for _ in range(rounds):
                s = time.perf_counter()
                C.send(comm, buf, r, CLOCK_TAG)
                C.recv_(comm, buf, r, CLOCK_TAG)
                e = time.perf_counter()
                trips.append((e - s, float(buf[0]) - (s + e) / 2))
            rtt, off = min(trips)
            res[r] = off, rtt / 2
    else:
        for _ in range(rounds):
            C.recv_(comm, buf, 0, CLOCK_TAG)
            buf[0] = time.perf_counter()
            C.send(comm, buf, 0, CLOCK_TAG)
    C.bcast_(comm, res, root=0)
    return float(res[comm.rank, 0]), float(res[comm.rank, 1])


def write(comm, tracer: Tracer, path: str) -> int | None:
    """Align clocks, gather every rank's spans and write ``path`` on rank 0, atomically, with
    each rank's clock offset and uncertainty. Collective. Returns the number of spans written
    on rank 0, None elsewhere."""
    from .. import comm as C
    offset, err = clock_offsets(comm)
    parts = C.gather_obj(comm, {"rank": comm.rank, "host": tracer.host, "offset": offset,
                                "uncertainty": err, "events": tracer.events})
    if parts is None:
        return None
    trace = build(parts, tracer.window)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        write_atomic(path, lambda f: f.write(json.dumps(trace, separators=(",", ":")).encode()))
    except OSError as exc:  # the folder's failure or the write's, named alike
        raise write_error(exc, path, setting("trace")) from None
    return sum(len(p["events"]) for p in parts)


def _metadata(parts: Sequence[dict], tids: dict[str, int]) -> list[dict]:
    def meta(what: str, pid: int, tid: int, name: str, index: int) -> list[dict]:
        return [{"ph": "M", "name": f"{what}_name", "pid": pid, "tid": tid,
                 "args": {"name": name}},
                {"ph": "M", "name": f"{what}_sort_index", "pid": pid, "tid": tid,
                 "args": {"sort_index": index}}]

    out = []
    for p in parts:
        pid = p["rank"]
        out += meta("process", pid, 0, f"rank {pid} ({p['host']})", pid)
        for track in sorted({ev[2] for ev in p["events"]}, key=tids.get):
            out += meta("thread", pid, tids[track], track, tids[track])
    return out


def build(parts: Sequence[dict], window: tuple[int, int] | None = None) -> dict:
    """The trace-event document from every rank's ``{"rank", "host", "offset",
    "uncertainty", "events"}`` (pure; :func:`write` gathers ``parts``). Times become
    microseconds on rank 0's clock, from the earliest span of any rank."""
    tids = {t: i + 1 for i, t in enumerate(TRACKS)}  # thread ids: then the others by first use
    for p in parts:
        for ev in p["events"]:
            tids.setdefault(ev[2], len(tids) + 1)
    origin = min((ev[3] - p["offset"] for p in parts for ev in p["events"]), default=0.0)
    events, flows = _metadata(parts, tids), {}
    for p in parts:
        for name, cat, track, t0, t1, step, epoch, flow, args in p["events"]:
            ev = {"name": name, "cat": cat, "ph": "X", "pid": p["rank"], "tid": tids[track],
                  "ts": round((t0 - p["offset"] - origin) * 1e6, 3),
                  "dur": round(max(t1 - t0, 0.0) * 1e6, 3),
                  "args": {"epoch": epoch, "step": step, **(args or {})}}
            events.append(ev)
            if flow is not None:
                flows.setdefault(repr(flow), []).append(ev)
    for fid, evs in enumerate(flows.values(), 1):  # an arrow from each span to the next of the key
        evs.sort(key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:]):
            common = {"name": a["name"], "cat": "flow", "id": fid}
            events.append({**common, "ph": "s", "pid": a["pid"], "tid": a["tid"], "ts": _mid(a)})
            events.append({**common, "ph": "f", "bp": "e", "pid": b["pid"], "tid": b["tid"],
                           "ts": _mid(b)})
    sync = {"method": "ping-pong with rank 0, shortest of 8 round trips",
            "offsets_us": [p["offset"] * 1e6 for p in parts],
            "uncertainty_us": [p["uncertainty"] * 1e6 for p in parts]}
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"clock_sync": sync, "steps": list(window) if window else None,
                          "ranks": len(parts)}}


def _mid(ev: dict) -> float:
    """The middle of span ``ev`` (a flow arrow's end binds to the span around it)."""
    return round(ev["ts"] + ev["dur"] / 2, 3)


def parse_window(text: str | None) -> tuple[int, int] | None:
    """``"A:B"`` -> ``(A, B)`` (global steps A to B-1); None or "" -> None. Raises
    ValueError with the fix for anything else."""
    if not text:
        return None
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{setting('trace_steps')} {text!r}: give A:B, two step numbers "
                         "(e.g. 100:110 records steps 100 to 109)") from None
    if not 0 <= a < b:
        raise ValueError(f"{setting('trace_steps')} {text!r}: give A:B with 0 <= A < B "
                         f"(e.g. 100:110)")
    return a, b
