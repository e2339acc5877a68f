"""``Sequential`` flat buffers, initialisation, spec round trips, presets, and no-MPI imports."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT

from mpidp import nn
from mpidp.nn import (
    Dense,
    MeanSquaredError,
    ReLU,
    Sequential,
    Sigmoid,
    SoftmaxCrossEntropy,
    Tanh,
    build,
    from_spec,
    linear,
    logreg,
    mlp,
)

PKG = ROOT / "mpidp"


def _all_views(model):
    for layer in model.layers:
        assert set(layer.params) == set(layer.grads) == set(layer.param_shapes())
        for k in layer.params:
            yield layer, k, layer.params[k], layer.grads[k]


# ---------------------------------------------------------------------------- flat buffers


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_params_and_grads_are_flat_contiguous_and_layers_view_them(dtype):
    model = mlp(5, (7, 3), 4, dtype=dtype)
    expected = 5 * 7 + 7 + 7 * 3 + 3 + 3 * 4 + 4
    assert model.n_params == expected
    for buf in (model.params, model.grads):
        assert buf.ndim == 1 and buf.shape == (expected,)
        assert buf.dtype == dtype
        assert buf.flags.c_contiguous
    assert not np.shares_memory(model.params, model.grads)

    offset = 0
    for layer, k, p, g in _all_views(model):
        assert p.shape == g.shape == layer.param_shapes()[k]
        assert np.shares_memory(p, model.params) and np.shares_memory(g, model.grads)
        # the view sits exactly at the expected offset (layer order, then param_shapes order)
        size = p.size
        p[...] = 0
        model.params[offset:offset + size] = np.arange(1, size + 1)
        np.testing.assert_array_equal(p.reshape(-1), np.arange(1, size + 1))
        g.reshape(-1)[...] = -np.arange(1, size + 1)
        np.testing.assert_array_equal(model.grads[offset:offset + size], -np.arange(1, size + 1))
        offset += size
    assert offset == model.n_params


def test_n_params_of_the_standard_mlp():
    model = mlp(784, (1024, 1024), 10)
    assert model.n_params == 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
    assert model.params.size == model.grads.size == model.n_params
    assert model.n_in == 784 and model.n_out == 10


def test_writing_flat_params_changes_forward_output():
    model = Sequential([Dense(2, 1)], 2, np.float64)
    model.params[...] = [2.0, 3.0, 0.5]  # W = [[2], [3]], b = [0.5]
    np.testing.assert_allclose(model(np.array([[1.0, 1.0], [0.0, 2.0]])), [[5.5], [6.5]])


def test_use_grad_buffer_rebinds_every_view():
    rng = np.random.default_rng(0)
    model = mlp(3, (4,), 2, dtype=np.float64).init_(0)
    old = model.grads
    buf = np.full(model.n_params + 3, 7.0)
    model.use_grad_buffer(buf)
    assert model.grads.shape == (model.n_params,)
    assert np.shares_memory(model.grads, buf) and not np.shares_memory(model.grads, old)
    for _, _, _, g in _all_views(model):
        assert np.shares_memory(g, buf)
    params_before = model.params.copy()

    loss = SoftmaxCrossEntropy()
    x, y = rng.standard_normal((5, 3)), rng.integers(0, 2, 5)
    loss.forward(model(x), y)
    model.backward(loss.backward())
    np.testing.assert_array_equal(buf[model.n_params:], [7.0, 7.0, 7.0])  # extra slots untouched
    np.testing.assert_array_equal(buf[:model.n_params], model.grads)
    assert not np.any(buf[:model.n_params] == 7.0)
    np.testing.assert_array_equal(old, 0.0)  # the old buffer no longer receives gradients
    np.testing.assert_array_equal(model.params, params_before)

    # the same gradient as a model that never changed buffers
    ref = mlp(3, (4,), 2, dtype=np.float64)
    ref.params[...] = model.params
    loss.forward(ref(x), y)
    ref.backward(loss.backward())
    np.testing.assert_allclose(buf[:model.n_params], ref.grads, rtol=1e-14)


@pytest.mark.parametrize("bad", [
    np.zeros(10, np.float32),           # wrong dtype
    np.zeros(5, np.float64),            # too short
    np.zeros((2, 20), np.float64),      # not 1-D
])
def test_use_grad_buffer_rejects_bad_buffers(bad):
    model = Sequential([Dense(3, 2)], 3, np.float64)  # 8 params
    with pytest.raises(ValueError):
        model.use_grad_buffer(bad)


def test_shape_and_argument_errors():
    with pytest.raises(ValueError, match="5"):
        Sequential([Dense(3, 4), Dense(5, 2)], 3)
    with pytest.raises(ValueError):
        Sequential([Dense(3, 4)], 4)
    with pytest.raises(ValueError):
        Sequential([], 3)
    with pytest.raises(ValueError):
        Sequential([Dense(3, 4)], 3, dtype=np.int64)
    with pytest.raises(ValueError):
        Sequential([Dense(3, 4)], 3, dtype=np.float16)
    with pytest.raises(ValueError):
        Dense(0, 3)
    with pytest.raises(ValueError):
        Dense(3, 0)
    with pytest.raises(ValueError):
        Dense(3, 3, init="glorot")
    with pytest.raises(ValueError):
        mlp(3, (4,), 2, activation="gelu")


# ---------------------------------------------------------------------------- init


def test_init_is_seeded():
    a = mlp(6, (8,), 3).init_(42)
    b = mlp(6, (8,), 3).init_(42)
    c = mlp(6, (8,), 3).init_(43)
    d = mlp(6, (8,), 3).init_(np.random.default_rng(42))
    np.testing.assert_array_equal(a.params, b.params)
    np.testing.assert_array_equal(a.params, d.params)
    assert not np.array_equal(a.params, c.params)
    m = mlp(2, (2,), 2)
    assert m.init_(0) is m


def test_init_distributions():
    rng = np.random.default_rng(0)
    he = Sequential([Dense(400, 300, init="he")], 400, np.float64).init_(rng)
    W = he.layers[0].params["W"]
    assert W.std() == pytest.approx(np.sqrt(2 / 400), rel=0.02)
    assert abs(W.mean()) < 0.05 * np.sqrt(2 / 400)
    np.testing.assert_array_equal(he.layers[0].params["b"], 0)

    xav = Sequential([Dense(400, 300, init="xavier")], 400, np.float64).init_(rng)
    W = xav.layers[0].params["W"]
    limit = np.sqrt(6 / 700)
    assert np.abs(W).max() <= limit
    assert np.abs(W).max() > 0.99 * limit
    assert W.std() == pytest.approx(limit / np.sqrt(3), rel=0.02)  # std of U(-a, a)

    zeros = Sequential([Dense(4, 3, init="zeros")], 4).init_(rng)
    np.testing.assert_array_equal(zeros.params, 0)


# ---------------------------------------------------------------------------- spec / presets


@pytest.mark.parametrize("model_fn", [
    lambda: mlp(5, (6, 4), 3, activation="relu", dtype=np.float64),
    lambda: mlp(5, (6,), 3, activation="tanh", dtype=np.float64),
    lambda: mlp(5, (6, 2, 3), 3, activation="sigmoid", dtype=np.float64),
    lambda: linear(5, 2, dtype=np.float64),
    lambda: logreg(5, 4, dtype=np.float64),
], ids=["relu", "tanh", "sigmoid", "linear", "logreg"])
def test_spec_round_trip(model_fn):
    model = model_fn().init_(3)
    model.params += np.random.default_rng(1).standard_normal(model.n_params)  # not all zero
    spec = json.loads(json.dumps(model.spec()))  # JSON-able
    clone = from_spec(spec, dtype=np.float64)
    assert clone.n_params == model.n_params
    assert clone.n_in == model.n_in and clone.n_out == model.n_out
    assert [type(a) for a in clone.layers] == [type(a) for a in model.layers]
    clone.params[...] = model.params
    x = np.random.default_rng(2).standard_normal((7, 5))
    np.testing.assert_array_equal(clone(x), model(x))


def test_spec_round_trip_model_starting_with_an_activation():
    model = Sequential([Tanh(), Dense(3, 2), Sigmoid()], 3, np.float64).init_(0)
    clone = from_spec(json.loads(json.dumps(model.spec())), dtype=np.float64)
    assert clone.n_params == model.n_params == 8
    clone.params[...] = model.params
    x = np.random.default_rng(0).standard_normal((4, 3))
    np.testing.assert_array_equal(clone(x), model(x))


def test_from_spec_unknown_layer_and_dtype():
    with pytest.raises(ValueError, match="Softplus"):
        from_spec([{"type": "Dense", "n_in": 2, "n_out": 2}, {"type": "Softplus"}])
    m = from_spec([{"type": "Dense", "n_in": 2, "n_out": 3}, {"type": "ReLU"}], dtype=np.float32)
    assert m.dtype == np.float32 and m.params.dtype == np.float32 and m.n_params == 9
    assert isinstance(m.layers[1], ReLU)


def test_build_presets():
    model, loss = build("linear", 4, 2)
    assert isinstance(loss, MeanSquaredError) and model.n_params == 4 * 2 + 2
    np.testing.assert_array_equal(model.init_(0).params, 0)  # zeros init

    model, loss = build("logreg", 4, 3, dtype=np.float64)
    assert isinstance(loss, SoftmaxCrossEntropy) and model.n_params == 15
    assert model.dtype == np.float64

    model, loss = build("mlp", 4, 3, hidden=(5,))
    assert isinstance(loss, SoftmaxCrossEntropy) and model.n_params == 4 * 5 + 5 + 5 * 3 + 3
    assert [type(a) for a in model.layers] == [Dense, ReLU, Dense]

    model, loss = build("mlp", 4, 1, hidden=(5,), classification=False)
    assert isinstance(loss, MeanSquaredError) and model.n_out == 1


def test_build_errors():
    with pytest.raises(ValueError, match="resnet"):
        build("resnet", 4, 3)
    with pytest.raises(ValueError, match="logreg"):
        build("logreg", 4, 1, classification=False)


# ---------------------------------------------------------------------------- no MPI


NO_MPI_FILES = sorted(PKG.joinpath("nn").glob("*.py")) + [
    PKG / "data" / name for name in ("partition.py", "sources.py", "rows.py")] + [PKG / "digest.py"]


def _imports(path: Path) -> list[str]:
    """Every module an ``import`` or ``from ... import`` in ``path`` names (relative ones resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = path.parent.relative_to(PKG.parent).parts  # ('mpidp',) or ('mpidp', 'nn')
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(pkg[:len(pkg) - node.level + 1]) if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            names.append(mod)
            names += [f"{mod}.{a.name}" for a in node.names]  # `from .. import comm`
    return names


@pytest.mark.parametrize("path", NO_MPI_FILES, ids=lambda p: str(p.relative_to(PKG)))
def test_sources_do_not_import_mpi(path):
    names = _imports(path)
    assert names or path.name == "__init__.py"
    for name in names:
        assert not name.startswith("mpi4py"), f"{path.name} imports {name}"
        assert not name.startswith("mpidp.comm"), f"{path.name} imports {name}"
        assert not name.startswith("mpidp.parallel"), f"{path.name} imports {name}"
        assert name != "mpidp" and not name.startswith("mpidp._"), f"{path.name} imports {name}"


def test_imports_resolver_sees_relative_imports():
    """The AST check above is not vacuous: it resolves what these files really import."""
    assert "mpidp.nn.layers" in _imports(PKG / "nn" / "model.py")
    assert "mpidp.nn.model.Sequential" in _imports(PKG / "nn" / "presets.py")
    data = PKG / "data.py"
    if data.exists():  # a module that does use MPI helpers is flagged
        assert any(n.startswith("mpidp.comm") or n.startswith("mpi4py") for n in _imports(data))


def test_modules_import_and_work_with_mpi4py_blocked():
    """Import nn, partition and sources without running mpidp/__init__ and with mpi4py blocked."""
    code = f"""
import sys, types
sys.modules["mpi4py"] = None  # any `import mpi4py` now raises ImportError
pkg = types.ModuleType("mpidp")
pkg.__path__ = [{str(PKG)!r}]
sys.modules["mpidp"] = pkg     # stub parent: mpidp/__init__.py is not executed
import numpy as np
import mpidp.nn, mpidp.data.partition, mpidp.data.sources
m = mpidp.nn.mlp(3, (4,), 2).init_(0)
assert m(np.ones((2, 3), np.float32)).shape == (2, 2)
assert mpidp.data.partition.block_counts(5, 2).tolist() == [3, 2]
assert mpidp.data.sources.open_source("synthetic", n_samples=10, n_features=3).n_samples == 10
bad = [k for k in sys.modules if k.startswith("mpi4py") and sys.modules[k] is not None]
assert not bad, bad
assert "mpidp.comm" not in sys.modules
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_public_names():
    for name in nn.__all__:
        assert hasattr(nn, name)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("blas", [True, False])
def test_add_xt_dy_accumulates_in_place(dtype, blas, monkeypatch):
    """``dW += x.T @ dy`` with and without SciPy's in-place gemm, against the plain formula;
    strided, empty and integer operands take the NumPy path and stay right."""
    from mpidp.nn import blas as L
    if not blas:
        monkeypatch.setattr(L, "_blas", None)
    else:
        monkeypatch.setattr(L, "_blas", pytest.importorskip("scipy.linalg.blas"))
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((9, 5)).astype(dtype), rng.standard_normal((9, 4)).astype(dtype)
    dW = rng.standard_normal((5, 4)).astype(dtype)
    expected = dW + x.T @ dy
    view = dW
    L.add_xt_dy_(dW, x, dy)
    assert dW is view
    np.testing.assert_allclose(dW, expected, rtol=1e-5 if dtype == np.float32 else 1e-12)
    expected = dW + x[::2].T @ dy[::2]  # not contiguous
    L.add_xt_dy_(dW, x[::2], dy[::2])
    np.testing.assert_allclose(dW, expected, rtol=1e-5 if dtype == np.float32 else 1e-12)
    before = dW.copy()
    L.add_xt_dy_(dW, x[:0], dy[:0])  # an empty micro-batch adds nothing
    np.testing.assert_array_equal(dW, before)
    ints = np.ones((5, 4), np.int64)
    L.add_xt_dy_(ints, np.ones((2, 5), np.int64), np.ones((2, 4), np.int64))
    np.testing.assert_array_equal(ints, 3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("blas", [True, False])
def test_add_matmul_accumulates_in_place(dtype, blas, monkeypatch):
    """``y += a @ b`` with and without SciPy's in-place gemm, against the plain formula; a
    column block of a larger array (as a ``Dense`` reading its weights in parts passes),
    an empty batch and integer operands stay right."""
    from mpidp.nn import blas as L
    if not blas:
        monkeypatch.setattr(L, "_blas", None)
    else:
        monkeypatch.setattr(L, "_blas", pytest.importorskip("scipy.linalg.blas"))
    rng = np.random.default_rng(2)
    x, W = rng.standard_normal((7, 9)).astype(dtype), rng.standard_normal((9, 4)).astype(dtype)
    y = rng.standard_normal((7, 4)).astype(dtype)
    view, expected = y, y + x[:, 3:6] @ W[3:6]
    L.add_matmul_(y, x[:, 3:6], W[3:6])
    assert y is view
    np.testing.assert_allclose(y, expected, rtol=1e-5 if dtype == np.float32 else 1e-12)
    before = y[:0].copy()
    L.add_matmul_(y[:0], x[:0, :3], W[:3])
    np.testing.assert_array_equal(y[:0], before)
    ints = np.ones((2, 4), np.int64)
    L.add_matmul_(ints, np.ones((2, 5), np.int64), np.ones((5, 4), np.int64))
    np.testing.assert_array_equal(ints, 6)


def test_dense_accumulate_equals_sum_of_single_backwards():
    rng = np.random.default_rng(1)
    layer = nn.Dense(6, 3)
    W, b = np.zeros((6, 3)), np.zeros(3)
    dW, db = np.zeros((6, 3)), np.zeros(3)
    layer.bind({"W": W, "b": b}, {"W": dW, "b": db})
    layer.init_(rng)
    x1, x2 = rng.standard_normal((4, 6)), rng.standard_normal((5, 6))
    g1, g2 = rng.standard_normal((4, 3)), rng.standard_normal((5, 3))
    layer.forward(x1)
    layer.backward(g1)
    layer.forward(x2)
    layer.backward(g2, accumulate=True)
    x, g = np.concatenate([x1, x2]), np.concatenate([g1, g2])
    np.testing.assert_allclose(dW, x.T @ g, rtol=1e-12)
    np.testing.assert_allclose(db, g.sum(axis=0), rtol=1e-12)


@pytest.mark.parametrize("threads", ["1", "2"])
def test_scipy_gemm_only_beside_a_single_threaded_blas(threads):
    """SciPy's OpenBLAS has its own thread pool: beside a multi-threaded NumPy BLAS the two
    pools starve each other, so the in-place gemm is used only when BLAS runs one thread."""
    pytest.importorskip("scipy")
    if threads == "2" and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two usable cores")
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    env["OPENBLAS_NUM_THREADS"] = threads
    code = ("from mpidp.nn import blas; import numpy\n"
            "print(blas.single_threaded(), blas.scipy_blas() is not None)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == (["True", "True"] if threads == "1" else ["False", "False"])


@pytest.mark.parametrize("loss", [nn.SoftmaxCrossEntropy(), nn.MeanSquaredError()])
@pytest.mark.parametrize("bad", [-1, 3])
def test_a_label_outside_the_classes_is_refused(loss, bad):
    """NumPy's indexing would train label -1 as the last class (and fail obscurely on k)."""
    pred = np.zeros((4, 3))
    with pytest.raises(ValueError, match=f"label {bad} is outside the model's 3 classes"):
        loss.forward(pred, np.array([0, 1, bad, 2]))
    assert np.isfinite(loss.forward(pred, np.array([0, 1, 2, 2])))


def test_which_first_layers_take_sparse_rows():
    """SparseDense takes CSR rows only, mpidp's other layers dense arrays only; a layer of
    one's own (one that densifies its input, say) is trusted with either."""
    from mpidp.nn.sparse import SparseDense, input_problem

    class Densify(nn.Layer):
        def forward(self, x):
            return x

        def backward(self, dy, accumulate=False, need_input_grad=True):
            return dy

    assert input_problem([SparseDense(4, 2)], sparse=True) is None
    assert "takes sparse (CSR) rows" in input_problem([SparseDense(4, 2)], sparse=False)
    assert "first layer is Dense" in input_problem([nn.Dense(4, 2)], sparse=True)
    assert input_problem([nn.Dense(4, 2)], sparse=False) is None
    assert input_problem([Densify(), nn.Dense(4, 2)], sparse=True) is None
