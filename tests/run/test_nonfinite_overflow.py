"""An update that overflows (a huge learning rate or weight decay): one line, no NumPy
warnings, no checkpoint of non-finite parameters, and a message true about which checkpoint
is good, from which a resume works."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from helpers import run_mpi

import mpidp
from mpidp import nn
from mpidp.run import checkpoint as ckpt


def _dp(comm):
    model = nn.mlp(5, (8,), 3, dtype=np.float32).init_(3)
    return mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm)


def test_no_checkpoint_of_an_overflowed_update_and_the_newest_is_named(tmp_path):
    from mpi4py import MPI
    rng = np.random.default_rng(7)
    shard = mpidp.shard_from_arrays(MPI.COMM_SELF, rng.normal(size=(60, 5)).astype(np.float32),
                                    rng.integers(0, 3, 60))
    dp = _dp(MPI.COMM_SELF)

    def blow_up(step, stats):  # the update after step 3's checkpoint overflows
        if step == 3:
            dp.optimizer.lr = 1e300  # inf in float32

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a NumPy RuntimeWarning fails the test
        with pytest.raises(mpidp.MpidpError) as err:
            mpidp.fit(dp, shard, 3, 16, on_step=blow_up,
                      checkpoint=mpidp.Checkpointing(str(tmp_path), every=1, keep=10))
    assert str(err.value) == (
        "the parameters after 4 steps are not finite (an update overflowed), so no checkpoint "
        "is written of them; the newest checkpoint, ckpt-0000000003.npz, is good to resume "
        "from. Lower lr or weight_decay")
    names = [os.path.basename(p) for p in ckpt.list_checkpoints(str(tmp_path))]
    assert names == [f"ckpt-000000000{i}.npz" for i in (1, 2, 3)]
    again = _dp(MPI.COMM_SELF)
    _, state = again.restore(str(tmp_path))
    assert state.global_step == 3 and np.isfinite(again.model.params).all()
    mpidp.fit(again, shard, 2, 16, resume=state)
    assert again.global_step == 8 and np.isfinite(again.model.params).all()


@pytest.mark.parametrize("flag", ["--lr", "--weight-decay"])
def test_a_huge_step_size_is_one_line_and_leaves_no_checkpoint(tmp_path, flag):
    r = run_mpi(2, "train", "--dataset", "synthetic", "--n-samples", "64", "--epochs", "1",
                "--no-progress", "-q", flag, "1e300", "--checkpoint-dir", str(tmp_path / "ck"),
                "--checkpoint-every", "1", "--out", str(tmp_path / "o"), timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Warning" not in r.stderr, r.stderr[-2000:]
    assert lines[0] == (
        "mpidp: error: the parameters after 1 step are not finite (an update overflowed), so "
        "no checkpoint is written of them; no checkpoint was written before it. Lower --lr or "
        "--weight-decay")
    assert ckpt.list_checkpoints(str(tmp_path / "ck")) == []
