"""The defaults of ``mpidp train`` train every built-in dataset visibly well: the README's
first command (``mpidp train --dataset synthetic --epochs 2``, nothing else set) and the
other datasets with only the epochs chosen."""

from __future__ import annotations

import json

import pytest
from helpers import run_mpi


@pytest.mark.slow
@pytest.mark.parametrize("dataset, epochs, floor", [("synthetic", 2, 0.7), ("digits", 10, 0.95),
                                                    ("bow", 2, 0.75)])
def test_the_defaults_train_every_builtin_dataset(tmp_path, dataset, epochs, floor):
    out = tmp_path / "o"
    r = run_mpi(2, "train", "--dataset", dataset, "--epochs", str(epochs), "--out", str(out),
                timeout=300)
    assert r.returncode == 0, r.stderr
    h = json.loads((out / "metrics.json").read_text())["history"]
    losses, accs = [e["loss"] for e in h], [e["test_accuracy"] for e in h]
    assert losses[-1] < 0.8 * losses[0] and max(losses) == losses[0], f"loss: {losses}"
    assert accs[-1] > accs[0] and accs[-1] >= floor, f"test accuracy {accs}"
