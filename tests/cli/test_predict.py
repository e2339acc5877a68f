"""``mpidp predict --output`` writes scores, probabilities or labels, and the library's
``Sequential.predict`` gives the same."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import parser_refusal, run_here, run_mpi

from mpidp import nn
from mpidp.data.sources import open_source


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    r = run_mpi(2, "train", "--dataset", "digits", "--epochs", "2", "--out", str(out / "m"))
    assert r.returncode == 0, r.stderr
    return out


@pytest.mark.slow
def test_each_output_kind_from_the_command_line_and_the_library(trained, capsys):
    """Scores by a job of 2 ranks (each predicts its block, rank 0 writes them all); the
    probabilities and labels, which differ only in the last step, by one rank in this process."""
    got = {}
    for kind in ("scores", "proba", "label"):
        path = trained / f"{kind}.npy"
        argv = ("predict", "--model", str(trained / "m"), "--dataset", "digits",
                "--output", kind, "--out", str(path))
        r = run_mpi(2, *argv) if kind == "scores" else run_here(capsys, *argv)
        assert r.returncode == 0, r.stderr
        got[kind] = np.load(path)
    scores, proba, label = got["scores"], got["proba"], got["label"]
    assert scores.shape == proba.shape == (1797, 10) and label.shape == (1797,)
    assert label.dtype == np.int64 and np.array_equal(label, scores.argmax(1))
    assert np.allclose(proba.sum(1), 1) and np.array_equal(proba.argmax(1), label)
    model = nn.load(str(trained / "m"))
    X, _ = open_source("digits").read(np.arange(1797))
    X = np.asarray(X, model.dtype)
    assert np.allclose(model.predict(X, "proba"), proba, rtol=1e-5, atol=1e-6)
    assert np.array_equal(model.predict(X, "label"), label)


@pytest.mark.slow
def test_probabilities_of_a_regression_are_refused(tmp_path, capsys):
    """The regression model trained by one rank in this process; the refusal by a job."""
    r = run_here(capsys, "train", "--dataset", "synthetic", "--model", "linear", "--n-samples",
                 "500", "--n-features", "8", "--epochs", "1", "--no-progress",
                 "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    r = run_mpi(2, "predict", "--model", str(tmp_path / "m"), "--dataset", "synthetic",
                "--n-samples", "500", "--n-features", "8", "--output", "label",
                "--out", str(tmp_path / "p.npy"))
    assert r.returncode == 2 and "--output label needs a classifier" in r.stderr, r.stderr
    assert not (tmp_path / "p.npy").exists()


def test_metrics_written_over_the_predictions_are_refused(trained, tmp_path):
    path = tmp_path / "p.npy"
    r = run_mpi(2, "predict", "--model", str(trained / "m"), "--dataset", "digits",
                "--out", str(path), "--metrics", f"{tmp_path}/./p.npy")
    assert r.returncode == 2 and "is the --out file" in r.stderr, r.stderr
    assert not path.exists()


@pytest.mark.parametrize("argv", [
    ["train", "--out", ""], ["train", "--checkpoint-dir", ""], ["train", "--tensorboard", ""],
    ["train", "--trace", ""], ["train", "--config", ""], ["model", "--out", ""],
    ["predict", "--model", "m", "--out", ""], ["predict", "--model", "m", "--out", "p.npy",
                                               "--metrics", ""],
])
def test_an_empty_path_is_refused_before_any_work(argv, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = parser_refusal(capsys, *argv)
    assert err is not None and "is empty: give a path" in err, err
    assert list(tmp_path.iterdir()) == []


def test_labels_the_model_cannot_score_are_refused_before_any_output(trained, tmp_path):
    """Digits' labels reach 9; data labelled up to 19 used to be predicted and written, then
    the figures failed with a traceback (exit 1)."""
    rng = np.random.default_rng(0)
    data = tmp_path / "wide.npz"
    np.savez(data, X=rng.random((60, 1, 8, 8)), y=rng.integers(0, 20, 60))
    path = tmp_path / "p.npy"
    r = run_mpi(2, "predict", "--model", str(trained / "m"), "--dataset", str(data),
                "--out", str(path))
    assert r.returncode == 2 and "labels do not suit the model" in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("mpidp: error:") == 1 and sorted(tmp_path.iterdir()) == [data]


@pytest.mark.parametrize("extra, message", [
    (["--partition", "cyclic", "--dynamic"], "--partition cyclic does not apply with --dynamic"),
    (["--test-fraction", "0.2"], "--test-fraction needs --rows test"),
    (["--partition", "weighted"], "invalid choice: 'weighted'"),
    (["--seed", "3"], "--seed does not apply to --dataset digits with --rows all"),
    (["--n-samples", "100"], "--n-samples does not apply to --dataset digits"),
    (["--n-features", "9", "--n-samples", "9"],
     "--n-samples and --n-features do not apply to --dataset digits"),
    (["--chunk-size", "64"], "--chunk-size needs --dynamic"),
    (["--chunk-size", "512"], "--chunk-size needs --dynamic"),  # typed: at its default too
    (["--seed", "0"], "--seed does not apply to --dataset digits with --rows all"),
    (["--chunk-size", "0", "--dynamic"], "--chunk-size: must be an integer >= 1, got 0"),
    (["--watchdog", "0", "--watchdog-grace", "2"], "--watchdog-grace needs the watchdog"),
    (["--watchdog-grace", "0"], "--watchdog-grace: must be a finite number > 0, got 0"),
])
def test_predict_options_that_would_do_nothing_are_refused(trained, tmp_path, capsys, extra,
                                                          message):
    """Refused by the parser (in this process), else by the ranks, each alike from the same
    arguments (mpidp.cli.predict.problems) before any work: the first of those by a job of
    2 ranks (one message, exit 2), the others by one rank in this process."""
    argv = ["predict", "--model", str(trained / "m"), "--dataset", "digits", "--out",
            str(tmp_path / "p.npy"), *extra]
    err = parser_refusal(capsys, *argv)
    if err is not None:
        assert message in err and not (tmp_path / "p.npy").exists(), err
        return
    job = extra == ["--partition", "cyclic", "--dynamic"]
    r = run_mpi(2, *argv) if job else run_here(capsys, *argv)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("mpidp: error:") == 1, r.stderr[-2000:]
    assert not (tmp_path / "p.npy").exists()


def test_metrics_of_a_classifier_on_real_valued_targets_are_refused(trained, tmp_path):
    """They were skipped in silence: exit 0 and no metrics file."""
    rng = np.random.default_rng(1)
    data = tmp_path / "reg.npz"
    np.savez(data, X=rng.random((40, 1, 8, 8)), y=rng.standard_normal(40))
    r = run_mpi(2, "predict", "--model", str(trained / "m"), "--dataset", str(data),
                "--out", str(tmp_path / "p.npy"), "--metrics", str(tmp_path / "m.json"))
    assert r.returncode == 2 and "holds real-valued targets, not class labels" in r.stderr
    assert sorted(tmp_path.iterdir()) == [data]


def test_a_seed_for_the_held_out_rows_of_a_dataset_with_its_own_test_set_is_refused():
    """``--rows test`` on a dataset with a fixed test set (MNIST-1D's) takes those rows:
    a typed --seed would seed nothing, unless --test-fraction asks for a seeded split."""
    from types import SimpleNamespace

    from mpidp.cli.predict import _seed_problem
    own, none = SimpleNamespace(fixed_test=40), SimpleNamespace(fixed_test=None)
    args = SimpleNamespace(dataset="mnist1d", rows="test", test_fraction=None)
    assert "its test rows are its own" in _seed_problem(args, {"seed"}, own)
    assert _seed_problem(args, set(), own) is None  # not typed
    assert _seed_problem(args, {"seed"}, none) is None  # a seeded split of its rows
    args.test_fraction = 0.3
    assert _seed_problem(args, {"seed", "test_fraction"}, own) is None


def test_a_file_that_is_not_a_saved_model_is_named_so_not_unpickled(tmp_path, capsys):
    """A model file, or any text, as --model (or --costs) used to get NumPy's advice to
    load it with allow_pickle. The model file by a job of 2 ranks (rank 0 alone speaks);
    the text as --model and as --costs (refusals agreed on by the ranks alike) by one rank
    in this process."""
    (tmp_path / "m.toml").write_text("[[layers]]\ntype = 'Dense'\n")
    (tmp_path / "notes.npz").write_text("hello\n")
    for path, says in ((tmp_path / "m.toml", "is a model file (layers without trained "
                        "parameters): give the model.npz that 'mpidp train' wrote from it"),
                       (tmp_path / "notes.npz", "not a .npz archive (nor any NumPy file")):
        argv = ("predict", "--model", str(path), "--dataset", "digits", "--out",
                str(tmp_path / "p.npy"))
        r = run_mpi(2, *argv) if path.suffix == ".toml" else run_here(capsys, *argv)
        assert r.returncode == 2 and r.stderr.count("mpidp: error:") == 1, r.stderr[-2000:]
        assert says in r.stderr and "pickle" not in r.stderr, r.stderr[-2000:]
    r = run_here(capsys, "train", "--dataset", "digits", "--partition", "cost", "--costs",
                 str(tmp_path / "notes.npz"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "is not a .npy file: give one cost per dataset row" in r.stderr
    assert "pickle" not in r.stderr, r.stderr[-2000:]


def test_token_ids_a_model_cannot_take_are_called_rows_not_labels(tmp_path, capsys):
    """The model trained by one rank in this process; the refusal by a job of 2 ranks."""
    X = np.random.default_rng(0).integers(0, 20, (60, 6))
    np.savez(tmp_path / "tokens.npz", X=X, y=(X[:, 0] >= 10).astype(np.int64))
    (tmp_path / "emb.toml").write_text("[[layers]]\ntype = 'Embedding'\nn_tokens = 20\n"
                                       "dim = 4\n[[layers]]\ntype = 'Flatten'\n"
                                       "[[layers]]\ntype = 'Dense'\n")
    r = run_here(capsys, "train", "--dataset", str(tmp_path / "tokens.npz"), "--model",
                 str(tmp_path / "emb.toml"), "--epochs", "1", "--no-progress",
                 "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr[-2000:]
    np.savez(tmp_path / "bad.npz", X=np.full((40, 6), 25), y=np.zeros(40, np.int64))
    r = run_mpi(2, "predict", "--model", str(tmp_path / "o"), "--dataset",
                str(tmp_path / "bad.npz"), "--out", str(tmp_path / "p.npy"))
    assert r.returncode == 2 and r.stderr.count("mpidp: error:") == 1, r.stderr[-2000:]
    assert "the dataset's rows do not suit the model (Embedding(20, 4): token id 25" in r.stderr
    assert "labels" not in r.stderr and not (tmp_path / "p.npy").exists()
