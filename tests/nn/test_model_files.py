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


@pytest.mark.parametrize("first, late", [
    (nn.Dense(None, 6), nn.Embedding(20, 4)),
    (nn.Standardize(), nn.Embedding(20, 4)),
    (nn.Flatten(), nn.SparseDense(6, 4)),
])
def test_a_layer_that_reads_the_data_itself_must_come_first(first, late):
    """An Embedding after a Dense used to fail at the first step on "token id -10.64"."""
    with pytest.raises(ValueError, match=rf"layer 1 \({type(late).__name__}.*reads "
                                         rf".* so it must be the first layer; here "
                                         rf"{type(first).__name__}"):
        nn.Sequential([first, late, nn.Flatten()], 6)
    with pytest.raises(ValueError, match="can only be a model's first layer"):
        nn.Residual([late])


def test_a_sparse_dense_infers_its_width_like_a_dense(tmp_path):
    path = _write(tmp_path, "s.toml", "[[layers]]\ntype = 'SparseDense'\nn_out = 4\n"
                                      "[[layers]]\ntype = 'Dense'\n")
    layers, _ = nn.model_layers(path, (9,), 2, sparse=True)
    assert nn.Sequential(layers, 9).layers[0].n_in == 9
    with pytest.raises(ValueError, match="takes sparse \\(CSR\\) rows, and the dataset's rows "
                                         "are dense"):  # was: '<' not supported ... NoneType
        nn.model_layers(path, (9,), 2, sparse=False)


def test_float_token_ids_beyond_the_dtypes_whole_numbers_are_refused():
    """In float32 2**24 + 1 reads as 2**24: ids there would merge silently."""
    emb = nn.Embedding(2**25, 2)
    with pytest.raises(ValueError, match=r"token ids above 2\*\*24 in float32.*merge: use "
                                         r"dtype='float64'"):
        emb.token_ids(np.array([[3, 2**24 + 2]], np.float32))
    assert emb.token_ids(np.array([[3, 2**24 + 1]], np.float64))[0, 1] == 2**24 + 1
    assert emb.token_ids(np.array([[3, 2**24 - 1]], np.float32))[0, 1] == 2**24 - 1


def test_a_float32_token_id_of_2_to_the_24_is_refused_as_it_may_be_the_next_one_rounded():
    """2**24 + 1 in a float64 file is 2**24 once cast to float32: the cast merged two ids."""
    emb = nn.Embedding(2**25, 2)
    cast = np.array([[3, 2**24 + 1]], np.float64).astype(np.float32)
    with pytest.raises(ValueError, match=r"token ids above 2\*\*24 in float32"):
        emb.token_ids(cast)


def _nested(depth: int) -> str:
    """JSON of a Residual ``depth`` blocks deep around a ReLU, after a Flatten."""
    inner = '{"type": "ReLU"}'
    for _ in range(depth):
        inner = f'{{"type": "Residual", "layers": [{inner}]}}'
    return f'[{{"type": "Flatten"}}, {inner}, {{"type": "Dense"}}]'


@pytest.mark.parametrize("depth, message", [
    (65, "blocks nested 65 deep; they may nest at most 64 deep"),
    (300, "blocks nested 300 deep"),
    (900, "nested too deep to read"),
    (5000, "nested too deep to read"),
])
def test_blocks_nested_too_deep_are_one_error_not_a_recursion_error(tmp_path, depth, message):
    path = _write(tmp_path, "deep.json", _nested(depth))
    with pytest.raises(ValueError, match="deep.json") as err:
        nn.model_layers(path, (4,), 2)
    assert message in str(err.value)
    block = nn.ReLU()
    for _ in range(64):
        block = nn.Residual([block])
    with pytest.raises(ValueError, match="Residual: blocks nested 65 deep"):
        nn.Residual([block])


def test_blocks_nested_as_deep_as_allowed_train_save_and_load(tmp_path):
    layers, _ = nn.model_layers(_write(tmp_path, "deep.json", _nested(64)), (4,), 2)
    model = nn.Sequential(layers, 4, np.float64).init_(0)
    model.backward(np.ones_like(model.forward(np.ones((3, 4)))))
    assert nn.load(nn.save(model, tmp_path / "model.npz")).spec() == model.spec()


@pytest.mark.parametrize("text, key", [
    ('[{"type": "Flatten"}, {"type": "Dense", "n_out": 3, "n_out": 10}]', "n_out"),
    ('[{"type": "Flatten"}, {"type": "Dense", "type": "ReLU"}]', "type"),
])
def test_a_key_given_twice_in_a_json_model_file_is_refused_as_in_toml(tmp_path, text, key):
    """JSON would keep the last value silently; TOML refuses a key given twice."""
    path = _write(tmp_path, "twice.json", text)
    with pytest.raises(ValueError, match=f"twice.json: key '{key}' given twice"):
        read_model_file(path)


@pytest.mark.parametrize("value, shown", [('"10"', "'10'"), ("10.0", "10.0"), ("true", "True"),
                                          ("-3", "-3")])
def test_a_dense_width_of_the_wrong_type_is_named_with_its_setting_and_type(tmp_path, value,
                                                                            shown):
    """Not 'needs n_in >= 1 and n_out >= 1, got None, 10' for the string "10"."""
    path = _write(tmp_path, "w.toml", f"[[layers]]\ntype = 'Dense'\nn_out = {value}\n")
    with pytest.raises(ValueError, match=rf"layer 1 \(Dense\): Dense needs n_out >= 1 \(an "
                                         rf"int\), got {shown}$"):
        layers_from(read_model_file(path), 3)
