"""Many training runs in one job: the ranks cut into groups of ``ranks_per_trial``, each group
taking the next trial from a shared counter until none is left (:func:`sweep`)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from .. import comm as C
from ..errors import MpidpError, setting
from ..run.signals import Preempted, deferred_stops


class Stopped(Preempted):
    """The sweep ended on a stop signal with trials left to run (raised on every rank)."""

    def __init__(self, unfinished: int) -> None:
        MpidpError.__init__(self, f"sweep stopped by a signal with {unfinished} trial"
                            f"{'s' if unfinished > 1 else ''} unfinished: continue it with "
                            f"{setting('resume')}")


def groups(size: int, ranks_per_trial: int) -> tuple[int, int]:
    """``(groups, spare ranks)`` of a job of ``size`` ranks; MpidpError when no group fits."""
    if not isinstance(ranks_per_trial, int) or ranks_per_trial < 1:
        raise MpidpError(f"{setting('ranks_per_trial')} must be a whole number >= 1, got "
                         f"{ranks_per_trial!r}")
    if ranks_per_trial > size:
        raise MpidpError(f"{setting('ranks_per_trial', ranks_per_trial)} is more than the "
                         f"job's {size} rank{'s' if size > 1 else ''}")
    return size // ranks_per_trial, size % ranks_per_trial


def sweep(comm: C.Comm, trials: Sequence, *, ranks_per_trial: int = 1,
          train: Callable[[C.Comm, Any, int], Any], skip: Iterable[int] = (),
          failures: tuple[type[BaseException], ...] = (MpidpError,),
          on_result: Callable[[dict], None] | None = None) -> list[dict] | None:
    """Run ``train(group, trials[i], i)`` once for every trial ``i`` not in ``skip``, on groups of
    ``ranks_per_trial`` consecutive ranks of ``comm``. Collective. Each finished trial gives, on
    its group's rank 0, a record ``{"index", "status": "ok" or "failed", "result"`` (``train``'s)
    ``or "error"`` (a ``failures`` exception's), ``"seconds", "ranks"}``, handed to ``on_result``
    there at once. Returns every record, in trial order, on rank 0 of ``comm`` (None elsewhere).
    A stop signal leaves the rest unfinished: every rank then raises :class:`Stopped`."""
    trials, skip = list(trials), set(skip)
    groups(comm.size, ranks_per_trial)
    todo = [i for i in range(len(trials)) if i not in skip]
    counter = C.SharedCounter(comm)
    done, stopped = [], False  # this group's records; whether a stop signal ended it
    with deferred_stops() as noted, C.split_groups(comm, ranks_per_trial) as group:
        first = comm.rank - (group.rank if group is not None else 0)
        while group is not None:
            k = C.bcast_obj(group, (-1 if noted else counter.next()) if group.rank == 0 else None)
            stopped = k < 0
            if stopped or k >= len(todo):
                break
            i, t0 = todo[k], time.perf_counter()
            try:
                record = {"status": "ok", "result": train(group, trials[i], i)}
            except Preempted:
                stopped = True
                break
            except failures as exc:
                record = {"status": "failed", "error": str(exc)}
            record.update(index=i, seconds=time.perf_counter() - t0,
                          ranks=[first, first + group.size - 1])
            if group.rank == 0:
                done.append(record)
                if on_result is not None:
                    on_result(record)
        C.idle_barrier(comm)  # the groups done first wait without spinning
    counter.free(comm)
    gathered = C.gather_obj(comm, (done, stopped))
    records = None if gathered is None else sorted(
        (r for part, _ in gathered for r in part), key=lambda r: r["index"])
    unfinished = C.bcast_obj(comm, gathered and any(s for _, s in gathered) and
                             len(todo) - len(records))
    if unfinished:
        raise Stopped(unfinished)
    return records
