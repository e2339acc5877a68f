"""``--import MODULE``: a user's layer, registered by their own module, named in a ``--model``
file for ``mpidp train`` and rebuilt by ``mpidp predict``; a module that cannot be imported,
and a layer no imported module registers, are one error line each."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import numpy as np
import pytest
from helpers import run_here, run_mpi

from mpidp import nn
from mpidp.data.sources import open_source
from mpidp.nn import layers

#: A scaled leaky ReLU, registered under a name of its own (not its class name).
LAYERS = '''
import numpy as np
from mpidp import nn


@nn.register_layer(name="ScaledLeaky")
class ScaledLeakyReLU(nn.Layer):
    """scale * max(x, slope * x)."""

    def __init__(self, slope: float = 0.01, scale: float = 1.0) -> None:
        super().__init__()
        self.slope, self.scale = slope, scale

    def config(self) -> dict:
        return {"slope": self.slope, "scale": self.scale}

    def forward(self, x):
        self.mask = x > 0
        return self.scale * np.where(self.mask, x, self.slope * x)

    def backward(self, dy, accumulate=False, need_input_grad=True):
        if not need_input_grad:
            return None
        return self.scale * np.where(self.mask, dy, self.slope * dy)
'''

MODEL = '''
[[layers]]
type = "Flatten"

[[layers]]
type = "Dense"
n_out = 16

[[layers]]
type = "ScaledLeaky"
slope = 0.2
scale = 0.5

[[layers]]
type = "Dense"
'''

TRAIN = ["train", "--dataset", "digits", "--epochs", "2", "--no-progress", "-q"]


def _one_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith("mpidp: error: "), lines
    return lines[0][len("mpidp: error: "):]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A folder with the user's module (cilayers.py) and a model file that names its layer."""
    here = tmp_path_factory.mktemp("user")
    (here / "cilayers.py").write_text(LAYERS)
    (here / "net.toml").write_text(MODEL)
    return here


