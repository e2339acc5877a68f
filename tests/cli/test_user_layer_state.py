"""``mpidp train`` with a user's layer that keeps state from its own rows: the end check
and ``--check-every`` compare the state too, so the run fails in one line naming the layer,
the ranks and the rule, instead of claiming bit-identical replicas."""

from __future__ import annotations

import pytest
from helpers import run_mpi

LAYER = '''
import numpy as np
from mpidp import nn


@nn.register_layer
class OwnRowsMean(nn.Layer):
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
'''
MODEL = '[[layers]]\ntype = "Dense"\nn_out = 8\n\n[[layers]]\ntype = "OwnRowsMean"\n\n' \
        '[[layers]]\ntype = "Dense"\n'


@pytest.mark.parametrize("check", [[], ["--check-every", "1"]], ids=["end", "every-step"])
def test_a_layer_whose_state_differs_fails_the_replica_check(tmp_path, check):
    (tmp_path / "ownrows.py").write_text(LAYER)
    (tmp_path / "net.toml").write_text(MODEL)
    r = run_mpi(2, "train", "--dataset", "synthetic", "--n-samples", "64", "--epochs", "1",
                "--no-progress", "--model", str(tmp_path / "net.toml"), "--import",
                str(tmp_path / "ownrows.py"), *check, "--out", str(tmp_path / "o"), timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "bit-identical" not in r.stdout
    errors = [line for line in r.stderr.splitlines() if line.startswith("mpidp: error:")]
    assert errors == ["mpidp: error: layer 1 (OwnRowsMean()): its state differs from rank 0's "
                      "on ranks [1]: a layer must update its state only from global figures "
                      "(sums that context.reduce_sum completes over the batch), never from its "
                      "own rows"], r.stderr[-2000:]
    assert not (tmp_path / "o" / "model.npz").exists()
