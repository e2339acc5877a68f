"""Distribute a dataset over ranks, both ways: root reads and ``Scatterv``s, or each rank
reads only its own rows. Either way rank ``r`` ends up with the same :class:`Shard`.

The train/test split is a seeded choice of rows; the training rows then get global
positions ``0 .. n_train-1`` (in file order) and rank ``r`` owns the block
``partition.block_range(n_train, size, r)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from . import comm as C
from .partition import block_counts, block_range, train_test_split
from .sources import Source, check_rows, open_source

DISTRIBUTE = ("scatter", "local")


@dataclass
class Shard:
    """This rank's part of a global set of ``n_total`` samples.

    ``X`` is ``(n_local, n_features)``; ``y`` is ``(n_local,)`` int64 labels or
    ``(n_local, n_targets)`` / ``(n_local,)`` float targets. Row ``i`` of ``X`` has global
    position ``start + i``.
    """

    X: np.ndarray
    y: np.ndarray
    start: int
    n_total: int

    @property
    def stop(self) -> int:
        return self.start + len(self.X)


@dataclass
class Data:
    """Train and test shards plus what every rank needs to build a model."""

    train: Shard
    test: Shard
    name: str
    n_features: int
    n_outputs: int  # classes for classification, targets for regression
    classification: bool


def _cast(source: Source, X, y, dtype) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(y, np.int64) if source.classification else np.asarray(y, dtype)
    return np.ascontiguousarray(X, dtype), y


def _n_outputs_from(classification: bool, target_shape: tuple[int, ...], max_label: int,
                    n_classes: int | None) -> int:
    if not classification:
        return int(np.prod(target_shape, dtype=np.int64)) if target_shape else 1
    return n_classes if n_classes is not None else max(max_label + 1, 2)


class _RootReader:
    """Root's view of ``rows`` of ``source`` that ``scatterv_rows`` slices round by round:
    it reads, checks and casts only the rows asked for, and keeps the (small) targets."""

    def __init__(self, source: Source, rows: np.ndarray, dtype, n_classes: int | None) -> None:
        self.source, self.rows, self.dtype, self.n_classes = source, rows, dtype, n_classes
        y_dtype = np.int64 if source.classification else np.dtype(dtype)
        self.y = np.empty((len(rows), *source.target_shape), y_dtype)
        self.error: str | None = None

    def __getitem__(self, sl: slice) -> np.ndarray:
        rows = self.rows[sl]
        X, y = self.source.read(rows)
        self.error = self.error or check_rows(self.source, X, y, rows, self.n_classes)
        X, self.y[sl] = _cast(self.source, X, y, self.dtype)
        return X


def _load_scatter(comm, spec, test_fraction, seed, dtype, root, n_classes, source_kw) -> Data:
    held: dict = {}

    def open_on_root() -> dict:
        src = open_source(spec, seed=seed, **source_kw)
        held["readers"] = [_RootReader(src, rows, dtype, n_classes)
                           for rows in train_test_split(src.n_samples, test_fraction, seed)]
        return {"name": src.name, "n": [len(r.rows) for r in held["readers"]],
                "n_features": src.n_features, "classification": src.classification,
                "y_shape": src.target_shape, "y_dtype": held["readers"][0].y.dtype}

    meta = C.root_decides(comm, open_on_root, root=root)
    parts = []
    for i, n in enumerate(meta["n"]):
        reader = held["readers"][i] if comm.rank == root else None
        counts = block_counts(n, comm.size)
        X = C.scatterv_rows(comm, reader, counts, (meta["n_features"],), np.dtype(dtype), root)
        y = C.scatterv_rows(comm, reader.y if reader else None, counts, meta["y_shape"],
                            meta["y_dtype"], root)
        parts.append(Shard(X, y, block_range(n, comm.size, comm.rank)[0], n))

    def verdict() -> int:  # root checked every row while sending: agree on what it found
        readers = held["readers"]
        error = next((r.error for r in readers if r.error), None)
        if error:
            raise ValueError(error)
        labels = [r.y for r in readers if len(r.y)] if meta["classification"] else []
        return max((int(y.max()) for y in labels), default=0)

    max_label = C.root_decides(comm, verdict, root=root)
    n_outputs = (_n_outputs_from(meta["classification"], meta["y_shape"], max_label, n_classes))
    return Data(parts[0], parts[1], meta["name"], meta["n_features"], n_outputs,
                meta["classification"])


def _load_local(comm, spec, test_fraction, seed, dtype, n_classes, source_kw) -> Data:
    src = C.run_agreed(comm, open_source, spec, seed=seed, **source_kw)
    split = train_test_split(src.n_samples, test_fraction, seed)
    shards, error, max_label = [], None, -1
    for rows in split:
        start, stop = block_range(len(rows), comm.size, comm.rank)
        X, y = src.read(rows[start:stop])
        error = error or check_rows(src, X, y, rows[start:stop], n_classes)
        if src.classification and len(y):
            max_label = max(max_label, int(y.max()))
        shards.append(Shard(*_cast(src, X, y, dtype), start, len(rows)))
    C.agree(comm, error)
    max_label = int(C.allreduce_max(comm, [max_label])[0])
    return Data(shards[0], shards[1], src.name, src.n_features,
                _n_outputs_from(src.classification, src.target_shape, max_label, n_classes),
                src.classification)


def load(comm: C.Comm, spec: str, *, distribute: str = "scatter", test_fraction: float = 0.2,
         seed: int = 0, dtype: npt.DTypeLike = np.float32, root: int = 0,
         n_classes: int | None = None, **source_kw) -> Data:
    """Load dataset ``spec`` (see :func:`mpidp.sources.open_source`) split over ``comm``.

    Collective. ``distribute="scatter"``: ``root`` reads everything and sends each rank its
    rows with ``Scatterv``. ``"local"``: every rank reads only its own rows (memory-mapped
    ``.npy``/``.npz``, HDF5 slices), with no data communication. Bad input raises the same
    :class:`mpidp.MpidpError` on every rank.
    """
    if distribute not in DISTRIBUTE:
        raise C.MpidpError(f"unknown distribute mode {distribute!r}; expected one of {DISTRIBUTE}")
    if not 0 <= test_fraction < 1:
        raise C.MpidpError(f"test fraction must be in [0, 1), got {test_fraction}")
    if n_classes is not None and n_classes < 2:
        raise C.MpidpError(f"number of classes must be >= 2, got {n_classes}")
    if n_classes is not None:
        source_kw.setdefault("n_classes", n_classes)  # synthetic data makes that many
    if distribute == "scatter":
        data = _load_scatter(comm, spec, test_fraction, seed, dtype, root, n_classes, source_kw)
    else:
        data = _load_local(comm, spec, test_fraction, seed, dtype, n_classes, source_kw)
    if data.train.n_total == 0:
        raise C.MpidpError(f"{data.name}: no training samples left after the test split")
    return data


def shard_from_arrays(comm: C.Comm, X: np.ndarray, y: np.ndarray,
                      n_features: int | None = None) -> Shard:
    """Wrap this rank's own ``(X, y)`` as a :class:`Shard`; global order is rank order.

    Collective. Checks on every rank, agreed so all raise the same error: ``X`` 2-D with
    the same number of features everywhere (``n_features`` if given), ``len(X) == len(y)``,
    finite values, non-negative integer labels.
    """
    X, y = np.asarray(X), np.asarray(y)
    error = None
    if X.ndim != 2:
        error = f"X must be 2-D (n_samples, n_features), got shape {X.shape}"
    elif len(X) != len(y):
        error = f"X has {len(X)} rows but y has {len(y)}: lengths disagree"
    elif n_features is not None and X.shape[1] != n_features:
        error = f"X has {X.shape[1]} features but the model expects {n_features}"
    elif not np.isfinite(X).all() or (y.dtype.kind == "f" and not np.isfinite(y).all()):
        error = "the data contains NaN or Inf"
    elif y.dtype.kind in "iu" and len(y) and y.min() < 0:
        error = f"class labels must be >= 0, found {y.min()}"
    C.agree(comm, error)
    widths = C.allgather_counts(comm, X.shape[1])
    if len(set(widths.tolist())) > 1:
        raise C.MpidpError(f"ranks disagree on the number of features: {widths.tolist()}")
    counts = C.allgather_counts(comm, len(X))
    return Shard(X, y, int(counts[:comm.rank].sum()), int(counts.sum()))