def _user_module(folder):
    """The user's module, imported in this process (under a name of the test's own)."""
    spec = importlib.util.spec_from_file_location("_test_cli_imports_layers",
                                                  folder / "cilayers.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_a_layer_of_the_users_module_trains_reloads_and_predicts(folder, capsys, monkeypatch):
    """Train, predict and train again from the recorded configuration by jobs of 2 ranks;
    predict without the module in this process (before the module is imported here)."""
    out = folder / "run"
    r = run_mpi(2, *TRAIN, "--model", str(folder / "net.toml"), "--import", "cilayers.py",
                "--out", str(out), cwd=folder)  # relative: recorded as an absolute path
    assert r.returncode == 0, r.stderr[-3000:]
    saved = json.loads(str(np.load(out / "model.npz")["spec"]))
    assert [d["type"] for d in saved] == ["Flatten", "Dense", "ScaledLeaky", "Dense"]
    assert saved[2]["scale"] == 0.5 and saved[2]["slope"] == 0.2
    assert 'import = ["' + str(folder / "cilayers.py") + '"]' in (out / "config.toml").read_text()

    # predict: the module by its dotted name, from the current folder
    labels = folder / "labels.npy"
    r = run_mpi(2, "predict", "--model", str(out), "--dataset", "digits", "--import",
                "cilayers", "--output", "label", "--out", str(labels), cwd=folder)
    assert r.returncode == 0, r.stderr[-3000:]

    # without the module, predict names the class and --import, not a damaged file
    r = run_here(capsys, "predict", "--model", str(out), "--dataset", "digits", "--out",
                 str(folder / "none.npy"))
    assert r.returncode == 2
    line = _one_error(r.stderr)
    assert line == (f"--model {str(out / 'model.npz')!r} uses layer class 'ScaledLeaky', which "
                    f"is not registered: pass the module that registers it with --import MODULE")
    assert not (folder / "none.npy").exists()

    for registry in ("_CLASSES", "_NAMES"):  # the layer registered here is this test's only
        monkeypatch.setattr(layers, registry, dict(getattr(layers, registry)))
    _user_module(folder)
    model = nn.load(out / "model.npz")
    X, _ = open_source("digits").read(np.arange(1797))
    scores = model.forward(np.asarray(X, model.dtype))
    assert scores.shape == (1797, 10)
    assert np.array_equal(np.load(labels), scores.argmax(axis=1))

    # the recorded configuration imports the module again: the same model, bit for bit
    again = folder / "again"
    r = run_mpi(2, "train", "--config", str(out / "config.toml"), "--out", str(again), "-q")
    assert r.returncode == 0, r.stderr[-3000:]
    assert np.load(again / "model.npz")["params"].tobytes() == \
        np.load(out / "model.npz")["params"].tobytes()


@pytest.mark.parametrize("command", ["train", "predict"])
def test_a_module_that_cannot_be_imported_is_one_line_before_any_data(tmp_path, capsys, command):
    """Predict (no model, no data: the import comes first) by a job of 2 ranks; train, whose
    import runs the same way, in this process."""
    argv = (TRAIN if command == "train" else
            ["predict", "--model", str(tmp_path / "m"), "--dataset", str(tmp_path / "no-data")])
    argv = [*argv, "--import", "no_such_module_here", "--out", str(tmp_path / "o")]
    r = run_mpi(2, *argv) if command == "predict" else run_here(capsys, *argv)
    assert r.returncode == 2, r.stderr[-2000:]
    assert _one_error(r.stderr) == ("--import no_such_module_here: cannot import it "
                                    "(ModuleNotFoundError: No module named "
                                    "'no_such_module_here')")
    assert not (tmp_path / "o").exists()


def test_import_names_the_module_and_why(tmp_path):
    from mpidp.cli.imports import import_modules
    (tmp_path / "broken_layers.py").write_text("x = 1\nraise RuntimeError('no GPU here')\n")
    with pytest.raises(ValueError) as err:
        import_modules([str(tmp_path / "broken_layers.py")])
    assert str(err.value) == (f"--import {tmp_path / 'broken_layers.py'}: cannot import it "
                              f"(RuntimeError: no GPU here)")
    assert "broken_layers" not in sys.modules  # a failed import leaves nothing behind
    with pytest.raises(ValueError, match=r"^--import nowhere/x\.py: cannot import it \(no such "
                       r"file\)$"):
        import_modules(["nowhere/x.py"])
    (tmp_path / "bad_syntax.py").write_text("def (:\n")
    with pytest.raises(ValueError, match=r"^--import .*bad_syntax\.py: cannot import it "
                       r"\(SyntaxError: "):
        import_modules([str(tmp_path / "bad_syntax.py")])


def test_train_names_an_unregistered_layer_of_a_model_file_and_import(tmp_path):
    from mpidp.cli.model import check_model_file
    path = tmp_path / "net.toml"
    path.write_text(MODEL.replace("ScaledLeaky", "NoSuchLayerAnywhere"))
    args = argparse.Namespace(model=str(path), parallel="data", sync="allreduce")
    with pytest.raises(ValueError) as err:
        check_model_file(args)
    assert str(err.value) == (f"--model {path}: layer class 'NoSuchLayerAnywhere' is not "
                              f"registered: pass the module that registers it with --import "
                              f"MODULE")


def test_predict_names_import_for_an_unregistered_class_and_the_file_otherwise(tmp_path):
    from mpidp.cli.predict import _open_model
    model = nn.Sequential([nn.Dense(4, 3), nn.ReLU(), nn.Dense(3, 2)], 4).init_(0)
    path = tmp_path / "model.npz"
    spec = model.spec()
    spec[1]["type"] = "NoSuchLayerAnywhere"
    np.savez(path, params=model.params, spec=json.dumps(spec), dtype=str(model.dtype))
    with pytest.raises(ValueError) as err:
        _open_model(str(tmp_path))
    assert str(err.value) == (f"--model {str(path)!r} uses layer class 'NoSuchLayerAnywhere', "
                              f"which is not registered: pass the module that registers it "
                              f"with --import MODULE")
    np.savez(path, params=model.params[:-1], spec=json.dumps(model.spec()),
             dtype=str(model.dtype))  # a file that is wrong: the file is what to fix
    with pytest.raises(ValueError) as err:
        _open_model(str(path))
    assert str(err.value).endswith("give the model.npz that 'mpidp train' wrote, or its folder")


def test_a_mistyped_layer_name_is_told_the_registered_one_it_looks_like(tmp_path):
    from mpidp.cli.model import check_model_file
    path = tmp_path / "net.toml"
    path.write_text("[[layers]]\ntype = 'Flatten'\n[[layers]]\ntype = 'Densee'\n")
    args = argparse.Namespace(model=str(path), parallel="data", sync="allreduce")
    with pytest.raises(ValueError, match=r"'Densee' is not registered: pass the module that "
                                         r"registers it with --import MODULE \(did you mean "
                                         r"'Dense'\?\)$"):
        check_model_file(args)


@pytest.mark.parametrize("name, guess", [("relu", "ReLU"), ("Conv2D", "Conv2d"), ("Layer", None),
                                         ("NoSuchLayerAnywhere", None)])
def test_the_guess_ignores_case_and_stays_quiet_when_nothing_is_close(name, guess):
    from mpidp.cli.imports import near
    assert near(name) == (f" (did you mean {guess!r}?)" if guess else "")
