"""``mpidp export``: for every preset and the example model files, trained on a built-in
dataset, onnxruntime's outputs on the test rows equal ``mpidp predict``'s (float32 to 1e-5,
float64 to 1e-12, relative to the largest output) with the same labels; refusals are one
line, exit 2, nothing written."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, run_here

from mpidp import nn
from mpidp.cli.main import main
from mpidp.data.partition import split_rows
from mpidp.data.sources import open_source

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

SYNTHETIC = ("--n-samples", "600", "--n-features", "12")
RUNS = {  # name: (train arguments, dataset arguments for predict)
    "linear": (("--model", "linear", "--dataset", "synthetic", *SYNTHETIC),
               ("--dataset", "synthetic", *SYNTHETIC)),
    "logreg": (("--model", "logreg", "--dataset", "digits"), ("--dataset", "digits")),
    "mlp": (("--model", "mlp", "--dataset", "digits", "--standardize"), ("--dataset", "digits")),
    "mlp-float64": (("--model", "mlp", "--dataset", "digits", "--dtype", "float64"),
                    ("--dataset", "digits")),
    "cnn": (("--model", "cnn", "--dataset", "digits"), ("--dataset", "digits")),
    **{f"example-{p.stem}": (("--model", str(p), "--dataset", "digits"), ("--dataset", "digits"))
       for p in sorted((ROOT / "examples" / "models").glob("*.toml"))},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("export")


def _train(folder: Path, name: str, capsys) -> Path:
    """One epoch by one rank in this process (a job of one rank trains the same model)."""
    out = folder / name
    if not (out / "model.npz").exists():
        r = run_here(capsys, "train", *RUNS[name][0], "--epochs", "1", "--no-progress",
                     "--out", str(out))
        assert r.returncode == 0, r.stderr
    return out / "model.npz"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RUNS))
def test_onnxruntime_equals_mpidp_predict_on_the_test_rows(runs, name, capsys):
    """mpidp train and mpidp predict by one rank in this process (tests/cli/test_predict.py
    runs predict in jobs)."""
    model_file = _train(runs, name, capsys)
    onnx_file = runs / f"{name}.onnx"
    assert main(["export", str(model_file), "--format", "onnx", "--out", str(onnx_file)]) == 0
    assert f"wrote {onnx_file}" in capsys.readouterr().out
    want_file = runs / f"{name}.npy"
    data = RUNS[name][1]
    r = run_here(capsys, "predict", "--model", str(model_file), *data, "--rows", "test",
                 "--output", "scores", "--out", str(want_file))
    assert r.returncode == 0, r.stderr
    want = np.load(want_file)
    model = nn.load(model_file)
    sizes = dict(zip(data[2::2], map(int, data[3::2])))
    src = open_source(data[1], n_samples=sizes.get("--n-samples", 60000),
                      n_features=sizes.get("--n-features", 784))
    rows = split_rows(src.n_samples, None, 0, src.fixed_test)[1]
    X = np.asarray(src.read(rows)[0], model.dtype).reshape(len(rows), *model.in_shape)
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": X})[0]
    assert got.dtype == want.dtype == model.dtype
    tol = 1e-12 if model.dtype == np.float64 else 1e-5
    assert np.abs(got - want).max() <= tol * np.abs(want).max()
    if want.shape[1] > 1:
        assert np.array_equal(got.argmax(axis=1), want.argmax(axis=1))


def test_safetensors_from_the_command_line(tmp_path, capsys):
    st = pytest.importorskip("safetensors.numpy")
    model = nn.mlp(4, [3], 2).init_(0)
    model.save(tmp_path / "model.npz")
    out = tmp_path / "m.safetensors"
    assert main(["export", str(tmp_path), "--format", "safetensors", "--out", str(out)]) == 0
    got = st.load_file(str(out))
    assert sorted(got) == ["0.W", "0.b", "2.W", "2.b"]
    assert np.array_equal(got["2.W"], model.layers[2].params["W"])


def _refused(capsys, *argv: str) -> str:
    assert main(["export", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("mpidp: error: ")
    return err


def test_a_sparse_model_is_refused_naming_the_layer(tmp_path, capsys):
    model = nn.Sequential([nn.SparseDense(6, 3), nn.ReLU(), nn.Dense(None, 2)], 6).init_(0)
    model.save(tmp_path / "model.npz")
    out = tmp_path / "m.onnx"
    err = _refused(capsys, str(tmp_path / "model.npz"), "--out", str(out))
    assert "layer 0 (SparseDense" in err and "sparse" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.npz"]


def test_an_unregistered_users_layer_is_refused_naming_the_module_option(tmp_path, capsys):
    mod = tmp_path / "mylayer.py"
    mod.write_text("import mpidp.nn as nn\n\n@nn.register_layer\nclass Twice(nn.Layer):\n"
                   "    def forward(self, x):\n        return 2 * x\n\n"
                   "    def backward(self, dy, accumulate=False, need_input_grad=True):\n"
                   "        return 2 * dy\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import mylayer
        nn.Sequential([nn.Dense(3, 2), mylayer.Twice()], 3).init_(0).save(tmp_path / "m.npz")
        err = _refused(capsys, str(tmp_path / "m.npz"), "--import", str(mod), "--out",
                       str(tmp_path / "m.onnx"))
        assert "layer 1 (Twice())" in err and "register_exporter" in err
    finally:
        sys.path.remove(str(tmp_path))
    assert not (tmp_path / "m.onnx").exists()


def test_a_missing_extra_names_it(tmp_path, capsys, monkeypatch):
    nn.mlp(4, [3], 2).init_(0).save(tmp_path / "model.npz")
    monkeypatch.setitem(sys.modules, "onnx", None)  # import onnx fails
    err = _refused(capsys, str(tmp_path), "--out", str(tmp_path / "m.onnx"))
    assert "onnx package" in err and "mpidp[export]" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.npz"]


def test_a_file_that_is_not_a_model_is_refused(tmp_path, capsys):
    (tmp_path / "x.npz").write_bytes(b"not a zip")
    err = _refused(capsys, str(tmp_path / "x.npz"), "--out", str(tmp_path / "m.onnx"))
    assert "cannot load a saved model" in err


@pytest.mark.parametrize("fmt", ["onnx", "safetensors"])
def test_an_out_that_cannot_be_written_names_the_option_and_the_path(tmp_path, capsys, fmt):
    pytest.importorskip("safetensors")
    nn.mlp(4, [3], 2).init_(0).save(tmp_path / "model.npz")
    for out in (f"/proc/m.{fmt}", str(tmp_path / "missing" / f"m.{fmt}")):
        err = _refused(capsys, str(tmp_path), "--format", fmt, "--out", out)
        assert "--out" in err and out in err and "cannot write" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.npz"]
