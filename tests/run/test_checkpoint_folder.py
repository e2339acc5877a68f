"""Checkpoint folders belong to one run: claims, the lock, stale temporary files, file modes,
never-older checkpoints, and what a resume may change. No MPI: these run on the root rank."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import ROOT

from mpidp import atomic, nn
from mpidp.cli import settings
from mpidp.data.sources import fingerprint_change
from mpidp.run import checkpoint as ck
from mpidp.run import folders


def _model_and_opt(seed=0):
    model = nn.mlp(4, (5,), 3, dtype=np.float64).init_(seed)
    opt = nn.SGD(0.1, momentum=0.9)
    opt.step_(model.params, np.linspace(-1, 1, model.n_params))
    return model, opt


def _fill(directory, steps, run_id=None):
    model, opt = _model_and_opt()
    for s in steps:
        ck.save(str(directory), model, opt, ck.State(global_step=s), keep=10, run_id=run_id)


def _names(directory):
    return [os.path.basename(p) for p in ck.list_checkpoints(str(directory))]


# --- claims ----------------------------------------------------------------------------

def test_fresh_claim_records_the_run_and_names_the_holder(tmp_path):
    d = tmp_path / "ck"
    with ck.claim(str(d), "run-a", resume=False) as held:
        assert held.run_id == "run-a" and not held.continued
        assert json.loads((d / "run.json").read_text())["run_id"] == "run-a"
        record = json.loads((d / ".lock").read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert (d / ".lock").read_text() == ""  # released: no holder named any more


def test_fresh_run_into_a_folder_with_another_runs_checkpoints_is_refused(tmp_path):
    d = tmp_path / "ck"
    ck.claim(str(d), "old", resume=False).release()
    _fill(d, [40, 45], run_id="old")
    with pytest.raises(ValueError) as err:
        ck.claim(str(d), "new", resume=False)
    msg = str(err.value)
    assert str(d) in msg and "run old" in msg and "ckpt-0000000045.npz" in msg
    assert "another checkpoint_dir" in msg and "with resume" in msg and "add restart" in msg
    assert _names(d) == ["ckpt-0000000040.npz", "ckpt-0000000045.npz"]  # untouched
    assert json.loads((d / "run.json").read_text())["run_id"] == "old"
    ck.claim(str(d), "new", resume=False, restart=True).release()  # the refusal kept no lock


def test_folder_with_checkpoints_but_no_run_record_is_refused_too(tmp_path):
    _fill(tmp_path, [3])
    with pytest.raises(ValueError, match="already holds checkpoints of another run"):
        ck.claim(str(tmp_path), "new", resume=False)


def test_restart_deletes_the_old_run_and_only_mpidp_files(tmp_path):
    d = tmp_path / "ck"
    ck.claim(str(d), "old", resume=False).release()
    _fill(d, [10, 20], run_id="old")
    (d / "notes.txt").write_text("mine")
    (d / "damaged-ckpt-0000000030.npz").write_bytes(b"x")
    with ck.claim(str(d), "new", resume=False, restart=True) as held:
        assert held.run_id == "new" and len(held.wiped) == 4  # 2 checkpoints, damaged, run.json
        assert _names(d) == [] and (d / "notes.txt").read_text() == "mine"
        assert not (d / "damaged-ckpt-0000000030.npz").exists()
        assert json.loads((d / "run.json").read_text())["run_id"] == "new"
        _fill(d, [1], run_id="new")  # the new run's first checkpoint survives pruning
    assert _names(d) == ["ckpt-0000000001.npz"]


def test_resume_keeps_the_folders_run(tmp_path):
    ck.claim(str(tmp_path), "first", resume=False).release()
    _fill(tmp_path, [5], run_id="first")
    with ck.claim(str(tmp_path), "second", resume=True) as held:
        assert held.run_id == "first" and held.continued
        _fill(tmp_path, [6], run_id=held.run_id)


def test_resume_adopts_an_unrecorded_folder_and_starts_an_empty_one(tmp_path):
    legacy, empty = tmp_path / "legacy", tmp_path / "empty"
    _fill(legacy, [7])
    with ck.claim(str(legacy), "r1", resume=True) as held:
        assert held.run_id == "r1" and held.continued
    with ck.claim(str(empty), "r2", resume=True) as held:
        assert held.run_id == "r2" and not held.continued
    assert json.loads((legacy / "run.json").read_text())["run_id"] == "r1"


def test_fresh_run_takes_a_folder_whose_run_wrote_no_checkpoint(tmp_path):
    ck.claim(str(tmp_path), "crashed-early", resume=False).release()
    with ck.claim(str(tmp_path), "next", resume=False) as held:
        assert held.run_id == "next"


def test_resume_and_restart_together_is_refused(tmp_path):
    with pytest.raises(ValueError, match="^resume .* restart deletes it"):
        ck.claim(str(tmp_path), "r", resume=True, restart=True)


def test_unusable_folder_is_a_value_error_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=f"checkpoint_dir {blocker}"):
        ck.claim(str(blocker / "ck"), "r", resume=False)


# --- the lock --------------------------------------------------------------------------

HOLDER = """
import sys, time
from mpidp.run import checkpoint as ck
held = ck.claim(sys.argv[1], "holder", resume=False)
print("held", flush=True)
time.sleep(120)
"""


def _hold(directory):
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_job_is_refused_with_the_holders_host_and_pid(tmp_path):
    p = _hold(tmp_path)
    try:
        with pytest.raises(ValueError) as err:
            ck.claim(str(tmp_path), "second", resume=True)
        msg = str(err.value)
        assert "in use by another mpidp job" in msg and f"pid {p.pid}" in msg
        assert f"host {socket.gethostname()}" in msg and "another checkpoint_dir" in msg
        assert json.loads((tmp_path / "run.json").read_text())["run_id"] == "holder"
    finally:
        p.kill()
        p.wait()


def test_a_killed_holder_does_not_keep_the_lock(tmp_path):
    p = _hold(tmp_path)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == p.pid  # its record is left
    with ck.claim(str(tmp_path), "next", resume=True) as held:
        assert held.run_id == "holder"
        assert json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()


def test_two_claims_in_one_process_exclude_each_other(tmp_path):
    with ck.claim(str(tmp_path), "a", resume=False):
        with pytest.raises(ValueError, match="in use"):
            ck.claim(str(tmp_path), "b", resume=True)


# --- temporary files and modes ---------------------------------------------------------

def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_claim_removes_temporary_files_of_dead_writers_only(tmp_path):
    tag = folders.host_tag()
    dead = tmp_path / f".tmp-{tag}-{_dead_pid()}-abc"
    live = tmp_path / f".tmp-{tag}-{os.getpid()}-def"
    old = tmp_path / ".tmp-x1y2z3"  # an older name, no writer recorded
    recent = tmp_path / ".tmp-q7w8e9"
    for f in (dead, live, old, recent):
        f.write_bytes(b"")
    hour_ago = time.time() - 3600
    os.utime(old, (hour_ago, hour_ago))
    with ck.claim(str(tmp_path), "r", resume=False) as held:
        assert sorted(held.cleaned) == sorted([str(dead), str(old)])
    assert live.exists() and recent.exists() and not dead.exists() and not old.exists()


def test_a_killed_write_leaves_a_file_the_next_cleanup_removes(tmp_path):
    code = ("import os, sys\nfrom mpidp.atomic import write_atomic\n"
            "write_atomic(sys.argv[1], lambda f: os._exit(9))\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "model.npz")],
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 9
    left = [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")]
    assert len(left) == 1 and (tmp_path / left[0]).stat().st_size == 0
    assert folders.clean_stale_tmp(str(tmp_path)) == [str(tmp_path / left[0])]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_written_files_honour_the_umask(tmp_path, mask, mode):
    old = os.umask(mask)
    try:
        assert atomic.current_umask() == mask
        ck.write_atomic(str(tmp_path / "metrics.json"), lambda f: f.write(b"{}"))
        path = ck.save(str(tmp_path / "ck"), *_model_and_opt(), ck.State(global_step=1))
        folders.write_run(str(tmp_path), "r")
    finally:
        os.umask(old)
    for f in (tmp_path / "metrics.json", path, tmp_path / "run.json"):
        assert os.stat(f).st_mode & 0o777 == mode, f


# --- never an older checkpoint ---------------------------------------------------------

def test_save_refuses_a_checkpoint_behind_the_newest_and_writes_nothing(tmp_path):
    model, opt = _model_and_opt()
    path = ck.save(str(tmp_path), model, opt, ck.State(epoch=4, global_step=60))
    before = open(path, "rb").read()
    with pytest.raises(ValueError, match=r"step 45 \(epoch 2, step 0\) .* holds step 60 already"):
        ck.save(str(tmp_path), model, opt, ck.State(epoch=2, global_step=45))
    # --resume --epochs 2 of a run that finished 4: the loop's final save has the same step
    with pytest.raises(ValueError, match="holds step 60 at epoch 4, step 0 already"):
        ck.save(str(tmp_path), model, opt, ck.State(epoch=2, global_step=60))
    assert open(path, "rb").read() == before and _names(tmp_path) == ["ckpt-0000000060.npz"]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".tmp-")] == []


def test_the_final_checkpoint_may_follow_a_periodic_one_of_the_same_step(tmp_path):
    model, opt = _model_and_opt()
    ck.save(str(tmp_path), model, opt, ck.State(epoch=2, step=15, global_step=45))
    path = ck.save(str(tmp_path), model, opt, ck.State(epoch=3, step=0, global_step=45,
                                                       history=[{"epoch": 3}]))
    assert ck.read(path)[0]["epoch"] == 3 and ck.read(path)[0]["history"] == [{"epoch": 3}]
    ck.save(str(tmp_path), model, opt, ck.State(epoch=3, step=0, global_step=45))  # same place


def test_save_checks_the_folder_still_belongs_to_the_run(tmp_path):
    with ck.claim(str(tmp_path), "mine", resume=False):
        path = ck.save(str(tmp_path), *_model_and_opt(), ck.State(global_step=1), run_id="mine")
        assert ck.read(path)[0]["run_id"] == "mine"
        folders.write_run(str(tmp_path), "intruder")
        with pytest.raises(ValueError, match="belongs to run intruder, not to this run"):
            ck.save(str(tmp_path), *_model_and_opt(), ck.State(global_step=2), run_id="mine")


def test_pruning_tolerates_files_removed_meanwhile(tmp_path, monkeypatch):
    _fill(tmp_path, [1, 2])
    real = ck.list_checkpoints
    ghost = str(tmp_path / "ckpt-0000000000.npz")  # listed, then gone before the unlink
    monkeypatch.setattr(ck, "list_checkpoints", lambda d: [ghost, *real(d)])
    ck.save(str(tmp_path), *_model_and_opt(), ck.State(global_step=3), keep=2)
    monkeypatch.undo()
    assert _names(tmp_path) == ["ckpt-0000000002.npz", "ckpt-0000000003.npz"]


def test_resume_past_a_damaged_checkpoint_can_write_its_step_again(tmp_path):
    _fill(tmp_path, [10, 20])
    newest = tmp_path / "ckpt-0000000020.npz"
    newest.write_bytes(newest.read_bytes()[:100])
    path, meta, _ = ck.read_latest(str(tmp_path))
    assert meta["global_step"] == 10
    assert (tmp_path / "damaged-ckpt-0000000020.npz").exists() and ck.newest_step(str(tmp_path)) == 10
    _fill(tmp_path, [20])  # the resumed run reaches step 20 again
    assert ck.read_latest(str(tmp_path))[1]["global_step"] == 20


# --- what a resume may change ----------------------------------------------------------

CONFIG = {"dataset": "synthetic", "model": "mlp", "hidden": [16], "batch_size": 32, "seed": 0,
          "dtype": "float64", "optimizer": "sgd", "test_fraction": 0.2, "no_shuffle": False,
          "drop_last": False, "n_samples": 600, "n_features": 10, "epochs": 4, "lr": 0.01,
          "momentum": 0.0, "weight_decay": 0.0}


def test_changed_hyperparameters_are_allowed_and_reported():
    changed, refusal = settings.compare_resume(CONFIG, {**CONFIG, "lr": 0.05, "weight_decay": 1e-4,
                                                  "epochs": 6, "checkpoint_every": 3})
    assert refusal is None
    assert changed == {"lr": {"checkpoint": 0.01, "now": 0.05},
                       "weight_decay": {"checkpoint": 0.0, "now": 1e-4}}
    assert settings.format_changes(changed) == ("resuming with changed hyperparameters: --lr 0.05 "
                                          "(the checkpoint used 0.01), --weight-decay 0.0001 "
                                          "(the checkpoint used 0.0)")
    assert settings.compare_resume(CONFIG, dict(CONFIG)) == ({}, None) and settings.format_changes({}) == ""


def test_settings_that_shape_the_run_must_match():
    changed, refusal = settings.compare_resume(CONFIG, {**CONFIG, "batch_size": 16, "momentum": 0.9},
                                         path="ck/ckpt-0000000015.npz")
    assert refusal == ("checkpoint ck/ckpt-0000000015.npz was written with different settings: "
                       "--batch-size 32 (now 16)")
    assert changed == {"momentum": {"checkpoint": 0.0, "now": 0.9}}


@pytest.mark.parametrize("epochs,state,ok", [
    (2, ck.State(epoch=4, step=0, global_step=60), False),  # finished 4 epochs
    (4, ck.State(epoch=4, step=0, global_step=60), True),   # nothing left to do
    (3, ck.State(epoch=3, step=5, global_step=50), False),  # mid-epoch 4
    (4, ck.State(epoch=3, step=5, global_step=50), True),
])
def test_epochs_below_the_checkpoints_progress_are_refused(epochs, state, ok):
    _, refusal = settings.compare_resume(CONFIG, {**CONFIG, "epochs": epochs}, state=state, path="P")
    assert (refusal is None) == ok
    if not ok:
        need = state.epoch + (1 if state.step else 0)
        assert f"--epochs {epochs} is below what checkpoint P has done" in refusal
        assert f"global step {state.global_step}" in refusal
        assert f"--epochs {need} or more" in refusal and "--restart" in refusal


def test_fingerprint_sees_changed_data_and_not_a_resave(tmp_path):
    X, y = np.arange(60.0).reshape(20, 3), np.arange(20) % 2
    np.savez(tmp_path / "d.npz", X=X, y=y)
    first = ck.data_fingerprint(str(tmp_path / "d.npz"))
    time.sleep(2.1)  # zip timestamps have 2 s resolution: the re-save differs in them
    np.savez(tmp_path / "d.npz", X=X, y=y)
    assert ck.data_fingerprint(str(tmp_path / "d.npz")) == first
    X[7, 1] += 1
    np.savez(tmp_path / "d.npz", X=X, y=y)
    changed = ck.data_fingerprint(str(tmp_path / "d.npz"))
    assert changed != first
    _, refusal = settings.compare_resume({**CONFIG, "data_fingerprint": first},
                                   {**CONFIG, "data_fingerprint": changed}, path="P")
    assert "the dataset synthetic changed since checkpoint P was written" in refusal
    assert "d.npz has the same size but different contents" in refusal


def test_fingerprint_of_a_folder_and_of_builtins(tmp_path):
    np.save(tmp_path / "X.npy", np.zeros((400_000, 4)))  # the bytes: tests/mpi/test_fingerprint.py
    np.save(tmp_path / "y.npy", np.zeros(400_000))
    first = ck.data_fingerprint(str(tmp_path))
    assert [f["name"] for f in first["files"]] == ["X.npy", "y.npy"]
    np.save(tmp_path / "y.npy", np.zeros(399_999))
    second = ck.data_fingerprint(str(tmp_path))
    assert "y.npy was 3200128 bytes, now 3200120" in fingerprint_change(first, second)
    assert ck.data_fingerprint("synthetic") == {"builtin": "synthetic"}
    with pytest.raises(ValueError, match="cannot fingerprint dataset file .*missing"):
        ck.data_fingerprint(str(tmp_path / "missing.npz"))
