"""The replica check covers layer state: a layer that updates its state from its own rows
(against the contract of docs/extending.md) fails ``fit``, ``check_every`` and the
trainer's check, on every rank, in one line naming the layer, the ranks and the rule."""

from __future__ import annotations

import numpy as np
import pytest
from mpi_helpers import all_ranks, raises_everywhere

import mpidp
from mpidp import nn


class OwnRowsMean(nn.Layer):
    """x unchanged; keeps a running mean of this rank's rows alone (the broken rule)."""

    def output_shape(self, in_shape):
        self.width = in_shape[-1]
        return in_shape

    def state_shapes(self):
        return {"mean": (self.width,)}

    def forward(self, x):
        if self.context.training and len(x):
            self.state["mean"][...] = 0.9 * self.state["mean"] + 0.1 * x.mean(axis=0)
        return x

    def backward(self, dy, accumulate=False, need_input_grad=True):
        return dy


def _setup(comm):
    rng = np.random.default_rng(0)
    X, y = rng.normal(size=(40, 4)) + np.arange(40)[:, None], rng.integers(0, 2, 40)
    lo, hi = 40 * comm.rank // comm.size, 40 * (comm.rank + 1) // comm.size
    model = nn.Sequential([nn.Dense(4, 4), OwnRowsMean(), nn.Dense(4, 2)], 4,
                          np.float64).init_(1)
    dp = mpidp.DataParallel(model, nn.SGD(0.01), nn.SoftmaxCrossEntropy(), comm)
    return dp, mpidp.shard_from_arrays(comm, X[lo:hi], y[lo:hi])


RULE = ("layer 1 (OwnRowsMean()): its state differs from rank 0's on ranks {}: a layer must "
        "update its state only from global figures")


def _rule(comm) -> str:
    """The one line every rank gets: rank 0 against every other (each rank's own rows)."""
    return RULE.format(list(range(1, comm.size)))


@pytest.mark.mpi(min_size=2)
def test_fit_fails_when_a_layers_state_differs(comm):
    dp, shard = _setup(comm)
    err = raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.fit(dp, shard, 1, 8), _rule(comm))
    all_ranks(comm, "\n" not in str(err))


@pytest.mark.mpi(min_size=2)
def test_check_every_names_the_layer_at_the_first_check(comm):
    dp, shard = _setup(comm)
    seen = []
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.fit(
        dp, shard, 3, 8, check_every=1, on_step=lambda step, s: seen.append(step)), _rule(comm))
    all_ranks(comm, dp.global_step == 1, f"checked late: step {dp.global_step}")


@pytest.mark.mpi(min_size=2)
def test_in_sync_and_check_replicas_see_the_state(comm):
    dp, _ = _setup(comm)
    all_ranks(comm, dp.in_sync())
    dp.model.layers[1].state["mean"][...] = comm.rank
    all_ranks(comm, not dp.in_sync())
    raises_everywhere(comm, mpidp.MpidpError, dp.check_replicas, _rule(comm))
