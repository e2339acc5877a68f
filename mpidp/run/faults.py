"""Fault injection for tests and drills: ``MPIDP_FAULT=kind@rank:when[,kind@rank:when...]``
(docs/reliability.md). A fault of a kind in :data:`KINDS` fires on ``rank`` just before
global step ``when`` (0-based), or as the rank enters a phase of :data:`PHASES`: ``nan``
makes this rank's gradient contribution NaN, ``desync`` moves its first parameter by one
ulp, ``term`` sends SIGTERM as a preemption does. Unset, a step costs one dict lookup."""

from __future__ import annotations

import os
import signal
import time

KINDS = ("raise", "kill", "hang", "nan", "desync", "term")
PHASES = ("load", "evaluate", "checkpoint", "write", "recover")


class InjectedFault(RuntimeError):
    """The exception raised by the ``raise`` fault."""


def parse(spec: str | None) -> dict[tuple[int, int | str], str]:
    """``{(rank, step or phase): kind}`` from a ``MPIDP_FAULT`` value; ValueError if malformed."""
    faults = {}
    for item in filter(None, (spec or "").split(",")):
        try:
            kind, where = item.strip().split("@")
            rank, when = where.split(":")
            rank, when = int(rank), when if when in PHASES else int(when)
        except ValueError:
            raise ValueError(f"MPIDP_FAULT item {item!r} is not kind@rank:step or "
                             f"kind@rank:phase (e.g. raise@1:5, kill@0:checkpoint; kinds: "
                             f"{', '.join(KINDS)}; phases: {', '.join(PHASES)})") from None
        if kind not in KINDS:
            raise ValueError(f"MPIDP_FAULT kind {kind!r} is not one of {', '.join(KINDS)}")
        if rank < 0 or isinstance(when, int) and when < 0:
            raise ValueError(f"MPIDP_FAULT item {item!r}: rank and step must be >= 0")
        faults[(rank, when)] = kind
    return faults


class Injector:
    """The faults planned for this rank. ``apply(step, trainer)`` acts on ``trainer``'s
    ``poison_()`` (``nan``) and ``nudge_()`` (``desync``)."""

    def __init__(self, rank: int) -> None:
        planned = parse(os.environ.get("MPIDP_FAULT"))
        self.steps = {step: kind for (r, step), kind in planned.items() if r == rank}
        self.rank = rank

    def apply(self, step: int | str, trainer=None) -> None:
        kind = self.steps.get(step)
        if kind == "raise":
            where = f"step {step}" if isinstance(step, int) else step
            raise InjectedFault(f"injected fault on rank {self.rank} at {where}")
        if kind is not None:
            {"kill": lambda: os.kill(os.getpid(), signal.SIGKILL), "hang": lambda: time.sleep(3600),
             "term": lambda: os.kill(os.getpid(), signal.SIGTERM),
             "desync": lambda: trainer.nudge_(), "nan": lambda: trainer.poison_()}[kind]()
