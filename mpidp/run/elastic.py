"""An elastic run: the epoch loop goes on over the survivors when ranks die.

Before each step every rank keeps a mark (the trainer's :meth:`Regroup.keep`, the loop's
position and totals; back to the second-newest that :meth:`Regroup.ready` can restore).
After a lost rank the survivors drop what is in flight (:meth:`Regroup.abandon`), shrink the
communicator, go back to the smallest restorable step any of them reached, and the trainer
and its feed move to them (:meth:`Regroup.regroup`: the same global batches); each loss is
recorded (:attr:`Elastic.losses`). Fewer survivors than ``min_ranks`` end the run
(:class:`TooFewRanks`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from ..comm import elastic as E
from ..errors import MpidpError, setting
from . import faults

#: Exit status when fewer ranks than ``min_ranks`` survive (EX_UNAVAILABLE: a checkpoint,
#: where checkpoints are on, is left to resume from on more ranks).
TOO_FEW_RANKS_EXIT = 69


class TooFewRanks(MpidpError):
    """Fewer ranks than ``min_ranks`` survive: raised on every survivor, the run ending at ``mark``
    (their replicas are back there); ``first``: this is the survivors' rank 0, which says so."""

    def __init__(self, message: str, mark: _Mark, first: bool) -> None:
        super().__init__(message)
        self.mark, self.first = mark, first


class Regroup(Protocol):
    """What a trainer and its feed do for an elastic run (the data-parallel one:
    :class:`mpidp.parallel.elastic.DataParallelRegroup`)."""

    def keep(self, whole: bool = False) -> Any:
        """What :meth:`restore` needs to put the replica back where it is now, once
        :meth:`ready` (``whole``: at once; collective then)."""

    def ready(self, kept: Any) -> bool:
        """Whether ``kept`` can be restored yet (an update still arriving completes it)."""

    def abandon(self) -> None:
        """A rank was lost: drop what is in flight on the old communicators, without
        waiting, so that no survivor waits there. Local."""

    def restore(self, kept: Any) -> None: ...

    def regroup(self, comm) -> None:
        """Go on over ``comm`` (the survivors). Collective over ``comm``."""


@dataclass
class _Mark:
    global_step: int
    epoch: int
    step: int
    totals: np.ndarray
    history: int  # epochs recorded
    kept: Any


@dataclass
class Elastic:
    """The elastic part of one run (``RunSpec.elastic`` once :func:`mpidp.fit` has made it
    real): its :class:`Regroup`, the marks, and the losses so far."""

    group: Regroup
    comm: Any
    watchdog: Any = None
    min_ranks: int = 1
    losses: list[dict] = field(default_factory=list)
    marks: list[_Mark] = field(default_factory=list)

    def __post_init__(self) -> None:
        E.errors_return(self.comm)
        first, self.hosts = E.members(self.comm)  # each rank's rank in the first world
        self.faults = faults.Injector(first[self.comm.rank])

    def mark(self, global_step: int, epoch: int, step: int, totals: np.ndarray,
             history: int, whole: bool = False) -> None:
        """Keep where this rank is, before the step ``step`` of ``epoch`` (or after the
        epoch's last step: ``whole``, so that the run's last mark is ready at its end)."""
        kept = self.group.keep(whole)
        if self.marks and self.marks[-1].global_step == global_step:
            self.marks.pop()  # the same point again (an epoch's end, then its next start)
        self.marks.append(_Mark(global_step, epoch, step, totals.copy(), history, kept))
        ready = [i for i, m in enumerate(self.marks) if self.group.ready(m.kept)]
        del self.marks[:ready[-2] if len(ready) > 1 else 0]  # survivors are one update apart

    def recover(self, exc: BaseException) -> _Mark:
        """After ``exc`` (a lost rank; anything else is re-raised): the survivors, the mark
        they go on from (the replica restored to it); :class:`TooFewRanks` when fewer than
        ``min_ranks`` survive. Collective over the survivors."""
        if not E.is_lost_rank(exc, self.comm):
            raise exc
        t0 = time.perf_counter()
        self.group.abandon()
        first = E.known_members(self.comm)[0]
        comm, lost = E.shrink(self.comm)
        self.faults.apply("recover")
        here = next(m.global_step for m in reversed(self.marks) if self.group.ready(m.kept))
        low, high = (int(v) for v in E.agree_min(comm, [here, -here]) * [1, -1])
        mark = next((m for m in self.marks if m.global_step == low
                     and self.group.ready(m.kept)), None)
        if mark is None:  # never: survivors are at most one update apart
            raise MpidpError(f"cannot roll back from step {here} to step {low}")
        self.group.restore(mark.kept)  # the last mark too: a loss after a step's update
        self.marks = [mark]
        self.group.regroup(comm)
        if self.watchdog is not None:
            E.rewatch(self.watchdog, comm)
        self.comm = comm
        self.losses += _said(comm, [first[r] for r in lost], self.hosts, low, high - low, mark.epoch + 1, t0,
                             self.min_ranks)
        _enough(comm, self.min_ranks, f"the run ends at step {low}", mark)
        return mark

    def report(self, record: dict) -> None:
        """Add the ranks lost during ``record``'s epoch to it (``lost_ranks``)."""
        lost = [dict(x) for x in self.losses if x["epoch"] == record["epoch"]]
        if lost:
            record["lost_ranks"] = lost

    def finished(self, status: int = 0) -> None:
        """The run ended (normally, or with exit ``status``): after losses (before the first step
        too: :func:`lost_while_preparing`), the process leaves at exit with ``status``, not waiting
        for the dead ranks (:func:`mpidp.comm.elastic.end_quietly_at_exit`)."""
        if self.losses:
            E.end_quietly_at_exit(self.comm, status)
        E.exit_with(status)


