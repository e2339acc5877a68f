"""``DataParallel.step(index=...)``: the rows' positions in the training set, which key
dropout masks, must be whole numbers >= 0 (one process, no mpiexec)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

import mpidp
from mpidp import nn


def _dp():
    model = nn.Sequential([nn.Dense(3, 4), nn.Dropout(0.5), nn.Dense(4, 2)], 3).init_(0)
    return mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), MPI.COMM_SELF,
                              watchdog=None)


@pytest.mark.parametrize("index", [[0, -1, 2, 3], [0.0, 1.5, 2.0, 3.0], [[0, 1], [2, 3]],
                                   [0.0, np.nan, 2.0, 3.0]])
def test_negative_fractional_or_shaped_positions_are_refused(index):
    dp, X, y = _dp(), np.ones((4, 3)), np.zeros(4, np.int64)
    before = dp.model.params.copy()
    with pytest.raises(ValueError, match="index must hold the global positions"):
        dp.step(X, y, index=index)
    np.testing.assert_array_equal(dp.model.params, before)


def test_whole_positions_of_any_dtype_train():
    X, y = np.ones((4, 3)), np.zeros(4, np.int64)
    a, b = _dp(), _dp()
    a.step(X, y, index=np.arange(4, 8))
    b.step(X, y, index=[4.0, 5.0, 6.0, 7.0])
    np.testing.assert_array_equal(a.model.params, b.model.params)
