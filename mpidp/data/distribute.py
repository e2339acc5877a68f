"""Distribute a dataset over the ranks: root reads and streams ``Scatterv``s, or each rank
reads its own rows (:class:`~.rows.RowReader`); either way rank ``r`` gets the same
:class:`Shard`, training positions owned as the partition strategy says, test rows in
blocks. Also loading over a dedicated server's workers, and standardizing over ranks."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from .. import comm as C
from ..digest import dtype_name
from ..errors import setting
from ..nn.sparse import CSR
from ..nn.standardize import Standardize, pass1_mean, pass1_sums, pass2_squares
from . import crc32
from .datasets import SHAPE_RULE, Source
from .partition import (
    assign,
    block_counts,
    block_range,
    check_weights,
    counts_displs,
    positions_of,
    scatter_plan,
    split_rows,
    validation_split,
)
from .rows import RowReader, Timings
from .sources import crc_mismatch, metadata_fingerprint, open_source, stored_members

DISTRIBUTE = ("scatter", "local")


@dataclass
class Shard:
    """This rank's part of a global set of ``n_total`` samples: ``X`` ``(n_local, *sample_shape)``
    (or a :class:`mpidp.nn.sparse.CSR`; possibly a copy-on-write map of the file, see :func:`load`),
    ``y`` ``(n_local,)`` int64 labels or float targets ``(n_local, ...)``. Row ``i`` has global
    position ``positions[i]`` (int64, increasing; by default the contiguous block ``start + i``)."""

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
    def sample_shape(self) -> tuple[int, ...]:
        """The shape of one sample, ``X.shape[1:]`` (``(n_features,)`` for sparse rows)."""
        return tuple(self.X.shape[1:])

    def identity(self, name: str) -> dict[str, object]:
        """What every rank's part of one data set shares, by name (``"{name} rows"``: the
        global row count; the sample shape; the dtypes), for a collective check."""
        return {f"{name} rows": int(self.n_total), f"{name} sample shape": self.sample_shape,
                f"{name} dtypes": (str(self.X.dtype), str(self.y.dtype))}

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
    """Train, test (and validation) shards plus what every rank needs to build a model.

    ``n_features``: values per sample, ``prod(sample_shape)`` (``sample_shape`` default: the
    training shard's, or ``(n_features,)``). ``test_split``: ``"random"`` (a seeded fraction)
    or ``"fixed"`` (the dataset's own test set, its last rows)."""

    train: Shard
    test: Shard
    name: str
    n_features: int
    n_outputs: int  # classes for classification, targets for regression
    classification: bool
    costs: np.ndarray | None = None  # (n_train,) work per training position, if known
    sample_shape: tuple[int, ...] | None = None
    test_split: str = "random"
    val: Shard | None = None  # the validation rows (held out of training), if asked for

    def __post_init__(self) -> None:
        if self.sample_shape is None:
            shape = self.train.sample_shape
            self.sample_shape = shape if int(np.prod(shape)) == self.n_features else (self.n_features,)
        self.sample_shape = tuple(int(d) for d in self.sample_shape)
        if int(np.prod(self.sample_shape, dtype=np.int64)) != self.n_features:
            raise ValueError(f"sample shape {self.sample_shape} does not hold {self.n_features} "
                             f"features")


def _plan(src: Source, n_classes, test_fraction, seed, layout) -> tuple[tuple, np.ndarray | None]:
    """``((train_rows, test_rows, val_rows), costs)``: the splits and the training positions'
    costs (``layout["costs"]`` or the source's own); ValueError for classes of a regression."""
    if n_classes is not None and not src.classification:
        raise ValueError(f"{src.name}: {setting('n_classes', n_classes)} does not apply: its "
                         f"targets are real values (a regression), not class labels")
    train, test = split_rows(src.n_samples, test_fraction, seed, src.fixed_test)
    train, val = validation_split(train, layout["val_fraction"], seed)
    if layout["costs"] is None:
        return (train, test, val), src.costs()[train] if hasattr(src, "costs") else None
    return (train, test, val), check_weights(layout["costs"], src.n_samples, "costs")[train]


def _meta(src: Source, split: tuple, costs, test_fraction, dtype) -> dict:
    """What every rank needs of an opened source (pickled to the ranks by a scatter)."""
    return {"name": src.name, "n": tuple(len(rows) for rows in split),
            "n_features": src.n_features, "sample_shape": src.sample_shape,
            "classification": src.classification, "y_shape": src.target_shape,
            "fixed": test_fraction is None and src.fixed_test is not None,
            "y_dtype": np.dtype(np.int64) if src.classification else np.dtype(dtype),
            "has_costs": costs is not None}


def _data(meta: dict, shards: list[Shard], costs, max_label: int, n_classes) -> Data:
    outputs = (max(max_label + 1, 2) if n_classes is None else n_classes) if meta[
        "classification"] else int(np.prod(meta["y_shape"], dtype=np.int64))
    return Data(shards[0], shards[1], meta["name"], meta["n_features"], outputs,
                meta["classification"], costs, meta["sample_shape"],
                "fixed" if meta["fixed"] else "random", shards[2] if shards[2].n_total else None)


def _scatter_sparse(comm, reader, rows, counts, meta, dtype, root):
    """Scatterv CSR rows (lengths, then indices and values) and their targets."""
    is_root = comm.rank == root
    X = y = None
    if is_root:
        displs = counts_displs(counts)[1]
        parts = [reader.read(rows[d:d + c]) for d, c in zip(displs, counts)]
        X = CSR.concat([p[0] for p in parts], meta["n_features"], dtype)
        y = np.concatenate([p[1] for p in parts]) if parts else None
    i64 = np.dtype(np.int64)
    lengths = C.scatterv_rows(comm, X.row_lengths() if is_root else None, counts, (), i64, root)
    nnz = C.allgather_counts(comm, int(lengths.sum()))
    indices = C.scatterv_rows(comm, X.indices if is_root else None, nnz, (), i64, root)
    data = C.scatterv_rows(comm, X.data if is_root else None, nnz, (), np.dtype(dtype), root)
    y = C.scatterv_rows(comm, y, counts, meta["y_shape"], meta["y_dtype"], root)
    return CSR(np.concatenate([[0], np.cumsum(lengths)]), indices, data, meta["n_features"]), y


def _scatter_dense(comm, reader, rows, counts, meta, dtype, root, clock):
    """Stream ``X[rows]`` to the ranks (``counts[r]`` rows each) in rounds, root reading each
    rank's next rows straight into the send buffer; then the targets in one ``Scatterv``."""
    displs = counts_displs(counts)[1]
    fill, y_all = None, None
    if comm.rank == root:
        y_all = np.empty((len(rows), *meta["y_shape"]), meta["y_dtype"])

        def fill(rank: int, lo: int, dest: np.ndarray) -> None:
            clock.lap("send")  # the time since the last fill went to the previous Scatterv
            a = int(displs[rank]) + lo
            reader.into(rows[a:a + len(dest)], dest, y_all[a:a + len(dest)])

    X = C.scatterv_fill(comm, counts, meta["sample_shape"], np.dtype(dtype), fill, root)
    y = C.scatterv_rows(comm, y_all, counts, meta["y_shape"], meta["y_dtype"], root)
    clock.lap("send")
    return X, y


def _load_scatter(comm, spec, test_fraction, seed, dtype, root, n_classes, source_kw,
                  layout, clock) -> Data:
    held: dict = {}

    def open_on_root() -> dict:
        src = open_source(spec, seed=seed, **source_kw)
        split, costs = _plan(src, n_classes, test_fraction, seed, layout)
        held.update(src=src, split=split, costs=costs)
        sparse = len(split[0]) > 0 and isinstance(src.read(split[0][:1])[0], CSR)
        return {**_meta(src, split, costs, test_fraction, dtype), "sparse": sparse}

    meta = C.root_decides(comm, open_on_root, root=root)
    costs = held.get("costs") if comm.rank == root else np.empty(meta["n"][0])
    costs = C.bcast_(comm, np.ascontiguousarray(costs, np.float64), root) if meta[
        "has_costs"] else None
    owner = C.run_agreed(comm, assign, layout["strategy"], meta["n"][0], comm.size,
                         seed=seed, costs=costs, capacities=layout["capacities"])
    reader = RowReader(held["src"], dtype, n_classes, clock) if comm.rank == root else None
    clock.lap("open")
    shards = []
    for i, n in enumerate(meta["n"]):
        counts, positions, rows = block_counts(n, comm.size), None, None
        if i == 0:  # training rows follow the partition strategy; test rows stay in blocks
            order, counts, _ = scatter_plan(owner, comm.size)
            positions = positions_of(owner, comm.rank)
        if comm.rank == root:  # each rank's rows in increasing order, rank 0's first
            rows = held["split"][i] if i else held["split"][i][order]
        if meta["sparse"]:
            X, y = _scatter_sparse(comm, reader, rows, counts, meta, dtype, root)
        else:
            X, y = _scatter_dense(comm, reader, rows, counts, meta, dtype, root, clock)
        start = block_range(n, comm.size, comm.rank)[0] if positions is None else (
            int(positions[0]) if len(positions) else 0)
        shards.append(Shard(X, y, start, n, positions))

    def verdict() -> int:  # root checked every row while sending: agree on what it found
        if reader.error:
            raise ValueError(reader.error)
        return reader.max_label

    return _data(meta, shards, costs, C.root_decides(comm, verdict, root=root), n_classes)


def crc_together(comm: C.Comm, path: str, spans: list[tuple[int, int]]) -> list[int]:
    """The CRC-32 of each ``(offset, size)`` span of file ``path``, each rank reading ``1/size``
    of every span. Collective; a rank's read error raises the same error on every rank."""
    mine, error = np.zeros((len(spans), 2)), None
    if not os.path.isfile(path):  # this rank's host has no copy (local reads need one)
        error = f"dataset not found: {path!r} on this rank's host"
    for i, (offset, size) in enumerate(spans if error is None else []):
        a, b = crc32.share(size, comm.size, comm.rank)
        try:
            mine[i] = crc32.of_range(path, offset + a, b - a), b - a
        except OSError as exc:
            error = error or f"{path}: bytes {offset + a}-{offset + b} cannot be read: {exc}"
    C.agree(comm, error)
    parts = C.allgather_rows(comm, mine.reshape(-1)).reshape(comm.size, len(spans), 2)
    out = [0] * len(spans)
    for i, rank in itertools.product(range(len(spans)), range(comm.size)):
        part, length = parts[rank, i]  # CRC-32 values and lengths are exact in float64
        out[i] = crc32.combine(out[i], int(part), int(length))
    return out


def _verify_together(comm, path: str) -> None:
    """Check the CRC-32 of each memory-mapped member of the ``.npz`` file ``path`` together
    (nothing for other sources); a mismatch or read error raises on every rank. Collective."""
    members = C.root_decides(comm, stored_members, path)  # one list (and offsets) for all
    if not members:
        return
    crcs = crc_together(comm, path, [(offset, size) for _, offset, size, _ in members])
    for (name, _, _, stored), crc in zip(members, crcs):
        if crc != stored:  # the same table on every rank: the same verdict
            raise C.MpidpError(crc_mismatch(path, name))


def data_fingerprint(comm: C.Comm, spec: str, together: bool, root: int = 0) -> dict:
    """:func:`~mpidp.data.sources.metadata_fingerprint` of ``spec`` with the CRC-32 of
    each file that is not a zip, read by every rank's share when ``together`` (each host has
    the file), else by ``root``. The same dict on every rank. Collective."""
    meta = C.root_decides(comm, metadata_fingerprint, spec, root=root)
    files = [f for f in meta.get("files", []) if "crc" not in f]
    if not files:
        return meta
    paths = [os.path.join(spec, f["name"]) if os.path.isdir(spec) else spec for f in files]
    group = comm if together else C.self_comm()
    if together or comm.rank == root:
        crcs = [crc_together(group, p, [(0, f["size"])])[0] for p, f in zip(paths, files)]
    crcs = C.bcast_obj(comm, crcs if comm.rank == root else None, root)
    for f, crc in zip(files, crcs):
        f["crc32"] = crc
    return meta


def _load_local(comm, spec, test_fraction, seed, dtype, n_classes, source_kw, layout,
                clock, copy) -> Data:
    # every rank checks a share of each .npz member's CRC-32 first: corruption is named so
    if source_kw.pop("verify", True) and isinstance(spec, str):
        _verify_together(comm, spec)
    src = C.run_agreed(comm, open_source, spec, seed=seed, verify=False, **source_kw)
    split, costs = C.run_agreed(comm, _plan, src, n_classes, test_fraction, seed, layout)
    owner = C.run_agreed(comm, assign, layout["strategy"], len(split[0]), comm.size,
                         seed=seed, costs=costs, capacities=layout["capacities"])
    reader = RowReader(src, dtype, n_classes, clock, maps=not copy)
    clock.lap("open")
    shards = []
    for i, rows in enumerate(split):
        start, stop = block_range(len(rows), comm.size, comm.rank)
        positions = np.arange(start, stop) if i else positions_of(owner, comm.rank)
        X, y = reader.read(rows[positions])
        start = int(positions[0]) if len(positions) else start
        shards.append(Shard(X, y, start, len(rows), positions))
    C.agree(comm, reader.error)
    max_label = int(C.allreduce_max(comm, [reader.max_label])[0])
    return _data(_meta(src, split, costs, test_fraction, dtype), shards, costs, max_label,
                 n_classes)


def load(comm: C.Comm, spec: str | os.PathLike, *, distribute: str = "scatter",
         test_fraction: float | None = None, seed: int = 0, dtype: npt.DTypeLike = np.float32,
         root: int = 0, n_classes: int | None = None, partition: str = "block", costs=None,
         capacities=None, timings: dict | None = None, copy: bool = False,
         val_fraction: float = 0.0, **source_kw) -> Data:
    """Load dataset ``spec`` (:func:`mpidp.data.sources.open_source`) split over ``comm``: every
    rank gets ``X`` ``(n_local, *sample_shape)``. Collective; bad input raises the same
    :class:`mpidp.MpidpError` on every rank. ``test_fraction``: rows held out at random (None:
    the dataset's own test set, else 0.2); ``val_fraction``: training rows held out as ``Data.val``.
    ``distribute``: ``"scatter"`` (``root`` reads and streams) or ``"local"`` (each rank reads its
    own rows). ``partition``, ``costs`` ``(n_samples,)``, ``capacities`` ``(size,)``: the training
    rows' strategy and its inputs. ``timings``: a dict that receives this rank's seconds per phase.

    Local reads of one run of plain bytes in ``dtype`` (``.npy``, contiguous HDF5), with a
    block partition and no random test split, map the file copy-on-write: it must then not
    be truncated or rewritten in place (a rename is safe), or reading ends with SIGBUS;
    ``copy=True`` reads into private memory instead."""
    clock = Timings(timings)
    spec = os.fspath(spec)  # a pathlib.Path names a file as a string does
    C.agree_same(comm, "load", {  # before any collective that could then hang
        "dataset": spec, "distribute": distribute, "test_fraction": test_fraction,
        "seed": seed, "dtype": dtype_name(dtype), "root": root, "n_classes": n_classes,
        "partition": partition, "costs": None if costs is None else np.shape(costs),
        "capacities": None if capacities is None else np.shape(capacities),
        "copy": copy, "val_fraction": val_fraction, **dict(sorted(source_kw.items()))})
    if distribute not in DISTRIBUTE:
        raise C.MpidpError(f"unknown distribute mode {distribute!r}; expected one of {DISTRIBUTE}")
    if test_fraction is not None and not 0 <= test_fraction < 1:
        raise C.MpidpError(f"test fraction must be in [0, 1), got {test_fraction}")
    if n_classes is not None and n_classes < 2:
        raise C.MpidpError(f"number of classes must be >= 2, got {n_classes}")
    if n_classes is not None:
        source_kw.setdefault("n_classes", n_classes)  # synthetic data makes that many
    if not 0 <= val_fraction < 1:
        raise C.MpidpError(f"validation fraction must be in [0, 1), got {val_fraction}")
    layout = {"strategy": partition, "costs": costs, "capacities": capacities,
              "val_fraction": val_fraction}
    if distribute == "scatter":
        data = _load_scatter(comm, spec, test_fraction, seed, dtype, root, n_classes, source_kw,
                             layout, clock)
    else:
        data = _load_local(comm, spec, test_fraction, seed, dtype, n_classes, source_kw, layout,
                           clock, copy)
    if data.train.n_total == 0:
        held = data.val.n_total if data.val is not None else 0
        after = (f"the validation split ({setting('val_fraction', val_fraction)} held out all "
                 f"{held} rows the test split left)" if held else "the test split")
        raise C.MpidpError(f"{data.name}: no training samples left after {after}")
    return data


def shard_from_arrays(comm: C.Comm, X: np.ndarray, y: np.ndarray,
                      n_features: int | None = None, *,
                      sample_shape: tuple[int, ...] | None = None) -> Shard:
    """Wrap this rank's own ``(X, y)`` as a :class:`Shard`; global order is rank order.
    Collective: every rank raises the same error unless each ``X`` is ``(n_local,
    *sample_shape)`` of real, finite numbers, the same sample shape everywhere, labels >= 0."""
    X, y = np.asarray(X), np.asarray(y)
    C.agree(comm, _arrays_problem(X, y, n_features, sample_shape))  # each rank's verdict
    _agree_sample_shape(comm, tuple(X.shape[1:]))
    counts = C.allgather_counts(comm, len(X))
    return Shard(X, y, int(counts[:comm.rank].sum()), int(counts.sum()))


def _arrays_problem(X: np.ndarray, y: np.ndarray, n_features: int | None,
                    sample_shape: tuple[int, ...] | None) -> str | None:
    """What is wrong with this rank's ``X`` and ``y``, or None (never raises)."""
    for label, a in (("X", X), ("y", y)):
        if a.dtype.kind == "c":
            return (f"{label} is complex ({a.dtype}) but mpidp trains on real numbers: pass "
                    f"its real part, its magnitude, or both as separate columns")
        if a.dtype.kind not in "biuf":
            return f"{label} must be an array of numbers, got dtype {a.dtype}"
    shape = tuple(X.shape[1:])
    size = int(np.prod(shape, dtype=np.int64))
    if X.ndim < 2:
        return f"{SHAPE_RULE} (2-D for flat features), got shape {X.shape}"
    if y.ndim == 0 or len(X) != len(y):
        return f"X has {len(X)} rows but y has {len(y) if y.ndim else 'none'}: lengths disagree"
    if n_features is not None and size != n_features:
        return (f"X has {size} features but the model expects {n_features} (samples of shape "
                f"{shape})")
    if sample_shape is not None and shape != tuple(sample_shape):
        return f"X's samples have shape {shape} but the model expects {tuple(sample_shape)}"
    if not np.isfinite(X).all() or (y.dtype.kind == "f" and not np.isfinite(y).all()):
        return "the data contains NaN or Inf"
    if y.dtype.kind in "iu" and len(y) and y.min() < 0:
        return f"class labels must be >= 0, found {y.min()}"
    return None


def _agree_sample_shape(comm: C.Comm, shape: tuple[int, ...]) -> None:
    """Raise the same :class:`mpidp.MpidpError` on every rank unless every rank's sample
    shape is ``shape``, naming each shape and its ranks. Collective."""
    shapes = C.bcast_obj(comm, C.gather_obj(comm, shape))  # every rank's, on every rank
    if len(set(shapes)) > 1:
        ranks = {s: [r for r, t in enumerate(shapes) if t == s] for s in dict.fromkeys(shapes)}
        sizes = {int(np.prod(s, dtype=np.int64)) for s in ranks}
        what = "sample shape" if len(sizes) == 1 else "number of features per sample"
        raise C.MpidpError(f"ranks disagree on the {what}: " + "; ".join(
            f"{s} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
            for s, rs in ranks.items()) + "; every rank's X must be (n_local, *sample_shape) "
            "with the same sample_shape")


def load_on_workers(comm: C.Comm, server: int, load: Callable[[C.Comm], Data], dtype) -> Data:
    """``load(workers)`` on every rank of ``comm`` but a dedicated ``server``, which gets the
    same description with empty shards (of ``dtype``). Collective; errors reach every rank."""
    workers = C.split_off(comm, server)
    data, error = None, None
    if workers is not None:
        try:
            data = load(workers)
        except C.MpidpError as exc:
            error = str(exc)  # already agreed among the workers
    first_worker = 1 if server == 0 else 0
    if (error := C.bcast_obj(comm, error, root=first_worker)) is not None:
        raise C.MpidpError(error)
    empty = C.bcast_obj(comm, _emptied(data, dtype) if comm.rank == first_worker else None,
                        root=first_worker)
    return data if data is not None else empty


def _emptied(data: Data, dtype) -> Data:
    """``data`` with no rows: its description, shards of none of its samples."""
    y = data.train.y

    def empty(shard: Shard) -> Shard:
        return Shard(np.empty((0, *data.sample_shape), dtype),
                     np.empty((0, *y.shape[1:]), y.dtype), 0, shard.n_total)

    return replace(data, train=empty(data.train), test=empty(data.test), costs=None,
                   val=empty(data.val) if data.val is not None and data.val.n_total else None)


def fit_over_ranks(comm: C.Comm, layer: Standardize, X: np.ndarray) -> None:
    """Fit ``layer`` to the exact mean and standard deviation of every rank's ``X`` together
    (one ``Allreduce`` of counts and sums, one of centred squares). Collective."""
    count, mean = pass1_mean(C.allreduce_sum_(comm, pass1_sums(X)))
    layer.fit_(count, mean, C.allreduce_sum_(comm, pass2_squares(X, mean)))
