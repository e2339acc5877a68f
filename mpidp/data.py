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
from .nn.sparse import CSR
from .partition import (
    assign,
    block_counts,
    block_range,
    check_weights,
    positions_of,
    scatter_plan,
    train_test_split,
)
from .sources import Source, check_rows, open_source

DISTRIBUTE = ("scatter", "local")


@dataclass
class Shard:
    """This rank's part of a global set of ``n_total`` samples.

    ``X`` is ``(n_local, n_features)``; ``y`` is ``(n_local,)`` int64 labels or
    ``(n_local, n_targets)`` / ``(n_local,)`` float targets. Row ``i`` of ``X`` has global
    position ``positions[i]`` (int64, increasing); for a contiguous block (the default when
    ``positions`` is not given) that is ``start + i``. ``X`` may also be a
    :class:`mpidp.nn.sparse.CSR` of sparse rows.
    """

    X: np.ndarray
    y: np.ndarray
    start: int
    n_total: int
    positions: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.positions is None:
            self.positions = np.arange(self.start, self.start + len(self.X), dtype=np.int64)
        self.positions = np.asarray(self.positions, np.int64)

    @property
    def stop(self) -> int:
        """End of the block (meaningful when :attr:`contiguous`)."""
        return self.start + len(self.X)

    @property
    def contiguous(self) -> bool:
        """True when the positions are ``start .. stop-1``."""
        p = self.positions
        return len(p) == 0 or (int(p[0]) == self.start and int(p[-1]) - int(p[0]) + 1 == len(p))


@dataclass
class Data:
    """Train and test shards plus what every rank needs to build a model."""

    train: Shard
    test: Shard
    name: str
    n_features: int
    n_outputs: int  # classes for classification, targets for regression
    classification: bool
    costs: np.ndarray | None = None  # (n_train,) work per training position, if known


def _cast(source: Source, X, y, dtype) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(y, np.int64) if source.classification else np.asarray(y, dtype)
    return (X.astype(dtype) if isinstance(X, CSR) else np.ascontiguousarray(X, dtype)), y


def _train_costs(src: Source, costs, train_rows: np.ndarray) -> np.ndarray | None:
    """Per-training-position costs: ``costs`` (one per dataset row) or the source's own."""
    if costs is None:
        return src.costs()[train_rows] if hasattr(src, "costs") else None
    return check_weights(costs, src.n_samples, "costs")[train_rows]


def _scatter_X(comm, X, counts, meta, dtype, root) -> np.ndarray | CSR:
    """Scatterv rows of dense ``X`` or of CSR ``X`` (row lengths, then indices and values)."""
    if not meta["sparse"]:
        return C.scatterv_rows(comm, X, counts, (meta["n_features"],), np.dtype(dtype), root)
    is_root = comm.rank == root
    lengths = C.scatterv_rows(comm, X.row_lengths() if is_root else None, counts, (),
                              np.dtype(np.int64), root)
    nnz = C.allgather_counts(comm, int(lengths.sum()))
    indices = C.scatterv_rows(comm, X.indices if is_root else None, nnz, (), np.dtype(np.int64), root)
    data = C.scatterv_rows(comm, X.data if is_root else None, nnz, (), np.dtype(dtype), root)
    return CSR(np.concatenate([[0], np.cumsum(lengths)]), indices, data, meta["n_features"])


def _n_outputs_from(classification: bool, target_shape: tuple[int, ...], max_label: int,
                    n_classes: int | None) -> int:
    if not classification:
        return int(np.prod(target_shape, dtype=np.int64)) if target_shape else 1
    return n_classes if n_classes is not None else max(max_label + 1, 2)


class _RootReader:
    """Root's view of ``rows`` of ``source`` (in any order) that ``scatterv_rows`` slices
    round by round: it reads, checks and casts only the rows asked for, and keeps the
    (small) targets, so root never holds more than one round of features at a time."""

    def __init__(self, source: Source, rows: np.ndarray, dtype, n_classes: int | None) -> None:
        self.source, self.rows, self.dtype, self.n_classes = source, rows, dtype, n_classes
        y_dtype = np.int64 if source.classification else np.dtype(dtype)
        self.y = np.empty((len(rows), *source.target_shape), y_dtype)
        self.error: str | None = None
        self.max_label = -1

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, sl: slice):
        rows = self.rows[sl]
        order = np.argsort(rows, kind="stable")  # sources read increasing row numbers
        X, y = self.source.read(rows[order])
        back = np.argsort(order, kind="stable")
        X, y = X[back], y[back]
        self.error = self.error or check_rows(self.source, X, y, rows, self.n_classes)
        if self.source.classification and len(y):
            self.max_label = max(self.max_label, int(np.max(y)))
        X, self.y[sl] = _cast(self.source, X, y, self.dtype)
        return X


