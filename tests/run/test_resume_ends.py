"""A run stopped and resumed leaves what an uninterrupted one does: every epoch in
``history.jsonl`` (also when it resumes into the folder it stopped in), the same ``best.npz``;
a finished run resumed trains nothing and says why; a stop without a checkpoint says that it
cannot be resumed."""

from __future__ import annotations

import json

import numpy as np
from helpers import run_mpi

from mpidp.run.signals import Preempted

#: 18 steps per epoch; early stopping (patience 2) ends it after epoch 13, best at 11
RUN = ("train", "--dataset", "digits", "--dtype", "float64", "--val-fraction", "0.2",
       "--early-stopping", "2", "--epochs", "30", "--no-progress")


def _epochs(out) -> list[int]:
    return [r["epoch"] for r in map(json.loads, (out / "history.jsonl").read_text().splitlines())
            if r["kind"] == "epoch"]


def _same(a, b) -> bool:
    with np.load(a) as x, np.load(b) as y:
        return sorted(x.files) == sorted(y.files) and all(np.array_equal(x[k], y[k])
                                                          for k in x.files)


def test_a_stopped_run_resumed_in_its_folder_keeps_every_epoch_line_and_the_best_model(
        tmp_path):
    full, out, ck = tmp_path / "full", tmp_path / "o", ["--checkpoint-dir",
                                                        str(tmp_path / "ck"),
                                                        "--checkpoint-every", "18"]
    assert run_mpi(2, *RUN, "--out", str(full)).returncode == 0
    stopped = run_mpi(2, *RUN, *ck, "--out", str(out), env={"MPIDP_FAULT": "term@0:200"})
    assert stopped.returncode == 75, stopped.stderr
    resumed = run_mpi(2, *RUN, *ck, "--resume", "--out", str(out))
    assert resumed.returncode == 0, resumed.stderr
    assert _epochs(out) == _epochs(full) == list(range(1, 14))  # was: [12, 13] only
    assert _same(out / "best.npz", full / "best.npz")
    assert _same(out / "model.npz", full / "model.npz")


def test_a_run_that_used_all_its_epochs_resumes_to_nothing_and_says_so(tmp_path):
    run = ("train", "--dataset", "digits", "--dtype", "float64", "--epochs", "2",
           "--no-progress", "--checkpoint-dir", str(tmp_path / "ck"), "--out")
    assert run_mpi(2, *run, str(tmp_path / "a")).returncode == 0
    again = run_mpi(2, *run, str(tmp_path / "b"), "--resume")
    assert again.returncode == 0, again.stderr
    assert "the run had already finished: all 2 epochs were done; nothing more to train" \
        in again.stdout
    assert _same(tmp_path / "a" / "model.npz", tmp_path / "b" / "model.npz")
    assert _epochs(tmp_path / "b") == [1, 2]


def test_a_stop_without_a_checkpoint_folder_says_no_checkpoint_was_saved():
    """Not 'nothing was saved': the output folder may hold best.npz and history.jsonl."""
    said = str(Preempted(7, None))
    assert said.endswith("so no checkpoint was saved and the run cannot be resumed"), said
    assert "nothing was saved" not in said