def lost_while_preparing(exc: BaseException, comm, watchdog=None,
                         min_ranks: int = 1) -> tuple[Any, list[dict]]:
    """Before a run's first step (loading the data, building the model): the survivors'
    communicator after ``exc`` (a lost rank; anything else is raised again), on which to
    prepare again from the start, and each loss's record (step 0, none recomputed).
    :class:`TooFewRanks` when fewer than ``min_ranks`` survive. Collective over them."""
    if not E.is_lost_rank(exc, comm):
        raise exc
    t0 = time.perf_counter()
    first, hosts = E.known_members(comm)  # kept by E.members before the loss
    survivors, lost = E.shrink(comm)
    E.end_quietly_at_exit(survivors)  # MPI_Finalize would wait for the dead
    faults.Injector(first[comm.rank]).apply("recover")
    if watchdog is not None:
        E.rewatch(watchdog, survivors)
    losses = _said(survivors, [first[r] for r in lost], hosts, 0, 0, 1, t0, min_ranks)
    _enough(survivors, min_ranks, "nothing was trained", None)
    return survivors, losses


def _said(comm, gone: list[int], hosts: dict, step: int, recomputed: int, epoch: int,
          t0: float, min_ranks: int) -> list[dict]:
    """The record of each rank in ``gone`` (ranks of the first world), lost before ``step``
    of ``epoch`` (1-based), said on the console by the survivors' rank 0."""
    going = "going on with" if comm.size >= min_ranks else "left with"
    losses = []
    for r in gone:
        loss = {"rank": r, "host": hosts.get(r, "?"), "step": step, "seconds_to_recover":
                time.perf_counter() - t0, "steps_recomputed": recomputed,
                "survivors": comm.size, "epoch": epoch}
        losses.append(loss)
        if comm.rank == 0:
            print(f"mpidp: lost rank {r} ({loss['host']}) at step {step}; {going} "
                  f"{comm.size} rank(s) after {loss['seconds_to_recover']:.2f} s, "
                  f"{recomputed} step(s) recomputed", file=sys.stderr, flush=True)
    return losses


def _enough(comm, min_ranks: int, end: str, mark: _Mark | None) -> None:
    """:class:`TooFewRanks` (``end``: where the run ends) when ``comm`` has fewer than
    ``min_ranks`` ranks; the survivors then leave at exit."""
    if comm.size < min_ranks:
        E.end_quietly_at_exit(comm, TOO_FEW_RANKS_EXIT)
        raise TooFewRanks(f"{comm.size} rank(s) left, fewer than the {min_ranks} "
                          f"{setting('min_ranks')} asks for: {end}", mark, comm.rank == 0)
