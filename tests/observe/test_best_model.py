"""``mpidp.BestModel`` in a program of one's own: ``fit``'s ``on_epoch`` keeps the model of
the epoch with the lowest validation loss in one file, as ``mpidp train`` keeps best.npz."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
from helpers import ROOT

from mpidp import nn

PROGRAM = """
import sys
import numpy as np, mpidp
from mpidp import nn
from mpi4py import MPI

comm, out = MPI.COMM_WORLD, sys.argv[1]
rng = np.random.default_rng(0)
X, W = rng.standard_normal((160, 5)), rng.standard_normal((5, 3))
y = np.argmax(X @ W + 1.5 * rng.standard_normal((160, 3)), axis=1)  # noisy: it overfits
train = mpidp.shard_from_arrays(comm, X[:60], y[:60])
val = mpidp.shard_from_arrays(comm, X[60:], y[60:])
dp = mpidp.DataParallel(nn.mlp(5, (64,), 3, dtype=np.float64).init_(1), nn.SGD(0.02),
                        nn.SoftmaxCrossEntropy(), comm)
best = mpidp.BestModel(out + "/kept/best.npz", dp.model, comm=comm, meta={"run": "mine"})
seen = []

def on_epoch(record):
    best(record)
    seen.append(dp.model.params.copy())  # the reference: every epoch's parameters

history = mpidp.fit(dp, train, 12, 10, test={"val": val}, on_epoch=on_epoch, seed=3)
np.savez(out + "/ref.npz", params=np.array(seen), val_loss=[h["val_loss"] for h in history])
print(best.summary())
"""


def test_the_file_holds_the_best_validation_epochs_model(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, str(script), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    ref = np.load(tmp_path / "ref.npz")
    losses = ref["val_loss"].tolist()
    epoch = int(np.argmin(losses)) + 1
    assert 1 < epoch < len(losses)  # neither the first nor the last: the keeper chose
    kept = nn.load(str(tmp_path / "kept" / "best.npz"))
    np.testing.assert_array_equal(kept.params, ref["params"][epoch - 1])
    assert kept.meta == {"run": "mine", "epoch": epoch, "val_loss": losses[epoch - 1]}
    assert r.stdout.strip().splitlines()[-1] == str(
        {"file": "best.npz", "epoch": epoch, "val_loss": losses[epoch - 1]})