def _load_scatter(comm, spec, test_fraction, seed, dtype, root, n_classes, source_kw,
                  layout) -> Data:
    held: dict = {}

    def open_on_root() -> dict:
        src = open_source(spec, seed=seed, **source_kw)
        train_rows, test_rows = train_test_split(src.n_samples, test_fraction, seed)
        held["costs"] = _train_costs(src, layout["costs"], train_rows)
        sparse = len(train_rows) > 0 and isinstance(src.read(train_rows[:1])[0], CSR)
        held.update(src=src, split=(train_rows, test_rows), readers=[])
        return {"name": src.name, "n": (len(train_rows), len(test_rows)),
                "n_features": src.n_features, "classification": src.classification,
                "y_shape": src.target_shape,
                "y_dtype": np.dtype(np.int64) if src.classification else np.dtype(dtype),
                "sparse": sparse, "has_costs": held["costs"] is not None}

    meta = C.root_decides(comm, open_on_root, root=root)
    costs = held.get("costs") if comm.rank == root else np.empty(meta["n"][0])
    costs = C.bcast_(comm, np.ascontiguousarray(costs, np.float64), root) if meta["has_costs"] else None
    owner = C.run_agreed(comm, assign, layout["strategy"], meta["n"][0], comm.size,
                         seed=seed, costs=costs, capacities=layout["capacities"])
    shards = []
    for i, n in enumerate(meta["n"]):
        counts, positions, order = block_counts(n, comm.size), None, None
        if i == 0:  # training rows follow the partition strategy; test rows stay in blocks
            order, counts, _ = scatter_plan(owner, comm.size)
            positions = positions_of(owner, comm.rank)
        reader = None
        if comm.rank == root:
            rows = held["split"][i] if order is None else held["split"][i][order]
            reader = _RootReader(held["src"], rows, dtype, n_classes)
            held["readers"].append(reader)
        X = reader if not meta["sparse"] or reader is None else reader[0:len(reader)]
        X = _scatter_X(comm, X, counts, meta, dtype, root)
        y = C.scatterv_rows(comm, reader.y if reader else None, counts, meta["y_shape"],
                            meta["y_dtype"], root)
        start = block_range(n, comm.size, comm.rank)[0] if positions is None else (
            int(positions[0]) if len(positions) else 0)
        shards.append(Shard(X, y, start, n, positions))

    def verdict() -> int:  # root checked every row while sending: agree on what it found
        error = next((r.error for r in held["readers"] if r.error), None)
        if error:
            raise ValueError(error)
        return max((r.max_label for r in held["readers"]), default=-1)

    max_label = C.root_decides(comm, verdict, root=root)
    n_outputs = _n_outputs_from(meta["classification"], meta["y_shape"], max_label, n_classes)
    return Data(shards[0], shards[1], meta["name"], meta["n_features"], n_outputs,
                meta["classification"], costs)


def _load_local(comm, spec, test_fraction, seed, dtype, n_classes, source_kw, layout) -> Data:
    src = C.run_agreed(comm, open_source, spec, seed=seed, **source_kw)
    split = train_test_split(src.n_samples, test_fraction, seed)
    costs = C.run_agreed(comm, _train_costs, src, layout["costs"], split[0])
    owner = C.run_agreed(comm, assign, layout["strategy"], len(split[0]), comm.size,
                         seed=seed, costs=costs, capacities=layout["capacities"])
    shards, error, max_label = [], None, -1
    for i, rows in enumerate(split):
        start, stop = block_range(len(rows), comm.size, comm.rank)
        positions = np.arange(start, stop) if i else positions_of(owner, comm.rank)
        X, y = src.read(rows[positions])
        error = error or check_rows(src, X, y, rows[positions], n_classes)
        if src.classification and len(y):
            max_label = max(max_label, int(y.max()))
        start = int(positions[0]) if len(positions) else start
        shards.append(Shard(*_cast(src, X, y, dtype), start, len(rows), positions))
    C.agree(comm, error)
    max_label = int(C.allreduce_max(comm, [max_label])[0])
    return Data(shards[0], shards[1], src.name, src.n_features,
                _n_outputs_from(src.classification, src.target_shape, max_label, n_classes),
                src.classification, costs)


def load(comm: C.Comm, spec: str, *, distribute: str = "scatter", test_fraction: float = 0.2,
         seed: int = 0, dtype: npt.DTypeLike = np.float32, root: int = 0,
         n_classes: int | None = None, partition: str = "block", costs=None,
         capacities=None, **source_kw) -> Data:
    """Load dataset ``spec`` (see :func:`mpidp.sources.open_source`) split over ``comm``.

    Collective. ``distribute="scatter"``: ``root`` reads everything and sends each rank its
    rows with ``Scatterv``. ``"local"``: every rank reads only its own rows (memory-mapped
    ``.npy``/``.npz``, HDF5 slices), with no data communication. Bad input raises the same
    :class:`mpidp.MpidpError` on every rank.

    ``partition`` names the strategy (:data:`mpidp.partition.STRATEGIES`) that decides which
    training samples each rank holds (test samples are always split in blocks); ``costs``
    ``(n_samples,)`` are per-row costs of the whole dataset (default: the source's own, for
    the ``bow`` workload, else none) and ``capacities`` ``(size,)`` relative rank speeds.
    ``Data.costs`` holds the training positions' costs.
    """
    if distribute not in DISTRIBUTE:
        raise C.MpidpError(f"unknown distribute mode {distribute!r}; expected one of {DISTRIBUTE}")
    if not 0 <= test_fraction < 1:
        raise C.MpidpError(f"test fraction must be in [0, 1), got {test_fraction}")
    if n_classes is not None and n_classes < 2:
        raise C.MpidpError(f"number of classes must be >= 2, got {n_classes}")
    if n_classes is not None:
        source_kw.setdefault("n_classes", n_classes)  # synthetic data makes that many
    layout = {"strategy": partition, "costs": costs, "capacities": capacities}
    if distribute == "scatter":
        data = _load_scatter(comm, spec, test_fraction, seed, dtype, root, n_classes, source_kw,
                             layout)
    else:
        data = _load_local(comm, spec, test_fraction, seed, dtype, n_classes, source_kw, layout)
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
