"""Data-parallel map/reduce outside training: split a dataset over the ranks (by a partition
strategy, or from a shared counter), apply one NumPy function to every part, and combine
the results (a reduction, or the rows in order on one rank or in one ``.npy`` file)."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from .. import comm as C
from ..data.partition import assign, positions_of

REDUCTIONS = ("sum", "mean", "min", "max", "concat")


class _Figure(IntEnum):
    """One rank's figures of a map: the columns of the table the ranks gather."""

    SAMPLES = 0  # rows mapped
    CHUNKS = 1
    COMPUTE_S = 2  # wall seconds in fn and the sink
    COMPUTE_CPU_S = 3  # CPU seconds of the same
    SECONDS = 4  # wall seconds of the whole map on this rank


@dataclass
class MapResult:
    """``value``: the reduction (every rank) or the concatenation (``root``; None when
    written to a file); ``per_rank``: each rank's samples, chunks and busy seconds;
    ``seconds``: the slowest rank's wall time."""

    value: np.ndarray | None
    per_rank: list[dict]
    seconds: float


def _rows_of(data, rows):
    source = hasattr(data, "read") and hasattr(data, "n_samples")  # a Source reads its rows
    return data.read(rows)[0] if source else data[rows]


def _rows_or_why(data) -> int | str:
    """The row count of ``data``, or why it has none (compared, never raised alone)."""
    try:
        return _n_rows(data)
    except Exception as exc:  # noqa: BLE001 - the same data raises the same on every rank
        return f"{type(exc).__name__}: {exc}"


def _n_rows(data) -> int:
    return int(data.n_samples) if hasattr(data, "n_samples") else len(data)


def _probe(fn, data) -> tuple[tuple[int, ...], str]:
    if _n_rows(data) == 0:
        raise ValueError("map_reduce: the dataset is empty (0 rows)")
    out = np.asarray(fn(_rows_of(data, np.arange(1))))
    if out.ndim < 1 or len(out) != 1:
        raise ValueError(f"map_reduce: fn must return one output row per input row; for 1 row "
                         f"it returned shape {out.shape}")
    return tuple(out.shape[1:]), out.dtype.str


