"""Evaluation figures summed over ranks: the loss sums and the score statistics of
:class:`mpidp.observe.scores.ScoreSums` in one collective."""

from __future__ import annotations

import numpy as np

from .. import comm as C
from ..nn import Loss
from ..observe.scores import ScoreSums, reg_combine_all


def n_correct(loss: Loss, out: np.ndarray, y: np.ndarray) -> int:
    """Correct predictions of ``out`` for ``y``; 0 where the loss takes real targets."""
    return loss.n_correct(out, y) if loss.classification or y.dtype.kind in "iu" else 0


def score_sums(comm: C.Comm, loss: Loss, y: np.ndarray | None, n_outputs: int) -> ScoreSums:
    """The :class:`ScoreSums` of an evaluation, alike on every rank: a classifier's for a
    classification loss or 1-D integer labels, else a regression's. ``y``: this rank's
    labels or targets (or None). Collective unless the loss classifies."""
    if loss.classification:
        return ScoreSums(True, n_outputs)
    kinds = np.zeros(2)  # [ranks with targets, ranks with integer labels]
    if y is not None:
        kinds[int(y.ndim == 1 and y.dtype.kind in "iu")] = 1
    C.allreduce_sum_(comm, kinds)
    if kinds.all():
        raise C.MpidpError("evaluation: some ranks hold integer class labels, others real "
                           "targets; give every rank labels of one kind")
    return ScoreSums(bool(kinds[1]), n_outputs)


def global_sums(comm: C.Comm, totals: np.ndarray, sums: ScoreSums) -> tuple[np.ndarray, np.ndarray]:
    """``(totals, score vector)`` over every rank of ``comm`` (a regression's gathered and
    merged in rank order), alike on every rank. Collective."""
    if sums.additive:
        both = C.allreduce_sum_(comm, np.concatenate([totals, sums.vector]))
        return both[:len(totals)], both[len(totals):]
    C.allreduce_sum_(comm, totals)
    rows = C.allgather_rows(comm, np.ascontiguousarray(sums.vector, np.float64))
    return totals, reg_combine_all(rows)
