"""Checkpoint files on their own: round trip, retention, checksum, atomic writes."""

from __future__ import annotations

import os

import numpy as np
import pytest

from mpidp import nn
from mpidp.run import checkpoint as ck


def _model_and_opt(seed=0):
    model = nn.mlp(4, (5,), 3, dtype=np.float64).init_(seed)
    opt = nn.Adam(0.01)
    opt.step_(model.params, np.linspace(-1, 1, model.n_params))  # creates m, v, t=1
    return model, opt


def test_round_trip_restores_everything(tmp_path):
    model, opt = _model_and_opt()
    state = ck.State(epoch=2, step=7, global_step=37, totals=[1.5, 10.0, 4.0],
                     history=[{"epoch": 1, "loss": 0.5}], config={"batch_size": 32})
    path = ck.save(str(tmp_path), model, opt, state)
    meta, arrays = ck.read(path)
    assert os.path.basename(path) == "ckpt-0000000037.npz"
    assert np.array_equal(arrays["params"], model.params)
    assert np.array_equal(arrays["opt.m"], opt.state["m"]) and np.array_equal(arrays["opt.v"], opt.state["v"])
    assert (meta["epoch"], meta["step"], meta["global_step"]) == (2, 7, 37)
    assert meta["totals"] == [1.5, 10.0, 4.0] and meta["config"] == {"batch_size": 32}
    assert meta["optimizer"] == {"type": "Adam", "t": 1, "state": {"m": [model.n_params],
                                                                     "v": [model.n_params]}}


def test_keeps_only_the_newest(tmp_path):
    model, opt = _model_and_opt()
    for step in range(1, 6):
        ck.save(str(tmp_path), model, opt, ck.State(global_step=step), keep=2)
    names = [os.path.basename(p) for p in ck.list_checkpoints(str(tmp_path))]
    assert names == ["ckpt-0000000004.npz", "ckpt-0000000005.npz"]


def test_flipped_byte_fails_checksum(tmp_path):
    model, opt = _model_and_opt()
    path = ck.save(str(tmp_path), model, opt, ck.State(global_step=1))
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["params"][3] += 1e-12  # a valid file whose content changed
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match="fails its checksum"):
        ck.read(path)


def test_truncated_file_is_unreadable_and_latest_falls_back(tmp_path, capsys):
    model, opt = _model_and_opt()
    ck.save(str(tmp_path), model, opt, ck.State(global_step=1))
    newest = ck.save(str(tmp_path), model, opt, ck.State(global_step=2))
    with open(newest, "r+b") as f:
        f.truncate(os.path.getsize(newest) // 3)
    with pytest.raises(ValueError, match="unreadable"):
        ck.read(newest)
    path, meta, _ = ck.read_latest(str(tmp_path))
    assert meta["global_step"] == 1 and path.endswith("ckpt-0000000001.npz")
    assert "previous good checkpoint" in capsys.readouterr().err


def test_empty_folder_has_no_checkpoint(tmp_path):
    assert ck.read_latest(str(tmp_path)) is None


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "f.bin"
    ck.write_atomic(str(path), lambda f: f.write(b"good"))

    def fail(f):
        f.write(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        ck.write_atomic(str(path), fail)
    assert path.read_bytes() == b"good" and os.listdir(tmp_path) == ["f.bin"]
