"""Fault injection for tests and drills: ``MPIDP_FAULT=kind@rank:step[,kind@rank:step...]``.

Kinds, applied on ``rank`` just before global step ``step`` (0-based), in every mode:
``raise`` (an exception), ``kill`` (SIGKILL), ``hang`` (an hour's sleep), ``nan`` (this
rank's gradient contribution becomes NaN), ``desync`` (its first parameter moves by one
ulp). Unset, the per-step cost is one dictionary lookup."""

from __future__ import annotations

import os
import signal
import time

KINDS = ("raise", "kill", "hang", "nan", "desync")


class InjectedFault(RuntimeError):
    """The exception raised by the ``raise`` fault."""


def parse(spec: str | None) -> dict[tuple[int, int], str]:
    """``{(rank, step): kind}`` from a ``MPIDP_FAULT`` value; ValueError if malformed."""
    faults = {}
    for item in filter(None, (spec or "").split(",")):
        try:
            kind, where = item.strip().split("@")
            rank, step = (int(x) for x in where.split(":"))
        except ValueError:
            raise ValueError(f"MPIDP_FAULT item {item!r} is not kind@rank:step (e.g. "
                             f"raise@1:5; kinds: {', '.join(KINDS)})") from None
        if kind not in KINDS:
            raise ValueError(f"MPIDP_FAULT kind {kind!r} is not one of {', '.join(KINDS)}")
        if rank < 0 or step < 0:
            raise ValueError(f"MPIDP_FAULT item {item!r}: rank and step must be >= 0")
        faults[(rank, step)] = kind
    return faults


class Injector:
    """The faults planned for this rank. ``apply(step, trainer)`` acts on ``trainer``'s
    ``poison_()`` (``nan``) and ``nudge_()`` (``desync``)."""

    def __init__(self, rank: int) -> None:
        planned = parse(os.environ.get("MPIDP_FAULT"))
        self.steps = {step: kind for (r, step), kind in planned.items() if r == rank}
        self.rank = rank

    def apply(self, step: int, trainer) -> None:
        kind = self.steps.get(step)
        if kind == "raise":
            raise InjectedFault(f"injected fault on rank {self.rank} at step {step}")
        if kind is not None:
            {"kill": lambda: os.kill(os.getpid(), signal.SIGKILL), "hang": lambda: time.sleep(3600),
             "desync": trainer.nudge_, "nan": trainer.poison_}[kind]()
