"""ONNX and safetensors export: every built-in layer kind, run by onnxruntime, equals
``Sequential.predict`` (float32 to 1e-5, float64 to 1e-12, relative to the largest output);
layers that cannot be exported are refused in one line naming them."""

from __future__ import annotations

import numpy as np
import pytest

from mpidp import nn
from mpidp.nn.export import OPSET, ExportError, onnx_model, tensors

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

TOL = {np.float32: 1e-5, np.float64: 1e-12}


def run_onnx(proto, x: np.ndarray) -> np.ndarray:
    s = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return s.run(None, {"x": x})[0]


def relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def randomise(model: nn.Sequential, seed: int = 1) -> nn.Sequential:
    """Parameters and state away from their starting values (batch-norm statistics with a
    variance > 0), so every one of them shows in the outputs."""
    rng = np.random.default_rng(seed)
    model.params[...] = rng.standard_normal(model.n_params) * 0.5
    model.state[...] = rng.uniform(0.5, 2.0, model.n_state)
    return model


def x_for(model: nn.Sequential, n: int = 9, seed: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, *model.in_shape)).astype(model.dtype)


CASES = {
    "dense-activations": (lambda: [nn.Dense(None, 8), nn.ReLU(), nn.Dense(None, 6), nn.Tanh(),
                                   nn.Dense(None, 6), nn.Sigmoid(), nn.Dense(None, 6),
                                   nn.LeakyReLU(0.2), nn.Dense(None, 6), nn.GELU(),
                                   nn.Dense(None, 3), nn.Softmax()], 5),
    "conv2d-batchnorm-pools": (lambda: [nn.Conv2d(4, 3, stride=2, padding=1), nn.BatchNorm(),
                                        nn.ReLU(), nn.MaxPool(2), nn.AvgPool((2, 1), 1),
                                        nn.Flatten(), nn.Dense(None, 3)], (2, 11, 10)),
    "conv1d-layernorm-global": (lambda: [nn.Conv1d(4, 3, padding=2), nn.LayerNorm(),
                                         nn.AvgPool(2), nn.MaxPool(3, 1), nn.GlobalAvgPool(),
                                         nn.Dense(None, 2)], (3, 12)),
    "standardize-batchnorm-flat": (lambda: [nn.Standardize(), nn.Dense(None, 6), nn.BatchNorm(),
                                            nn.Dropout(0.3), nn.LayerNorm(), nn.Dense(None, 2)],
                                   4),
    "residual-reshape": (lambda: [nn.Reshape((2, 6)), nn.Residual([nn.Conv1d(2, 3, padding=1),
                                                                   nn.BatchNorm(), nn.ReLU()]),
                                  nn.Flatten(), nn.Residual([nn.Dense(None, 12), nn.GELU(),
                                                             nn.Residual([nn.Dense(None, 12)])]),
                                  nn.Dense(None, 3)], 12),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_each_layer_kind_runs_in_onnxruntime_as_in_mpidp(case, dtype):
    make, n_in = CASES[case]
    model = randomise(nn.Sequential(make(), n_in, dtype))
    x = x_for(model)
    proto = onnx_model(model)
    got, want = run_onnx(proto, x), model.predict(x)
    assert got.dtype == model.dtype and got.shape == want.shape
    assert relative(got, want) <= TOL[dtype]
    assert proto.opset_import[0].version == OPSET
    assert run_onnx(proto, x[:1]).shape == (1, *model.out_shape)  # the batch is dynamic


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_embedding_takes_ids_in_the_models_dtype(dtype):
    model = randomise(nn.Sequential([nn.Embedding(10, 4), nn.Flatten(), nn.Dense(None, 2)], 3,
                                    dtype))
    ids = np.random.default_rng(0).integers(0, 10, (6, 3)).astype(dtype)
    assert relative(run_onnx(onnx_model(model), ids), model.predict(ids)) <= TOL[dtype]


def test_initializers_are_named_by_layer_as_in_safetensors():
    model = randomise(nn.Sequential([nn.Dense(None, 4), nn.BatchNorm(),
                                     nn.Residual([nn.Dense(None, 4)]), nn.Dense(None, 2)], 3))
    names = {i.name for i in onnx_model(model).graph.initializer}
    assert {"0.W", "0.b", "1.gamma", "1.beta", "1.mean", "1.var", "2.0.W", "2.0.b", "3.W",
            "3.b"} <= names
    t = tensors(model)
    assert list(t) == ["0.W", "0.b", "1.gamma", "1.beta", "1.mean", "1.var", "2.0.W", "2.0.b",
                       "3.W", "3.b"]
    assert np.array_equal(t["2.0.W"], model.layers[2].layers[0].params["W"])


def test_sparse_input_is_refused_naming_the_layer(tmp_path):
    model = nn.Sequential([nn.SparseDense(5, 3), nn.ReLU(), nn.Dense(None, 2)], 5)
    with pytest.raises(ExportError, match=r"^cannot export layer 0 \(SparseDense.*sparse"):
        nn.export_onnx(model, tmp_path / "m.onnx")
    assert not list(tmp_path.iterdir())


class Doubler(nn.Layer):
    def forward(self, x):
        return 2 * x

    def backward(self, dy, accumulate=False, need_input_grad=True):
        return 2 * dy


class MyDoubler(Doubler):
    """A subclass without an exporter of its own: its base's is used."""


def test_a_users_layer_is_refused_until_it_registers_an_exporter(tmp_path, monkeypatch):
    from mpidp.nn import export
    model = nn.Sequential([nn.Dense(None, 3), nn.Residual([Doubler()])], 2, np.float64)
    with pytest.raises(ExportError) as err:
        onnx_model(model)
    assert "layer 1.0 (Doubler())" in str(err.value) and "register_exporter" in str(err.value)
    assert "\n" not in str(err.value)
    monkeypatch.setattr(export, "_EXPORTERS", dict(export._EXPORTERS))

    @nn.register_exporter(Doubler)
    def _double(graph, layer, x, in_shape):
        return graph.op("Mul", x, graph.const(2.0))

    x = x_for(model)
    assert relative(run_onnx(onnx_model(model), x), model.predict(x)) <= 1e-12
    model = nn.Sequential([MyDoubler()], 2, np.float64)
    assert np.array_equal(run_onnx(onnx_model(model), x), 2 * x)


def test_export_onnx_writes_a_checked_file(tmp_path):
    model = randomise(nn.mlp(4, [5], 3))
    path = nn.export_onnx(model, tmp_path / "m.onnx")
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    x = x_for(model)
    assert relative(run_onnx(proto, x), model.predict(x)) <= 1e-5
    dims = proto.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and dims[1].dim_value == 4


def test_safetensors_holds_every_parameter_and_the_spec(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    from safetensors import safe_open
    model = randomise(nn.Sequential([nn.Standardize(), nn.Dense(None, 4), nn.BatchNorm(),
                                     nn.Dense(None, 2)], 3, np.float64))
    path = nn.export_safetensors(model, tmp_path / "m.safetensors")
    got = st.load_file(path)
    assert set(got) == {"0.mean", "0.std", "1.W", "1.b", "2.gamma", "2.beta", "2.mean",
                        "2.var", "3.W", "3.b"}
    assert all(a.dtype == np.float64 for a in got.values())
    flat = np.concatenate([got[k].ravel() for k in ("1.W", "1.b", "2.gamma", "2.beta", "3.W",
                                                    "3.b")])
    assert np.array_equal(flat, model.params)
    with safe_open(path, "numpy") as f:
        meta = f.metadata()
    assert meta["format"] == "mpidp" and nn.from_spec(__import__("json").loads(meta["spec"]),
                                                      meta["dtype"]).n_params == model.n_params


def test_the_exporter_shown_in_the_extending_guide_runs(monkeypatch):
    import re
    from pathlib import Path

    from mpidp.nn import export, layers
    monkeypatch.setattr(export, "_EXPORTERS", dict(export._EXPORTERS))
    for registry in ("_CLASSES", "_NAMES"):  # the guide's layer is this test's only
        monkeypatch.setattr(layers, registry, dict(getattr(layers, registry)))
    page = (Path(__file__).resolve().parents[2] / "docs" / "extending.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", page, re.S)
    ns: dict = {}
    exec(blocks[0], ns)  # the layer
    exec(next(b for b in blocks if "register_exporter" in b), ns)
    model = nn.Sequential([nn.Dense(None, 4), ns["ScaledLeakyReLU"](0.1, 2.0)], 3, np.float64)
    model.init_(0)
    x = x_for(model)
    assert relative(run_onnx(onnx_model(model), x), model.predict(x)) <= 1e-12
