"""``mpidp train --model cnn | FILE`` end to end: image data, batch norm's state through
checkpoints, resume and predict, and the modes that refuse a layer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, main_here, parser_refusal, run_here, run_mpi

BN_MODEL = ROOT / "examples" / "models" / "digits-cnn-bn.toml"
SMALL = ["train", "--dataset", "digits", "--batch-size", "32", "--no-progress", "--seed", "1"]


def _saved(out) -> dict:
    with np.load(Path(out) / "model.npz") as z:
        return {k: z[k] for k in z.files}


def test_the_cnn_preset_trains_the_digits_as_images_and_predict_reads_it(tmp_path):
    r = run_mpi(2, *SMALL, "--model", "cnn", "--epochs", "3", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "samples of shape 1x8x8" in r.stdout and "Conv2d(16" in r.stdout
    history = json.loads((tmp_path / "o" / "metrics.json").read_text())["history"]
    assert history[-1]["loss"] < history[0]["loss"] and history[-1]["test_accuracy"] > 0.85
    r = run_mpi(2, "predict", "--model", str(tmp_path / "o"), "--dataset", "digits",
                "--output", "label", "--out", str(tmp_path / "labels.npy"))
    assert r.returncode == 0, r.stderr[-3000:]
    labels = np.load(tmp_path / "labels.npy")
    assert labels.shape == (1797,) and labels.dtype.kind == "i"
    assert float(r.stdout.split("accuracy ")[1].split(",")[0]) > 0.85


@pytest.fixture(scope="module")
def bn_runs(tmp_path_factory):
    """The batch-norm model file, float64, on the first 400 digits (images 1x8x8, every
    class): one epoch on 1 rank and on 2 ranks (with checkpoints), two epochs on 2 ranks,
    and the 2-rank checkpoint resumed to two epochs on 1 rank. The 1-rank runs in this
    process. Their folders by name."""
    from mpidp.data.sources import open_source
    base = tmp_path_factory.mktemp("bn")
    X, y = open_source("digits").read(np.arange(400))
    assert X.shape[1:] == (1, 8, 8) and set(y) == set(range(10))
    np.savez(base / "digits400.npz", X=X, y=y)
    args = ["train", "--dataset", str(base / "digits400.npz"), *SMALL[3:], "--model",
            str(BN_MODEL), "--dtype", "float64"]
    for n, name, more in ((1, "one", ["--epochs", "1"]),
                          (2, "two", ["--epochs", "1", "--checkpoint-dir", str(base / "ck")]),
                          (2, "ref", ["--epochs", "2"]),
                          (1, "resumed", ["--epochs", "2", "--checkpoint-dir", str(base / "ck"),
                                          "--resume"])):
        if n == 1:
            assert main_here(*args, *more, "--out", str(base / name)) == 0, name
        else:
            r = run_mpi(n, *args, *more, "--out", str(base / name))
            assert r.returncode == 0, r.stderr[-3000:]
    return {name: base / name for name in ("one", "two", "ref", "resumed")}


def test_a_model_file_with_batchnorm_and_dropout_is_the_same_at_one_and_two_ranks(bn_runs):
    a, b = _saved(bn_runs["one"]), _saved(bn_runs["two"])
    assert np.max(np.abs(a["params"] - b["params"])) <= 1e-10
    assert a["state"].shape == (2 * (16 + 32),) and np.max(np.abs(a["state"] - b["state"])) <= 1e-10
    spec = json.loads(str(a["spec"]))
    assert spec[0]["in_channels"] == 1 and spec[-1]["n_out"] == 10  # inferred, recorded


def test_batchnorm_statistics_survive_a_checkpoint_and_a_resume_on_other_ranks(bn_runs):
    ref, resumed = _saved(bn_runs["ref"]), _saved(bn_runs["resumed"])
    assert np.max(np.abs(ref["params"] - resumed["params"])) <= 1e-10
    assert np.max(np.abs(ref["state"] - resumed["state"])) <= 1e-10


@pytest.mark.parametrize("mode, message", [
    (["--parallel", "pipeline"], "--parallel pipeline cannot train a model with BatchNorm"),
    (["--parallel", "hybrid"], "--parallel hybrid cannot train a model with BatchNorm"),
    (["--sync", "local-sgd"], "--sync local-sgd cannot train a model with BatchNorm"),
    (["--sync", "async-ps"], "--sync async-ps cannot train a model with BatchNorm"),
])
def test_a_mode_that_cannot_train_a_layer_refuses_it_before_any_work(tmp_path, capsys, mode,
                                                                    message):
    """async-ps by a job of 2 ranks (it needs 2); the others in this process."""
    run = (lambda *a: run_mpi(2, *a)) if "async-ps" in mode else (lambda *a: run_here(capsys, *a))
    r = run(*SMALL, "--model", str(BN_MODEL), *mode, "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr[-3000:]
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("mpidp: error:")]
    assert len(line) == 1 and message in line[0] and str(BN_MODEL) in line[0], r.stderr
    assert "data:" not in r.stdout and not (tmp_path / "o").exists()


def test_a_bad_model_file_and_a_bad_model_name_are_one_line_each(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[layers]]\ntype = 'Conv2d'\nout_chanels = 4\nkernel = 3\n")
    r = run_mpi(2, *SMALL, "--model", str(bad), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "layer 1 (Conv2d): unknown setting 'out_chanels'" in r.stderr
    assert r.stderr.count("mpidp: error:") == 1
    err = parser_refusal(capsys, *SMALL, "--model", "resnet", "--out", str(tmp_path / "o"))
    assert err is not None and "'resnet' is neither a preset" in err


def test_an_embedding_model_trains_on_token_ids_and_refuses_other_data(tmp_path, capsys):
    rng = np.random.default_rng(0)
    X = rng.integers(0, 20, (400, 6))
    np.savez(tmp_path / "tokens.npz", X=X, y=(X[:, 0] >= 10).astype(np.int64))
    model = tmp_path / "emb.toml"
    model.write_text("[[layers]]\ntype = 'Embedding'\nn_tokens = 20\ndim = 4\n"
                     "[[layers]]\ntype = 'Flatten'\n[[layers]]\ntype = 'Dense'\n")
    r = run_mpi(2, "train", "--dataset", str(tmp_path / "tokens.npz"), "--model", str(model),
                "--epochs", "8", "--lr", "0.1", "--no-progress", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr[-3000:]
    history = json.loads((tmp_path / "o" / "metrics.json").read_text())["history"]
    assert history[-1]["test_accuracy"] > 0.9, history[-1]
    r = run_here(capsys, *SMALL, "--model", str(model), "--out", str(tmp_path / "p"))
    assert r.returncode == 2 and r.stderr.count("mpidp: error:") == 1, r.stderr[-3000:]
    assert "does not suit --model" in r.stderr and "not a whole number in [0, 20)" in r.stderr


def test_a_model_whose_shapes_do_not_fit_the_data_names_the_layer(tmp_path):
    model = tmp_path / "conv.toml"
    model.write_text("[[layers]]\ntype = 'Conv1d'\nout_channels = 4\nkernel = 3\n"
                     "[[layers]]\ntype = 'Flatten'\n[[layers]]\ntype = 'Dense'\n")
    r = run_mpi(2, *SMALL, "--model", str(model), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.count("mpidp: error:") == 1, r.stderr[-3000:]
    assert f"--model {model}: layer shapes do not chain: layer 0 (Conv1d" in r.stderr
    assert "samples of shape (1, 8, 8)" in r.stderr


def test_a_model_file_with_fewer_outputs_than_the_data_needs_is_refused(tmp_path, capsys):
    """It used to train, then fail at the first label beyond its outputs (a traceback)."""
    model = tmp_path / "few.toml"
    model.write_text("[[layers]]\ntype = 'Flatten'\n[[layers]]\ntype = 'Dense'\nn_out = 5\n")
    r = run_here(capsys, *SMALL, "--model", str(model), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.count("mpidp: error:") == 1, r.stderr[-3000:]
    assert "gives outputs of shape (5,) per sample, but the data needs" in r.stderr
    assert not (tmp_path / "o").exists()


def _file(tmp_path, first: str) -> Path:
    path = tmp_path / f"{first}.toml"
    path.write_text(f'[[layers]]\ntype = "{first}"\nn_in = 64\nn_out = 10\n')
    return path


BOW = ["--dataset", "bow", "--n-samples", "200", "--n-features", "64"]


@pytest.mark.parametrize("first, data, message", [
    ("SparseDense", ["--dataset", "digits"], "its first layer, SparseDense, takes sparse (CSR) "
     "rows, and the dataset's rows are dense arrays"),
    ("Dense", BOW, "the dataset's rows are sparse (CSR), and only a first SparseDense layer "
     "takes them (this model's first layer is Dense)"),
])
def test_a_model_file_whose_first_layer_cannot_take_the_rows_is_refused(tmp_path, capsys, first,
                                                                         data, message):
    """Both used to end in a traceback inside the first forward pass."""
    r = run_here(capsys, "train", "--model", str(_file(tmp_path, first)), *data, "--epochs", "1",
                "--no-progress", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "o").exists()


def test_predict_refuses_rows_of_the_other_kind_before_any_output(tmp_path, capsys):
    """A model trained on sparse rows meets dense ones (a job of 2 ranks), and a dense model
    sparse ones (in this process). Both models are trained in this process."""
    sparse, dense = tmp_path / "sparse", tmp_path / "dense"
    for out, data in ((sparse, BOW), (dense, ["--dataset", "synthetic", "--n-samples", "200",
                                              "--n-features", "64"])):
        assert main_here("train", *data, "--epochs", "1", "--no-progress", "--out", str(out)) == 0
    for run, model, data, message in (
            (lambda *a: run_mpi(2, *a), sparse,
             ["--dataset", "synthetic", "--n-features", "64", "--n-samples", "50"],
             "takes sparse (CSR) rows, and the dataset's rows are dense"),
            (lambda *a: run_here(capsys, *a), dense,
             ["--dataset", "bow", "--n-features", "64", "--n-samples", "50"],
             "the dataset's rows are sparse (CSR)")):
        r = run("predict", "--model", str(model), *data, "--out", str(tmp_path / "p.npy"))
        assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, \
            r.stderr[-2000:]
        assert not (tmp_path / "p.npy").exists()


@pytest.mark.parametrize("layers, data, extra, message", [
    ("[[layers]]\ntype = 'Dense'\nn_out = 6\n[[layers]]\ntype = 'Embedding'\nn_tokens = 20\n"
     "dim = 4\n[[layers]]\ntype = 'Flatten'\n[[layers]]\ntype = 'Dense'\n", 20, [],
     "layer 1 (Embedding(20, 4)) reads token ids from the data set itself, so it must be the "
     "first layer"),
    ("[[layers]]\ntype = 'Embedding'\nn_tokens = 20\ndim = 4\n[[layers]]\ntype = 'Flatten'\n"
     "[[layers]]\ntype = 'Dense'\n", 20, ["--standardize"],
     "--standardize does not apply to this model: its first layer Embedding(20, 4) reads token "
     "ids"),
    ("[[layers]]\ntype = 'Embedding'\nn_tokens = 33554432\ndim = 1\n[[layers]]\n"
     "type = 'Flatten'\n[[layers]]\ntype = 'Dense'\n", 2**25, [],
     "token ids above 2**24 in float32, which cannot hold every whole number there, so "
     "neighbouring ids merge: use --dtype float64"),
    ("[[layers]]\ntype = 'SparseDense'\nn_out = 4\n[[layers]]\ntype = 'Dense'\n", 20, [],
     "its first layer, SparseDense, takes sparse (CSR) rows, and the dataset's rows are dense"),
])
def test_a_model_that_cannot_read_the_data_is_one_line_before_any_step(tmp_path, capsys, layers,
                                                                       data, extra, message):
    """Each used to train into a traceback from every rank (or merge ids silently)."""
    X = np.random.default_rng(0).integers(0, data, (60, 6))
    np.savez(tmp_path / "tokens.npz", X=X, y=(X[:, 0] % 2).astype(np.int64))
    (tmp_path / "m.toml").write_text(layers)
    r = run_here(capsys, "train", "--dataset", str(tmp_path / "tokens.npz"), "--model",
              str(tmp_path / "m.toml"), *extra, "--no-progress", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.count("mpidp: error:") == 1, r.stderr[-3000:]
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]


def test_blocks_nested_thousands_deep_are_one_line(tmp_path, capsys):
    inner = '{"type": "ReLU"}'
    for _ in range(5000):
        inner = f'{{"type": "Residual", "layers": [{inner}]}}'
    (tmp_path / "deep.json").write_text(f'[{{"type": "Flatten"}}, {inner}, {{"type": "Dense"}}]')
    r = run_here(capsys, *SMALL, "--model", str(tmp_path / "deep.json"), "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and r.stderr.count("mpidp: error:") == 1, r.stderr[-3000:]
    assert "nested too deep to read (blocks may nest at most 64 deep)" in r.stderr
