"""Models without code: presets by name and model files (TOML, JSON), good and bad."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpidp import nn
from mpidp.nn.modelfile import layers_from, read_model_file

TOML = """
[[layers]]
type = "Conv1d"
out_channels = 4
kernel = 3
padding = 1

[[layers]]
type = "BatchNorm"

[[layers]]
type = "ReLU"

[[layers]]
type = "Flatten"

[[layers]]
type = "Residual"
layers = [{type = "Dense", n_out = 24}, {type = "Tanh"}]

[[layers]]
type = "Dense"
"""


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_a_toml_model_file_builds_with_inferred_sizes_and_the_data_sets_outputs(tmp_path):
    layers, loss = nn.model_layers(_write(tmp_path, "m.toml", TOML), (2, 6), 5)
    model = nn.Sequential(layers, (2, 6), np.float64).init_(0)
    assert model.out_shape == (5,) and isinstance(loss, nn.SoftmaxCrossEntropy)
    assert model.layers[0].in_channels == 2 and model.layers[-1].n_in == 24
    assert model.n_params == (4 * 2 * 3 + 4) + 2 * 4 + (24 * 24 + 24) + (24 * 5 + 5)
    assert model.n_state == 2 * 4  # the batch norm's running mean and variance
    assert model.forward(np.ones((3, 2, 6))).shape == (3, 5)


def test_the_same_model_from_json_and_its_saved_spec_rebuilds_it(tmp_path):
    import tomllib
    doc = tomllib.loads(TOML)
    a = nn.Sequential(nn.model_layers(_write(tmp_path, "m.json", json.dumps(doc)), (2, 6), 5)[0],
                      (2, 6), np.float64).init_(1)
    b = nn.Sequential(layers_from(doc["layers"], 5), (2, 6), np.float64).init_(1)
    assert np.array_equal(a.params, b.params) and a.spec() == b.spec()
    path = nn.save(a, tmp_path / "model.npz")
    again = nn.load(path)  # no model file needed: the spec holds every setting
    x = np.random.default_rng(0).standard_normal((4, 2, 6))
    assert np.array_equal(again.predict(x), a.predict(x))


@pytest.mark.parametrize("text, message", [
    ("[[layers]]\ntype = 'Dense'\nn_out = 3 4\n", "line 3"),  # a syntax error names the line
    ("[[layers]]\ntype = 'Conv9d'\n", "layer 1: the model spec names layer class 'Conv9d'"),
    ("[[layers]]\ntype = 'Conv1d'\nkernal = 3\nout_channels = 2\n",
     "layer 1 (Conv1d): unknown setting 'kernal'"),
    ("[[layers]]\ntype = 'Conv1d'\nkernel = 3\n", "layer 1 (Conv1d): missing setting 'out_channels'"),
    ("[[layers]]\ntype = 'Dropout'\nrate = 1.5\n", "layer 1 (Dropout)"),
    ("[[layers]]\nn_out = 3\n", "layer 1 needs a 'type' string"),
    ("title = 'x'\n", "unknown key(s) 'title'"),
    ("", "needs a non-empty list of layers"),
])
def test_a_bad_model_file_is_one_error_naming_the_line_or_the_layer_and_key(tmp_path, text,
                                                                             message):
    path = _write(tmp_path, "bad.toml", text)
    with pytest.raises(ValueError, match="bad.toml") as err:
        nn.model_layers(path, (3,), 2)
    assert message in str(err.value)


def test_a_bad_json_file_and_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"bad.json: .*line 1 column"):
        read_model_file(_write(tmp_path, "bad.json", "[{\"type\": \"Dense\",]"))
    with pytest.raises(ValueError, match="cannot read it"):
        read_model_file(tmp_path / "none.toml")


def test_shapes_that_do_not_chain_name_the_layer(tmp_path):
    path = _write(tmp_path, "m.toml", "[[layers]]\ntype = 'Conv2d'\nout_channels = 2\nkernel = 3\n")
    layers, _ = nn.model_layers(path, (7,), 2)
    with pytest.raises(ValueError, match=r"layer 0 \(Conv2d.*gets 7 features"):
        nn.Sequential(layers, (7,), np.float64)


@pytest.mark.parametrize("shape", [(1, 40), (1, 8, 8), (3, 28, 28)])
def test_the_cnn_preset_takes_signals_and_images(shape):
    model, loss = nn.build("cnn", shape, 10, dtype=np.float64)
    model.init_(0)
    assert model.forward(np.zeros((2, *shape))).shape == (2, 10)
    assert nn.default_epochs("cnn") == 20 and nn.default_epochs("mlp") == 10


def test_the_cnn_preset_refuses_flat_features_and_mlp_flattens_images():
    with pytest.raises(ValueError, match="model 'cnn' needs samples shaped"):
        nn.build("cnn", 64, 10)
    model, _ = nn.build("mlp", (1, 8, 8), 10, hidden=(16,))
    assert type(model.layers[0]).__name__ == "Flatten" and model.n_in == 64
