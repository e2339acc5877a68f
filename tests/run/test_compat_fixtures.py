"""Files written by an earlier release still work: its checkpoint resumes at another number
of ranks, and its OUT/config.toml reproduces its run.

``fixtures/v0.2`` was written by mpidp 0.2 (before the modes were declared in one place)
with ``mpiexec -n 2 mpidp train --dataset synthetic --n-samples 300 --n-features 12 --model
mlp --hidden 16 --epochs 2 --batch-size 32 --dtype float64 --optimizer momentum --lr 0.05
--sync overlapped --bucket-mb 0.001 --checkpoint-dir ckpt --checkpoint-every 5
--keep-checkpoints 1 --out out``: ``ckpt/`` (its last checkpoint), ``config.toml`` and
``model.npz`` from ``out``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, run_mpi

FIXTURE = ROOT / "tests" / "fixtures" / "v0.2"
RUN = ["train", "--dataset", "synthetic", "--n-samples", "300", "--n-features", "12",
       "--model", "mlp", "--hidden", "16", "--batch-size", "32", "--dtype", "float64",
       "--optimizer", "momentum", "--lr", "0.05", "--sync", "overlapped", "--bucket-mb",
       "0.001", "-q"]

pytestmark = pytest.mark.slow


def _params(out: Path) -> np.ndarray:
    with np.load(out / "model.npz", allow_pickle=False) as z:
        return z["params"]


def test_an_old_checkpoint_resumes_at_another_rank_count_as_an_uninterrupted_run(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURE / "ckpt", ckpt)
    resumed = run_mpi(3, *RUN, "--epochs", "4", "--checkpoint-dir", str(ckpt), "--resume",
                      "--out", str(tmp_path / "resumed"), timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    whole = run_mpi(1, *RUN, "--epochs", "4", "--out", str(tmp_path / "whole"), timeout=240)
    assert whole.returncode == 0, whole.stderr
    np.testing.assert_allclose(_params(tmp_path / "resumed"), _params(tmp_path / "whole"),
                               rtol=1e-10, atol=1e-12)


def test_an_old_config_file_reproduces_its_run(tmp_path):
    again = run_mpi(2, "train", "--config", str(FIXTURE / "config.toml"), "--out",
                    str(tmp_path / "again"), "--checkpoint-dir", str(tmp_path / "ckpt"), "-q",
                    timeout=240)
    assert again.returncode == 0, again.stderr
    np.testing.assert_allclose(_params(tmp_path / "again"), _params(FIXTURE),
                               rtol=1e-10, atol=1e-12)
