"""A data set as its rows: the :class:`Source` protocol and :class:`ArraySource`, arrays
read by fancy indexing (in memory, memory-mapped or HDF5). No MPI."""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

SHAPE_RULE = "X must be (n_samples, *sample_shape) with at least 2 dimensions"


class Source(ABC):
    """A dataset of ``n_samples`` rows: samples ``(n_samples, *sample_shape)`` and targets.

    ``n_features``: values per sample, ``prod(sample_shape)``. ``classification``: targets
    are integer labels ``(n_samples,)``, else floats ``(n_samples,)`` or ``(n_samples,
    n_targets)``. ``fixed_test``: how many trailing rows form the dataset's own test set (a
    published split), or None."""

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
    """Arrays (in memory, memory-mapped or HDF5 datasets) read by fancy indexing: ``X``
    ``(n_samples, *sample_shape)``, ``y`` ``(n_samples,)`` or ``(n_samples, n_targets)``;
    ``fixed_test`` as for :class:`Source`."""

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