def _chunks_dynamic(counter, n, chunk, seed) -> Iterator[np.ndarray]:
    # in a seeded random order, the same on every rank: the heaviest chunks of data sorted
    # by cost would otherwise all come last
    order = np.random.default_rng([seed, 0xC4]).permutation(-(-n // chunk))
    while (k := counter.next()) < len(order):
        c = int(order[k])
        yield np.arange(c * chunk, min((c + 1) * chunk, n))


def map_reduce(comm: C.Comm, fn: Callable[[np.ndarray], np.ndarray], data, reduce: str = "sum",
               *, partition: str = "block", costs=None, capacities=None, seed: int = 0,
               dynamic: bool = False, chunk_size: int = 256, out: str | None = None,
               root: int = 0) -> MapResult:
    """Apply ``fn`` (rows ``(m, ...)`` -> ``(m, *out_shape)``) to every row of ``data`` (an
    array, memmap, CSR or :class:`mpidp.data.sources.Source`, alike on every rank) and
    combine: ``sum``/``mean``/``min``/``max`` (float64, every rank) or ``concat`` (row order,
    on ``root`` or into the ``.npy`` ``out``). Rows go by ``partition``, ``chunk_size`` at
    a time, or (``dynamic``) from a shared counter. Collective."""
    C.agree_same(comm, "map_reduce", {  # the same rows everywhere: else messages mismatch
        "reduce": reduce, "partition": partition, "seed": seed, "dynamic": dynamic,
        "chunk_size": chunk_size, "out": out, "root": root, "rows": _rows_or_why(data),
        "row shape": tuple(getattr(data, "shape", (0, 0))[1:]),
        "costs": None if costs is None else np.asarray(costs).shape,
        "capacities": None if capacities is None else np.asarray(capacities).shape})
    if reduce not in REDUCTIONS:
        raise C.MpidpError(f"unknown reduction {reduce!r}; expected one of {REDUCTIONS}")
    if chunk_size < 1:
        raise C.MpidpError(f"chunk size must be >= 1, got {chunk_size}")
    if out is not None and reduce != "concat":
        raise C.MpidpError("an output file needs reduce='concat'")
    n = _n_rows(data)
    shape, dtype = C.root_decides(comm, _probe, fn, data, root=root)
    owner = None if dynamic else C.run_agreed(comm, assign, partition, n, comm.size, seed=seed,
                                              costs=costs, capacities=capacities)
    tmp = None if out is None else C.root_decides(comm, _create_npy, out, dtype, (n, *shape),
                                                   root=root)
    try:
        sink = C.run_agreed(comm, _Sink, comm, reduce, n, shape, dtype, out, tmp, root)
        counter = C.SharedCounter(comm) if dynamic else None
        C.barrier(comm)
        t0 = time.perf_counter()
        figures = np.zeros(len(_Figure))
        mine = None if dynamic else positions_of(owner, comm.rank)
        chunks = _chunks_dynamic(counter, n, chunk_size, seed) if dynamic else (
            mine[s:s + chunk_size] for s in range(0, len(mine), chunk_size))
        error = None
        try:
            for rows in chunks:
                w, c = time.perf_counter(), time.process_time()
                contiguous = len(rows) and rows[-1] - rows[0] + 1 == len(rows)
                pick = slice(int(rows[0]), int(rows[-1]) + 1) if contiguous and not hasattr(
                    data, "read") else rows  # a slice is cheaper for arrays and CSR rows
                sink.add(rows, np.asarray(fn(_rows_of(data, pick))))
                figures[:_Figure.SECONDS] += (len(rows), 1, time.perf_counter() - w,
                                              time.process_time() - c)  # the per-chunk figures
        except Exception as exc:  # noqa: BLE001 - agreed below, so every rank raises
            error = f"map_reduce: {type(exc).__name__}: {exc}"
        figures[_Figure.SECONDS] = time.perf_counter() - t0
        if counter is not None:
            counter.free(comm)
        try:
            C.agree(comm, error)
        except C.MpidpError:
            sink.discard()
            raise
        value = sink.finish()
        table = C.allgather_rows(comm, figures)
        per_rank = [{"rank": r, "samples": int(t[_Figure.SAMPLES]),
                     "chunks": int(t[_Figure.CHUNKS]), "compute_s": float(t[_Figure.COMPUTE_S]),
                     "compute_cpu_s": float(t[_Figure.COMPUTE_CPU_S])} for r, t in enumerate(table)]
        return MapResult(value, per_rank, float(table[:, _Figure.SECONDS].max()))
    finally:  # written: renamed to ``out`` already; else (a failure anywhere) removed
        if tmp is not None and comm.rank == root:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


def _create_npy(out: str, dtype: str, shape: tuple[int, ...]) -> str:
    """A new ``.npy`` of ``shape`` beside ``out``, under a name no other job can hold;
    returns its path."""
    folder, name = os.path.split(out)  # relative stays relative: each rank's own folder
    os.makedirs(folder or ".", exist_ok=True)
    path = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(6)}.part.npy")
    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # the umask's mode
    try:
        np.lib.format.open_memmap(path, "w+", np.dtype(dtype), shape).flush()
    except BaseException:
        os.unlink(path)
        raise
    return path


class _RowFile:
    """One rank's writer of rows into an existing ``.npy``: a ``pwrite`` per run of rows,
    or a memory map for scattered rows."""

    def __init__(self, path: str) -> None:
        header = np.load(path, mmap_mode="r")
        self.path, self.offset, self.dtype = path, header.offset, header.dtype
        self.row_bytes = header.dtype.itemsize * int(np.prod(header.shape[1:], dtype=np.int64))
        del header
        self.fd, self.map = os.open(path, os.O_WRONLY), None

    def write(self, rows: np.ndarray, values: np.ndarray) -> None:
        """Write ``values`` ``(m, ...)`` at increasing row numbers ``rows`` ``(m,)``."""
        if len(rows) == 0:
            return
        values = np.ascontiguousarray(values, self.dtype)
        starts = np.flatnonzero(np.diff(rows) != 1) + 1
        if len(starts) + 1 > max(1, len(rows) // 8):
            if self.map is None:
                self.map = np.load(self.path, mmap_mode="r+")
            self.map[rows] = values
            return
        for a, b in zip([0, *starts.tolist()], [*starts.tolist(), len(rows)]):
            view = memoryview(values[a:b]).cast("B")
            at = self.offset + int(rows[a]) * self.row_bytes
            while len(view):  # pwrite may write less than asked for
                done = os.pwrite(self.fd, view, at)
                view, at = view[done:], at + done

    def close(self) -> None:
        """Finish: the memory map (if any) is flushed, the file closed."""
        if self.map is not None:
            self.map.flush()
            self.map = None
        os.close(self.fd)


class _Sink:
    """Where one rank's outputs go: a running reduction, rows kept for a gather, or a file."""

    def __init__(self, comm, reduce, n, shape, dtype, out, tmp, root) -> None:
        self.comm, self.reduce, self.n, self.root, self.out = comm, reduce, n, root, out
        self.shape, self.dtype = shape, np.dtype(dtype)
        self.start = {"min": np.inf, "max": -np.inf}.get(reduce, 0.0)
        self.acc = np.full(shape, self.start, np.float64)
        self.rows, self.outs = [], []
        self.tmp = tmp  # created by the root (_create_npy); every rank writes its rows
        self.file = None if out is None else _RowFile(tmp)

    def add(self, rows: np.ndarray, values: np.ndarray) -> None:
        if values.shape != (len(rows), *self.shape):
            raise ValueError(f"fn returned shape {values.shape} for {len(rows)} rows; "
                             f"expected {(len(rows), *self.shape)}")
        if self.reduce in ("sum", "mean"):
            self.acc += values.sum(axis=0)
        elif self.reduce in ("min", "max"):
            fold = np.minimum if self.reduce == "min" else np.maximum
            fold(self.acc, getattr(values, self.reduce)(axis=0, initial=self.start), out=self.acc)
        elif self.file is not None:
            self.file.write(rows, values)
        else:
            self.rows.append(rows)
            self.outs.append(values.astype(self.dtype, copy=False))

    def discard(self) -> None:
        """After a failure on some rank: close the unfinished file (the root removes it)."""
        if self.file is not None:
            self.file.close()

    def finish(self) -> np.ndarray | None:
        if self.reduce in ("sum", "mean", "min", "max"):
            acc = C.allreduce_(self.comm, np.ascontiguousarray(self.acc), self.reduce
                               if self.reduce != "mean" else "sum")
            return acc / self.n if self.reduce == "mean" else acc
        if self.file is not None:
            self.file.close()
            C.barrier(self.comm)
            if self.comm.rank == self.root:
                os.replace(self.tmp, self.out)
            C.barrier(self.comm)
            return None
        rows = np.concatenate(self.rows) if self.rows else np.zeros(0, np.int64)
        outs = np.concatenate(self.outs) if self.outs else np.zeros((0, *self.shape), self.dtype)
        all_rows = C.gatherv_rows(self.comm, rows.astype(np.int64), self.root)
        all_outs = C.gatherv_rows(self.comm, outs, self.root)
        if self.comm.rank != self.root:
            return None
        result = np.empty((self.n, *self.shape), self.dtype)
        result[all_rows] = all_outs
        return result
