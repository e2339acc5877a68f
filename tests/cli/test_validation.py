"""Validation, early stopping, the best model, exact scores and standardization through
``mpidp train`` and ``mpidp predict``, against independent references."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import parser_refusal, run_here, run_mpi
from sklearn.metrics import f1_score, log_loss, precision_recall_fscore_support

from mpidp import nn
from mpidp.data.partition import split_rows, validation_split
from mpidp.data.sources import open_source

DIGITS = ["train", "--dataset", "digits", "--no-progress", "--seed", "2", "--dtype", "float64"]
STOPPING = [*DIGITS, "--val-fraction", "0.2", "--early-stopping", "2", "--epochs", "40",
            "--lr", "0.1"]


def _metrics(out) -> dict:
    return json.loads((Path(out) / "metrics.json").read_text())


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """One early-stopped data-parallel run of 2 ranks, checkpointed (folder, job): its out
    is read by the early-stopping test, its checkpoints resumed by the resume test."""
    root = tmp_path_factory.mktemp("stopped")
    r = run_mpi(2, *STOPPING, "--checkpoint-dir", str(root / "ck"), "--out", str(root / "o"))
    assert r.returncode == 0, r.stderr[-3000:]
    return root, r


@pytest.mark.parametrize("mode", [[], ["--parallel", "pipeline"]], ids=["data", "pipeline"])
def test_early_stopping_on_the_validation_loss_keeps_the_best_model(tmp_path, request, mode):
    """Data parallel: the run of the ``stopped`` fixture (checkpointed); pipeline: a job of
    its own."""
    if mode:
        folder = tmp_path
        r = run_mpi(2, *STOPPING, *mode, "--out", str(folder / "o"))
        assert r.returncode == 0, r.stderr[-3000:]
    else:
        folder, r = request.getfixturevalue("stopped")
    m = _metrics(folder / "o")
    losses = [h["val_loss"] for h in m["history"]]
    best = int(np.argmin(losses))
    assert len(losses) < 40 and len(losses) - 1 - best == 2  # two epochs without improving
    assert m["best"] == {"file": "best.npz", "epoch": best + 1, "val_loss": losses[best]}
    assert f"best validation loss {losses[best]:.4f} at epoch {best + 1}" in r.stdout
    saved = nn.load(folder / "o" / "best.npz")
    assert saved.meta["epoch"] == best + 1
    # the validation rows, split as train splits them: the saved model's loss on them
    src = open_source("digits")
    train, _ = split_rows(src.n_samples, None, 2)
    _, val = validation_split(train, 0.2, 2)
    X, y = src.read(val)
    loss = nn.SoftmaxCrossEntropy().forward(saved.predict(X.astype(np.float64)), y) / len(y)
    assert abs(loss - losses[best]) < 1e-9
    assert not np.array_equal(saved.params, nn.load(folder / "o").params)


def test_the_same_validation_and_stop_at_one_and_three_ranks(tmp_path, capsys):
    """One rank in this process, three by a job."""
    args = [*DIGITS, "--val-fraction", "0.1", "--early-stopping", "1", "--epochs", "30",
            "--lr", "0.2", "--distribute", "local"]
    for n in (1, 3):
        out = ["--out", str(tmp_path / str(n))]
        r = run_here(capsys, *args, *out) if n == 1 else run_mpi(n, *args, *out)
        assert r.returncode == 0, r.stderr[-3000:]
    one, three = _metrics(tmp_path / "1"), _metrics(tmp_path / "3")
    assert len(one["history"]) == len(three["history"]) < 30
    for a, b in zip(one["history"], three["history"]):
        assert abs(a["val_loss"] - b["val_loss"]) < 1e-9 and a["val_accuracy"] == b["val_accuracy"]


def test_the_scores_equal_scikit_learn_on_the_predictions(tmp_path):
    r = run_mpi(3, *DIGITS, "--epochs", "3", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_mpi(2, "predict", "--model", str(tmp_path / "o"), "--dataset", "digits",
                "--rows", "test", "--seed", "2", "--out", str(tmp_path / "p.npy"),
                "--metrics", str(tmp_path / "scores.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    scores = np.load(tmp_path / "p.npy")
    src = open_source("digits")
    _, test = split_rows(src.n_samples, None, 2)
    y = src.read(test)[1]
    got = json.loads((tmp_path / "scores.json").read_text())
    pred = scores.argmax(axis=1)
    p, rec, f1, support = precision_recall_fscore_support(y, pred, labels=range(10),
                                                          zero_division=0)
    assert np.allclose(got["precision"], p) and np.allclose(got["recall"], rec)
    assert abs(got["f1_macro"] - f1_score(y, pred, average="macro")) < 1e-12
    proba = np.exp(scores - scores.max(1, keepdims=True))
    assert abs(got["log_loss"] - log_loss(y, proba / proba.sum(1, keepdims=True),
                                          labels=range(10))) < 1e-9
    trained = _metrics(tmp_path / "o")["scores"]["test"]  # train's own final evaluation
    assert abs(trained["f1_macro"] - got["f1_macro"]) < 1e-12
    assert trained["confusion_matrix"] == got["confusion_matrix"]
    assert "test_f1_macro" in _metrics(tmp_path / "o")["history"][-1]


def test_standardize_uses_the_exact_moments_of_the_whole_training_set(tmp_path, capsys):
    """One rank in this process, three by a job: the same moments, the same model."""
    rng = np.random.default_rng(0)
    X = rng.normal(5.0, 3.0, (301, 4)) * [1, 10, 100, 0.01] + [0, 1e3, -7, 2]
    np.savez(tmp_path / "d.npz", X=X, y=(X[:, 0] > 5).astype(np.int64))
    args = ["train", "--dataset", str(tmp_path / "d.npz"), "--model", "logreg",
            "--standardize", "--epochs", "2", "--dtype", "float64", "--no-progress",
            "--test-fraction", "0.25"]
    for n in (1, 3):
        out = ["--out", str(tmp_path / str(n))]
        r = run_here(capsys, *args, *out) if n == 1 else run_mpi(n, *args, *out)
        assert r.returncode == 0, r.stderr[-3000:]
    train, _ = split_rows(301, 0.25, 0)
    model = nn.load(tmp_path / "3")
    layer = model.layers[0]
    assert type(layer).__name__ == "Standardize" and model.meta["standardized"]
    assert np.allclose(layer.state["mean"], X[train].mean(axis=0), rtol=1e-12, atol=0)
    assert np.allclose(layer.state["std"], X[train].std(axis=0), rtol=1e-12, atol=0)
    assert np.allclose(nn.load(tmp_path / "1").params, model.params, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("extra, message", [
    (["--early-stopping", "3"], "--early-stopping needs --val-fraction"),
    (["--val-fraction", "0.1", "--sync", "async-ps"], "--val-fraction does not apply to"),
    (["--val-fraction", "1.5"], "--val-fraction"),
    (["--val-fraction", "0.999", "--dataset", "synthetic", "--n-samples", "200",
      "--n-features", "4"], "no training samples left after the validation split "
     "(--val-fraction 0.999 held out all"),
    (["--standardize", "--dataset", "bow"], "--standardize does not apply to --dataset bow"),
])
def test_validation_options_that_cannot_work_are_refused(tmp_path, capsys, extra, message):
    """Refused by the parser, or by the ranks: async-ps by a job of 2 ranks (it needs 2), the
    others as a run of one rank in this process (the same checks, before any step)."""
    err = parser_refusal(capsys, *DIGITS, *extra, "--out", str(tmp_path / "o"))
    if err is not None:  # refused by the parser (in this process), else by the ranks
        assert message in err and not (tmp_path / "o").exists(), err
        return
    args = [*DIGITS, *extra, "--out", str(tmp_path / "o")]
    r = run_mpi(2, *args) if "async-ps" in extra else run_here(capsys, *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "o" / "model.npz").exists()


def test_an_early_stopped_run_resumed_into_a_new_out_stays_finished(tmp_path, stopped):
    """The checkpoint carries best.npz: a resume (job scripts always pass --resume) into
    another folder trains nothing and writes the same model.npz and best.npz (the first
    run: the ``stopped`` fixture's)."""
    root, _ = stopped
    again = run_mpi(2, *STOPPING, "--checkpoint-dir", str(root / "ck"), "--resume",
                    "--out", str(tmp_path / "b"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "the run had already finished: early stopping ended it after epoch" in again.stdout
    for name in ("model.npz", "best.npz"):
        assert (root / "o" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert "best.npz" in again.stdout.splitlines()[-1]
