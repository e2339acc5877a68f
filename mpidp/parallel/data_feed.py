"""A data-parallel run: :class:`DataFeed`, the batches of a
:class:`~mpidp.parallel.data_parallel.DataParallel` (this rank's rows of every global
batch), and :func:`fit`, its run through the one loop (``mpidp.fit``)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .. import comm as C
from ..data.balance import Partition, Plan
from ..data.distribute import Shard
from ..data.partition import steps_per_epoch
from ..nn.losses import label_problem
from ..run.faults import Injector
from ..run.loop import run, watched_run
from ..run.signals import PREEMPTED_EXIT, Preempted
from ..run.spec import RunSpec
from ..run.stats import StepStats
from .data_parallel import DataParallel
from .elastic import elastic_spec, whole_arrays


class DataFeed:
    """This rank's rows of every global batch of a :class:`DataParallel` run, by a
    :class:`~mpidp.data.balance.Plan` (a Feed of :func:`mpidp.run.loop.run`)."""

    def __init__(self, dp: DataParallel, plan: Plan, train: Shard,
                 test: Shard | dict[str, Shard] | None) -> None:
        self.dp, self.plan, self.shard, self.test = dp, plan, train, test
        self.n_steps = steps_per_epoch(train.n_total, plan.batch_size, plan.drop_last)
        self.labelled = dp.loss.classification or train.y.dtype.kind in "iu"
        self.faults = Injector(dp.comm.rank)

    def batches(self, epoch: int, first: int) -> Iterator[tuple]:
        ctx = self.dp.model.context
        ctx.epoch = epoch
        for X, y, index in self.plan.batches(self.shard, epoch, self.dp.timer, first,
                                             with_index=True):
            ctx.index = index  # the rows' global positions: what keys a dropout mask
            yield X, y
        self.shard = self.plan.shard

    def end_epoch(self) -> dict:
        return self.plan.end_epoch(self.dp.timer)

    def evaluate(self) -> dict[str, StepStats]:
        """Every held-out set's figures, by name. Collective."""
        self.faults.apply("evaluate")
        sets = self.test if isinstance(self.test, dict) else {"test": self.test}
        return {name: self.dp.evaluate(shard.X, shard.y) for name, shard in sets.items()
                if shard is not None and shard.n_total}

    def state(self) -> dict:
        return {"strategy": self.plan.strategy, "capacities": self.plan.capacities.tolist()}


def _labels_problem(dp: DataParallel, sets: dict[str, Shard | None]) -> str | None:
    """What is wrong with this rank's labels in ``sets`` for ``dp``'s model, or None."""
    for name, shard in sets.items():
        why = None if shard is None else label_problem(np.asarray(shard.y), dp.model.n_out,
                                                       dp.loss.classification)
        if why:
            return f"the {name} set's {why}"
    return None


def _plan(dp: DataParallel, train: Shard, spec: RunSpec) -> Plan:
    """The spec's :class:`Plan` (its own, or one made from its partition and batches)."""
    if not isinstance(spec.partition, (Plan, Partition, type(None))):
        raise C.MpidpError(f"partition must be a mpidp.Partition (e.g. Partition('cyclic')), "
                           f"a Plan or None, got {spec.partition!r}")
    if not isinstance(spec.partition, Plan):
        return Plan(dp.comm, spec.partition, train.n_total, spec.batch_size, spec.seed,
                    spec.shuffle, spec.drop_last)
    plan = spec.partition
    C.agree(dp.comm, None if plan.n == train.n_total else
            f"the Plan given as partition is for {plan.n} samples but the training set has "
            f"{train.n_total}; make the Plan for this set")
    theirs = (plan.batch_size, plan.seed, plan.shuffle, plan.drop_last)
    ours = (spec.batch_size, spec.seed, spec.shuffle, spec.drop_last)
    if theirs != ours:
        raise C.MpidpError(
            f"the Plan given as partition batches by (batch_size, seed, shuffle, drop_last) "
            f"= {theirs} but the run asks for {ours}; give the same settings to both, or a "
            f"Partition instead of a Plan")
    plan.owner = None  # ``train``'s rows are where it says, not where an earlier fit moved them
    return plan


def fit(dp: DataParallel, train: Shard, epochs: int | None = None,
        batch_size: int | None = None, *, test: Shard | dict[str, Shard] | None = None,
        spec: RunSpec | None = None, **settings) -> list[dict]:
    """Train ``dp`` on this rank's shard ``train`` for ``epochs`` epochs of global batches of
    ``batch_size`` samples (whatever the number of ranks). Collective. ``spec`` (a
    :class:`mpidp.RunSpec`) holds every setting of the run; ``epochs``, ``batch_size`` and
    ``settings`` (its fields) override it. ``test``: a held-out shard, or several by name,
    evaluated after every epoch. Returns the history, one dict per epoch, alike on every rank."""
    spec = RunSpec.of(spec, epochs=epochs, batch_size=batch_size, **settings)
    if spec.elastic is True:  # the whole arrays on every rank: survivors split them again
        train, test, rows = whole_arrays(dp.comm, train, test)
        spec = RunSpec.of(spec, elastic=rows)
    tests = test if isinstance(test, dict) else {"test": test}
    for name, shard in {"train": train, **tests}.items():
        if not (isinstance(shard, Shard) or (shard is None and name != "train")):
            raise C.MpidpError(f"fit: {name} must be a mpidp.Shard (mpidp.shard_from_arrays("
                               f"comm, X, y) wraps arrays){'' if name == 'train' else ' or None'}"
                               f", got {type(shard).__name__}")
    C.agree_same(dp.comm, "fit", {**spec.agreed(), **train.identity("train"), **{
        k: v for name, shard in tests.items()
        for k, v in (shard.identity(name) if shard is not None else {name: None}).items()}})
    C.agree(dp.comm, _labels_problem(dp, {"training": train, **tests}))
    plan = _plan(dp, train, spec)
    if not steps_per_epoch(train.n_total, plan.batch_size, plan.drop_last):
        raise C.MpidpError(  # n_total and the plan are the same on every rank
            "nothing to train on: the training set is empty on every rank" if not train.n_total
            else f"nothing to train on: drop_last with batch_size {plan.batch_size} drops all "
                 f"{train.n_total} samples; use a batch size of at most {train.n_total}")
    dp.model.context.seed = spec.seed
    if spec.resume is not None:
        saved = spec.resume.partition.get("capacities")
        if saved is not None and len(saved) == dp.comm.size:  # another world: start afresh
            plan.capacities = np.asarray(saved, np.float64)
        dp.sync.after_restore(dp.optimizer)  # e.g. a sharded optimizer takes its slice of the state
    with watched_run(spec, dp.comm, dp.watchdog) as spec:
        feed = DataFeed(dp, plan, train, test)
        spec = elastic_spec(dp, feed, spec)  # elastic: the survivors of a lost rank go on
        try:
            history = run(dp, feed, spec)
        except Preempted:
            if spec.elastic:
                spec.elastic.finished(PREEMPTED_EXIT)
            raise
        if spec.elastic:
            spec.elastic.finished()
        dp.settle()  # the last update is whole when fit returns
        if dp.at_boundary():  # replicas that differ (a layer's state too): a failed run
            dp.check_replicas()
        return history
