"""A data-parallel run that goes on when ranks die (``fit(..., elastic=...)``): what
:mod:`mpidp.run.elastic` asks of a :class:`~mpidp.parallel.data_parallel.DataParallel` and its feed.
A replica is kept before each step (between synchronisations of ``accumulate``: at a group's first
step only), so one ahead of the survivors can go back; the survivors then take the same global
batches over fewer ranks, their rows from ``rows(comm)``, the function given as ``elastic``."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable
from typing import Any

from .. import comm as C
from ..comm import elastic as E
from ..data.balance import Plan
from ..data.distribute import Shard, shard_from_arrays
from ..errors import setting
from ..run.elastic import Elastic
from ..run.spec import RunSpec
from .modes import MODES
from .sync import Setup


def refusal(sync: str) -> str | None:
    """Why the gradient exchange ``sync`` cannot go on over fewer ranks, or None. Pure."""
    m = MODES.get(sync)
    if m is None or m.elastic is True:
        return None
    *others, last = (MODES[n].option for n in ELASTIC)
    return (f"{setting('elastic')} cannot keep {m.option} going when a rank is lost: "
            f"{m.elastic}; use {', '.join(others)} or {last}")


#: the modes that go on over the survivors
ELASTIC = tuple(n for n, m in MODES.items() if m.elastic is True)


class DataParallelRegroup:
    """Keeps, restores and moves a DataParallel and its feed (an elastic run's Regroup)."""

    def __init__(self, dp, feed, rows: Callable[[C.Comm], Any]) -> None:
        self.dp, self.feed, self.rows = dp, feed, rows

    def keep(self, whole: bool = False) -> list:
        """The replica now; its parameters and optimizer state once the last update is whole
        (an overlapped update may still arrive during the next forward pass; ``whole``:
        complete it now, collectively). Never between synchronisations (gradients summed
        over a group's steps are in the buffer): a survivor goes back to the group's start."""
        dp, opt = self.dp, self.dp.optimizer
        kept = [None, dp.model.state.copy(), dp.global_step, None, opt.t, opt.lr_scale,
                dp.policy.skipped]

        def fill() -> None:
            kept[0], kept[3] = dp.model.params.copy(), {k: v.copy() for k, v in opt.state.items()}
        if whole:
            dp.settle()
        if dp.sync.at_boundary():
            dp.sync.when_whole(fill)
        return kept

    def ready(self, kept: list) -> bool:
        return kept[0] is not None

    def abandon(self) -> None:
        self.dp.sync.abandon()

    def restore(self, kept: list) -> None:
        dp, opt = self.dp, self.dp.optimizer
        params, state, dp.global_step, opt_state, opt.t, opt.lr_scale, dp.policy.skipped = kept
        dp.model.params[...] = params
        dp.model.state[...] = state
        for k, v in opt_state.items():
            opt.state[k][...] = v

    def regroup(self, comm: C.Comm) -> None:
        dp, feed = self.dp, self.feed
        buf = dp.buf.copy()  # out of any shared-memory window; the old ones are dropped
        dp.comm = comm
        dp.model.context.group_size = comm.size
        dp.sync.setup(Setup(comm, 0, dp.model, dp.timer, grads=buf))
        dp.model.use_grad_buffer(buf)
        dp.buf, dp.root = buf, 0
        got = self.rows(comm)
        train, test = got if isinstance(got, tuple) else (got, feed.test)
        if not isinstance(train, Shard) or train.n_total != feed.plan.n:
            raise C.MpidpError(f"elastic: the rows for the survivors must be a Shard of the "
                               f"{feed.plan.n} training samples, got {train!r:.80}")
        old = feed.plan
        feed.plan = Plan(comm, old.partition, old.n, old.batch_size, old.seed, old.shuffle,
                         old.drop_last)
        feed.shard, feed.test = train, test
        dp.timer.take_records()  # the epoch's balance figures: the survivors' steps only


def whole_arrays(comm: C.Comm, train, test) -> tuple:
    """For ``elastic=True``: ``train`` and ``test`` (each ``(X, y)``, the whole set on every
    rank; ``test`` may be a dict of them) as this rank's block of rows over ``comm``, and
    the function that splits them again over the survivors. Other data is returned as is."""
    def whole(data) -> bool:
        return isinstance(data, tuple) and len(data) == 2

    def split(over: C.Comm, data):
        if isinstance(data, dict):
            return {name: split(over, part) for name, part in data.items()}
        if not whole(data):
            return data
        X, y = data
        lo, hi = len(X) * over.rank // over.size, len(X) * (over.rank + 1) // over.size
        return shard_from_arrays(over, X[lo:hi], y[lo:hi])

    if not whole(train):
        return train, test, True
    return split(comm, train), split(comm, test), lambda over: (split(over, train),
                                                                 split(over, test))


def elastic_spec(dp, feed, spec: RunSpec) -> RunSpec:
    """``spec`` with its ``elastic`` setting made an :class:`Elastic` over ``dp``'s
    communicator (refused alike on every rank where it cannot go on)."""
    rows = spec.elastic
    if rows is False or rows is None or isinstance(rows, Elastic):
        return spec
    why = E.ulfm_problem(dp.comm) or refusal(dp.sync.name) or (
        None if callable(rows) else
        f"{setting('elastic')} must be True (with the training set as arrays (X, y), the "
        f"whole set on every rank) or a function comm -> Shard that reads this rank's "
        f"training rows over comm (e.g. lambda comm: mpidp.load(comm, path, "
        f"distribute='local').train): the rows of a lost rank are read again from it") or (
        None if spec.min_ranks <= dp.comm.size else
        f"{setting('min_ranks', spec.min_ranks)} is more than the {dp.comm.size} ranks of "
        f"the run") or (
        None if getattr(dp.sync, "hierarchy", None) is None else
        f"{setting('elastic')} cannot go on with the node-aware reduction: a node's ranks "
        f"wait for each other in shared memory, where a lost rank is never noticed; turn it "
        f"off ({setting('node_aware', False)})")
    C.agree(dp.comm, why or E.hosts_problem(dp.comm))
    dog = spec.watchdog if isinstance(spec.watchdog, C.Watchdog) else dp.watchdog
    made = Elastic(DataParallelRegroup(dp, feed, rows), dp.comm, dog, spec.min_ranks)
    _RUNS[dp] = made
    return dataclasses.replace(spec, elastic=made)


_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def last_run(dp) -> Elastic | None:
    """The :class:`Elastic` of ``dp``'s last elastic :func:`~mpidp.fit` (its ``losses``,
    its ``recover``), or None."""
    return _RUNS.get(dp)

