"""Standardizing a training set spread over the ranks: the exact moments of all the rows
together, as one rank holding them all would compute them."""

from __future__ import annotations

import numpy as np

from .. import comm as C
from ..nn.standardize import Standardize, pass1_mean, pass1_sums, pass2_squares


def fit_over_ranks(comm: C.Comm, layer: Standardize, X: np.ndarray) -> None:
    """Fit ``layer`` to the exact mean and standard deviation of every rank's ``X`` together:
    one ``Allreduce`` of the counts and sums, one of the centred sums of squares. Collective."""
    count, mean = pass1_mean(C.allreduce_sum_(comm, pass1_sums(X)))
    layer.fit_(count, mean, C.allreduce_sum_(comm, pass2_squares(X, mean)))
