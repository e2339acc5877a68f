"""Evaluation figures summed over ranks: the loss sums and the score statistics of
:class:`mpidp.observe.scores.ScoreSums` in one collective."""

from __future__ import annotations

import numpy as np

from .. import comm as C
from ..observe.scores import ScoreSums, reg_combine_all


def global_sums(comm: C.Comm, totals: np.ndarray, sums: ScoreSums) -> tuple[np.ndarray, np.ndarray]:
    """``(totals, score vector)`` over every rank of ``comm``: classification statistics
    ride with ``totals`` in one ``Allreduce``; a regression's (not additive) are gathered
    and merged in rank order, so every rank holds the same figures. Collective."""
    if sums.additive:
        both = C.allreduce_sum_(comm, np.concatenate([totals, sums.vector]))
        return both[:len(totals)], both[len(totals):]
    C.allreduce_sum_(comm, totals)
    rows = C.allgather_rows(comm, np.ascontiguousarray(sums.vector, np.float64))
    return totals, reg_combine_all(rows)
