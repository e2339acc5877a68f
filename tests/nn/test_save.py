"""Saving and loading models: ``mpidp.nn.save`` / ``Sequential.save`` / ``mpidp.nn.load``,
the layer registry, the ``model.npz`` of ``mpidp train``, and damaged files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT

from mpidp import nn
from mpidp.nn import CSR, Layer, register_layer


def _csr(n: int, d: int, seed: int) -> CSR:
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((n, d)) * (rng.random((n, d)) < 0.3)
    rows, cols = np.nonzero(dense)
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))])
    return CSR(indptr, cols, dense[rows, cols], d)


PRESETS = {
    "mlp": lambda dt: nn.build("mlp", 7, 3, hidden=(6, 5), dtype=dt)[0],
    "logreg": lambda dt: nn.build("logreg", 7, 4, dtype=dt)[0],
    "linear": lambda dt: nn.build("linear", 7, 2, dtype=dt, classification=False)[0],
    "sparse": lambda dt: nn.build("mlp", 7, 3, hidden=(6,), dtype=dt, sparse=True)[0],
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_preset_round_trips_bit_for_bit(tmp_path, preset, dtype):
    model = PRESETS[preset](dtype).init_(1)
    model.params += np.random.default_rng(2).standard_normal(model.n_params).astype(dtype)
    meta = {"preset": preset, "note": [1, 2.5, None]}
    written = model.save(tmp_path / "m.npz", meta=meta)
    assert written == str(tmp_path / "m.npz")
    assert os.listdir(tmp_path) == ["m.npz"]  # no temporary file left behind
    back = nn.load(tmp_path / "m.npz")
    assert back.dtype == np.dtype(dtype) and back.meta == meta
    assert [type(a) for a in back.layers] == [type(a) for a in model.layers]
    assert back.params.tobytes() == model.params.tobytes()
    x = _csr(9, 7, 3).astype(dtype) if preset == "sparse" else \
        np.random.default_rng(3).standard_normal((9, 7)).astype(dtype)
    assert back(x).tobytes() == model(x).tobytes()
    with np.load(tmp_path / "m.npz", allow_pickle=False) as raw:  # the layout of mpidp train
        assert sorted(raw.files) == ["dtype", "meta", "params", "spec"]
        assert json.loads(str(raw["spec"])) == model.spec() and str(raw["dtype"]) == str(model.dtype)


def test_save_to_a_folder_and_meta_from_the_model(tmp_path):
    model = nn.mlp(3, (4,), 2).init_(0)
    model.meta = {"who": "me"}
    assert nn.save(model, tmp_path) == str(tmp_path / "model.npz")
    back = nn.load(tmp_path)
    assert back.meta == {"who": "me"}
    back.save(tmp_path / "again.npz")  # the meta goes along
    assert nn.load(tmp_path / "again.npz").meta == {"who": "me"}


def test_the_layout_written_by_hand_loads(tmp_path):
    """A file in the ``model.npz`` layout written without nn.save, with and without meta."""
    model = nn.mlp(4, (8,), 3).init_(0)
    np.savez(tmp_path / "a.npz", params=model.params, spec=json.dumps(model.spec()),
             dtype=str(model.dtype), meta="{}")
    np.savez(tmp_path / "b.npz", params=model.params, spec=json.dumps(model.spec()),
             dtype=str(model.dtype))
    for name in ("a.npz", "b.npz"):
        back = nn.load(tmp_path / name)
        assert back.meta == {} and np.array_equal(back.params, model.params)


# ---------------------------------------------------------------------------- user layers

USER_LAYER = '''
import numpy as np
from mpidp import nn

@nn.register_layer
class Leaky(nn.Layer):
    """``x`` if ``x > 0`` else ``slope * x``."""

    def __init__(self, slope: float = 0.01) -> None:
        super().__init__()
        self.slope = slope

    def config(self) -> dict:
        return {"slope": self.slope}

    def forward(self, x):
        self._x = x
        return np.where(x > 0, x, self.slope * x)

    def backward(self, dy, accumulate=False, need_input_grad=True):
        return np.where(self._x > 0, dy, self.slope * dy) if need_input_grad else None
'''


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_registered_user_layer_reloads_in_a_fresh_process(tmp_path):
    save = USER_LAYER + textwrap.dedent('''
        import sys
        model = nn.Sequential([nn.Dense(5, 6), Leaky(slope=0.25), nn.Dense(6, 2)], 5,
                              np.float64).init_(4)
        x = np.random.default_rng(5).standard_normal((8, 5))
        model.save(sys.argv[1], meta={"slope": 0.25})
        np.save(sys.argv[2], model(x))
        np.save(sys.argv[3], x)
        ''')
    files = [str(tmp_path / n) for n in ("m.npz", "y.npy", "x.npy", "y2.npy")]
    r = _run(save, *files[:3])
    assert r.returncode == 0, r.stderr
    spec = json.loads(str(np.load(files[0])["spec"]))
    assert spec[1] == {"type": "Leaky", "slope": 0.25}
    load = USER_LAYER + textwrap.dedent('''
        import sys
        model = nn.load(sys.argv[1])
        assert type(model.layers[1]).__name__ == "Leaky" and model.layers[1].slope == 0.25
        assert model.meta == {"slope": 0.25}
        np.save(sys.argv[3], model(np.load(sys.argv[2])))
        ''')
    r = _run(load, files[0], files[2], files[3])
    assert r.returncode == 0, r.stderr
    assert np.load(files[3]).tobytes() == np.load(files[1]).tobytes()
    # the same load without the registration: a clear error naming the class and the file
    unregistered = "import sys\nfrom mpidp import nn\nnn.load(sys.argv[1])\n"
    r = _run(unregistered, files[0])
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError:") and "'Leaky'" in last and files[0] in last
    assert "mpidp.nn.register_layer" in last


def test_an_unregistered_layer_class_is_named(tmp_path):
    class Softsign(Layer):
        def forward(self, x):
            return x / (1 + np.abs(x))

        def backward(self, dy, accumulate=False, need_input_grad=True):
            return None

    model = nn.Sequential([nn.Dense(2, 3), Softsign()], 2).init_(0)
    with pytest.warns(UserWarning) as caught:  # written, with a warning that names the class
        model.save(tmp_path / "m.npz")
    assert len(caught) == 1 and caught[0].filename == __file__, [str(w.message) for w in caught]
    said = str(caught[0].message)
    assert said.startswith(f"{tmp_path / 'm.npz'}: layer class 'Softsign' (") and \
        "<locals>.Softsign) is not registered, so mpidp.nn.load cannot rebuild" in said
    assert "register it with mpidp.nn.register_layer" in said
    with pytest.raises(ValueError, match="register_layer") as err:
        nn.load(tmp_path / "m.npz")
    assert "'Softsign'" in str(err.value) and str(tmp_path / "m.npz") in str(err.value)
    with pytest.raises(ValueError, match="'Softsign', which is not registered"):
        nn.from_spec(model.spec())


def _warnings_of(save) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save()
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_saving_warns_of_each_unregistered_class_alone(tmp_path):
    class Shift(Layer):  # not registered
        def forward(self, x):
            return x + 1

        def backward(self, dy, accumulate=False, need_input_grad=True):
            return dy

    class Dense(nn.Dense):  # not registered, but its name is mpidp's Dense's
        pass

    @register_layer(name="test_nn_save.Kept")
    class Kept(Shift):
        pass

    path = str(tmp_path / "m.npz")
    built_in = [nn.build(p, 7, 3)[0] for p in ("mlp", "logreg")] + [nn.build("cnn", (1, 8, 8), 3)[0]] + [
        nn.Sequential([nn.Dense(4, 4), nn.Residual([nn.Dense(4, 4), nn.ReLU(), Kept()]),
                       nn.LayerNorm(4), nn.Dropout(0.1), Kept()], 4)]
    for model in built_in:
        assert _warnings_of(lambda m=model: nn.save(m.init_(0), path)) == []
    inner = nn.Sequential([nn.Residual([nn.Dense(4, 4), Shift()]), Shift(), Dense(4, 2)], 4)
    said = _warnings_of(lambda: inner.init_(0).save(path))
    assert len(said) == 2, said  # one per class, wherever and however often it appears
    assert said[0].startswith(f"{path}: layer class 'Shift' (") and "cannot rebuild" in said[0]
    assert said[1].startswith(f"{path}: layer class 'Dense' (") and \
        "its name is registered to mpidp.nn.layers.Dense, which mpidp.nn.load would build " \
        "in its place" in said[1]
    assert all("register it with mpidp.nn.register_layer" in w for w in said)
    with pytest.raises(ValueError, match="'Shift', which is not registered"):
        nn.load(path)  # what the warning foretold


def test_registering_two_classes_under_one_name_is_refused():
    def make():
        class Twin(Layer):
            def forward(self, x):
                return x

            def backward(self, dy, accumulate=False, need_input_grad=True):
                return dy
        return Twin

    first, second = make(), make()
    second.__qualname__ = "elsewhere.Twin"
    assert register_layer(first) is first
    assert register_layer(first) is first  # the same class again: fine
    with pytest.raises(ValueError) as err:
        register_layer(second)
    msg = str(err.value)
    assert "'Twin'" in msg and first.__qualname__ in msg and "elsewhere.Twin" in msg
    assert nn.registered_layers()["Twin"] is first
    with pytest.raises(ValueError, match="mpidp.nn.layers.Dense"):
        register_layer(name="Dense")(second)
    assert register_layer(name="TwinToo")(second) is second  # an explicit name keeps both
    model = nn.Sequential([second()], 3)
    assert model.spec()[0]["type"] == "TwinToo"
    assert type(nn.from_spec(model.spec()).layers[0]) is second
    with pytest.raises(TypeError, match="subclass of mpidp.nn.Layer"):
        register_layer(dict)


def test_from_config_and_reserved_keys():
    @register_layer(name="test_nn_save.Scale")
    class Scale(Layer):
        def __init__(self, factors: list[float]) -> None:
            super().__init__()
            self.factors = np.asarray(factors)

        def config(self) -> dict:
            return {"factor_list": self.factors.tolist()}

        @classmethod
        def from_config(cls, settings: dict) -> Scale:
            return cls(settings["factor_list"])

        def forward(self, x):
            return x * self.factors

        def backward(self, dy, accumulate=False, need_input_grad=True):
            return dy * self.factors

    model = nn.Sequential([Scale([1.0, 2.0])], 2, np.float64)
    back = nn.from_spec(json.loads(json.dumps(model.spec())), np.float64)
    assert back.layers[0].factors.tolist() == [1.0, 2.0]
    Scale.config = lambda self: {"type": "x"}
    with pytest.raises(ValueError, match="reserved"):
        model.spec()


# ---------------------------------------------------------------------------- mpidp train


def test_the_model_file_of_mpidp_train_loads_and_predicts_what_its_params_imply(tmp_path):
    from helpers import run_mpi
    out = tmp_path / "run"
    r = run_mpi(2, "train", "--dataset", "digits", "--epochs", "1", "--out", str(out), "-q")
    assert r.returncode == 0, r.stderr
    assert not [n for n in os.listdir(out) if n.startswith(".tmp-")]
    model = nn.load(out)
    assert model.meta["n_features"] == 64 and model.meta["n_outputs"] == 10
    with np.load(out / "model.npz", allow_pickle=False) as raw:
        params, spec = raw["params"], json.loads(str(raw["spec"]))
    assert model.params.tobytes() == params.tobytes() and model.spec() == spec
    assert model.meta["sample_shape"] == [1, 8, 8] and spec[0]["model_in_shape"] == [1, 8, 8]
    x = np.random.default_rng(0).random((16, 1, 8, 8)).astype(model.dtype)
    y, offset = x, 0  # the forward pass the flat vector and spec describe, by hand
    for layer in spec:
        if layer["type"] == "Flatten":
            y = y.reshape(len(y), -1)
        elif layer["type"] == "Dense":
            n_in, n_out = layer["n_in"], layer["n_out"]
            W = params[offset:offset + n_in * n_out].reshape(n_in, n_out)
            b = params[offset + n_in * n_out:offset + n_in * n_out + n_out]
            offset += n_in * n_out + n_out
            y = y @ W + b
        else:
            assert layer["type"] == "ReLU"
            y = np.maximum(y, 0)
    assert offset == params.size
    np.testing.assert_array_equal(model(x), y)


# ---------------------------------------------------------------------------- damaged files


def _member_data_start(path: Path, member: str) -> tuple[int, zipfile.ZipInfo]:
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    data, h = path.read_bytes(), info.header_offset
    return h + 30 + int.from_bytes(data[h + 26:h + 28], "little") \
        + int.from_bytes(data[h + 28:h + 30], "little"), info


@pytest.fixture
def saved(tmp_path) -> Path:
    return Path(nn.mlp(4, (8,), 3).init_(0).save(tmp_path / "model.npz"))


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[:len(data) // 2]))
    elif how == "crc":
        start, info = _member_data_start(path, "params.npy")
        data[start + info.file_size - 3] ^= 0x01
        path.write_bytes(bytes(data))
    elif how == "missing":
        path.unlink()
    elif how == "not a model":
        np.savez(path, X=np.zeros(3))
    elif how == "npy":
        with open(path, "wb") as f:
            np.save(f, np.zeros(3))
    elif how == "text":
        path.write_text("hello")
    elif how == "size":
        with np.load(path) as raw:
            np.savez(path, params=raw["params"][:-1], spec=raw["spec"], dtype=raw["dtype"])
    elif how == "dtype":
        with np.load(path) as raw:
            np.savez(path, params=raw["params"].astype(np.float64), spec=raw["spec"],
                     dtype=raw["dtype"])
    elif how == "spec":
        with np.load(path) as raw:
            np.savez(path, params=raw["params"], spec="{not json", dtype=raw["dtype"])


@pytest.mark.parametrize("how,says", [
    ("truncated", "cannot load a saved model"), ("crc", "CRC-32"),
    ("missing", "No such file"), ("not a model", "not a saved model: no 'params'"),
    ("npy", "not a .npz archive (a single .npy array)"),
    ("text", "not a .npz archive (nor any NumPy file"),
    ("size", "the spec needs float32 (67,)"), ("dtype", "params is float64"),
    ("spec", "JSONDecodeError"),
])
def test_a_damaged_file_is_one_value_error_naming_it(saved, how, says):
    _damage(saved, how)
    with pytest.raises(ValueError) as err:
        nn.load(saved)
    msg = str(err.value)
    assert msg.startswith(f"{str(saved)!r}: cannot load a saved model (") and says in msg, msg
    assert "pickle" not in msg  # NumPy's advice for a foreign file: never to a user


def test_non_finite_parameters_are_refused_unless_asked(saved):
    with np.load(saved) as raw:
        params = raw["params"].copy()
        params[5] = np.nan
        np.savez(saved, params=params, spec=raw["spec"], dtype=raw["dtype"], meta=raw["meta"])
    with pytest.raises(ValueError, match="the saved parameters contain NaN or Inf") as err:
        nn.load(saved)
    assert str(saved) in str(err.value)
    assert np.isnan(nn.load(saved, check_finite=False).params[5])


def test_predict_open_model_keeps_its_messages(saved):
    from mpidp.cli.predict import _open_model
    assert _open_model(str(saved.parent)).n_params == 4 * 8 + 8 + 8 * 3 + 3
    _damage(saved, "crc")
    with pytest.raises(ValueError) as err:
        _open_model(str(saved.parent))
    msg = str(err.value)
    assert msg.startswith(f"--model {str(saved)!r}: cannot load a saved model (") and "CRC-32" in msg
    assert msg.endswith("give the model.npz that 'mpidp train' wrote, or its folder")
    np.savez(saved, params=np.full(67, np.inf, np.float32),
             spec=json.dumps(nn.mlp(4, (8,), 3).spec()), dtype="float32")
    with pytest.raises(ValueError, match=r"^--model .*: the saved parameters contain NaN or Inf$"):
        _open_model(str(saved))


def test_a_failed_save_keeps_the_old_file_and_leaves_no_temporary(saved):
    before = saved.read_bytes()
    model = nn.mlp(4, (8,), 3).init_(1)
    with pytest.raises(ValueError, match="JSON-able"):
        model.save(saved, meta={"bad": object()})
    class Unwritable:
        def __array__(self, *args, **kwargs):
            raise RuntimeError("disk on fire")

    boom = nn.mlp(4, (8,), 3)
    boom.params = Unwritable()  # np.savez fails part-way through the write
    with pytest.raises(RuntimeError, match="disk on fire"):
        nn.save(boom, saved)
    assert saved.read_bytes() == before and os.listdir(saved.parent) == [saved.name]


def test_saved_files_get_the_mode_a_plain_open_gives(tmp_path):
    old = os.umask(0o027)
    try:
        path = nn.mlp(2, (2,), 2).save(tmp_path / "m.npz")
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o640
