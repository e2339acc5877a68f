"""Reading rows of a source into buffers, cast and checked block by block, or mapped from
the file. Pure: no MPI (errors are kept for the caller to agree on)."""

from __future__ import annotations

import contextlib
import mmap
import os
import time

import numpy as np

from ..nn.sparse import CSR
from .crc32 import pread_into
from .sources import ArraySource, Source, check_rows


def cast_rows(source: Source, X, y, dtype) -> tuple[np.ndarray | CSR, np.ndarray]:
    """``(X, y)`` cast: ``X`` (dense C-contiguous, or CSR) and targets to ``dtype``, labels to int64."""
    y = np.asarray(y, np.int64) if source.classification else np.asarray(y, dtype)
    return (X.astype(dtype) if isinstance(X, CSR) else np.ascontiguousarray(X, dtype)), y


#: Bytes read, checked and cast at a time: a block is checked while still in the CPU cache
#: (block sizes: docs/benchmarks-data.md).
BLOCK_BYTES = 4 << 20


class Timings:
    """Seconds per phase (``open``, ``read``, ``check``, ``cast``, ``send``) added into the
    caller's dict, if any; each :meth:`lap` charges the time since the last to one phase."""

    def __init__(self, into: dict | None) -> None:
        self.into, self.t = into, time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        if self.into is not None:
            self.into[phase] = self.into.get(phase, 0.0) + now - self.t
        self.t = now


def finite_at_a_glance(X: np.ndarray) -> bool:
    """True when a float array is certainly finite: its sum of squares is (one BLAS dot, no
    bool array; docs/benchmarks-data.md). False when squares overflow: check in full then."""
    if X.dtype.kind != "f":
        return True
    flat = X.reshape(-1)
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(np.dot(flat, flat)))


def open_mapped(X) -> tuple[int, int, int] | None:
    """``(fd, offset of row 0, bytes per row)`` of an array stored as plain C-ordered bytes in a
    file (an ``np.memmap`` of ``.npy``/``.npz``, or :func:`hdf5_bytes`), opened for reading; else None."""
    if type(X) is np.memmap:
        plain = X.flags.c_contiguous and getattr(X, "filename", None)
        path, offset = (X.filename, int(X.offset)) if plain else (None, 0)
    else:
        path, offset = hdf5_bytes(X)
    if path is None:
        return None
    return os.open(path, os.O_RDONLY), offset, X.dtype.itemsize * int(np.prod(X.shape[1:]))


def hdf5_bytes(X) -> tuple[str | None, int]:
    """``(file, byte offset)`` of an HDF5 dataset stored in one contiguous run of its file
    (no chunks, filters or external storage; the default driver), else ``(None, 0)``."""
    try:
        if (not hasattr(X, "id") or X.chunks is not None or X.external
                or X.file.driver != "sec2" or X.dtype.hasobject):
            return None, 0
        offset = X.id.get_offset()  # None while the data are not allocated
    except (AttributeError, TypeError, ValueError):
        return None, 0
    return (X.file.filename, int(offset)) if offset is not None else (None, 0)


def map_rows(fd: int, start: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The C-ordered ``shape`` array of ``dtype`` from byte ``start`` of open file ``fd``, as
    a private copy-on-write memory map (the page cache's pages until written)."""
    count = int(np.prod(shape, dtype=np.int64))
    base = start - start % mmap.ALLOCATIONGRANULARITY
    mm = mmap.mmap(fd, start - base + count * dtype.itemsize, access=mmap.ACCESS_COPY, offset=base)
    with contextlib.suppress(AttributeError, OSError):
        mm.madvise(mmap.MADV_WILLNEED)  # a file not in the page cache: read ahead now
    return np.frombuffer(mm, dtype, count, start - base).reshape(shape)


class RowReader:
    """Reads increasing rows of ``source`` into buffers block by block, cast in the same copy
    and checked while in the CPU cache (or, with ``maps``, mapped); the first problem is kept
    in ``error`` for the caller to agree on; ``max_label``: the largest label seen (-1)."""

    def __init__(self, source: Source, dtype, n_classes: int | None, clock: Timings,
                 maps: bool = False) -> None:
        self.source, self.dtype, self.n_classes = source, np.dtype(dtype), n_classes
        self.clock, self.error, self.max_label, self.maps = clock, None, -1, maps
        self._in_place = False  # X_out already holds the rows (a map of the file)
        self.y_dtype = np.dtype(np.int64) if source.classification else self.dtype
        self.blocked = isinstance(source, ArraySource)
        self._file: tuple[int, int, int] | None = None  # (fd, offset, row bytes) of X's file

    def empty(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Buffers for ``n`` rows: ``X`` ``(n, *sample_shape)`` and ``y`` ``(n, *target_shape)``."""
        return (np.empty((n, *self.source.sample_shape), self.dtype),
                np.empty((n, *self.source.target_shape), self.y_dtype))

    def read(self, rows: np.ndarray) -> tuple[np.ndarray | CSR, np.ndarray]:
        """``(X[rows], y[rows])`` cast to the load dtypes; ``rows`` int64, increasing."""
        if self.blocked:
            X, y = self.empty(len(rows))
            mapped = self._map(rows) if self.maps else None
            self._in_place = mapped is not None
            try:
                self.into(rows, X if mapped is None else mapped, y)
            finally:
                self._in_place = False
            return (X if mapped is None else mapped), y
        X, y = self.source.read(rows)  # generated sources: read, check, cast whole
        self.clock.lap("read")
        self._note(check_rows(self.source, X, y, rows, self.n_classes), y)
        self.clock.lap("check")
        X, y = cast_rows(self.source, X, y, self.dtype)
        self.clock.lap("cast")
        return X, y

    def into(self, rows: np.ndarray, X_out: np.ndarray, y_out: np.ndarray) -> None:
        """Write ``X[rows]``, ``y[rows]`` into ``X_out``, ``y_out`` (cast); ``rows`` increasing."""
        if len(rows) == 0:
            return
        if not self.blocked:
            X_out[...], y_out[...] = self.read(rows)
            return
        self._file = None if self._in_place else open_mapped(self.source.X)
        h5py_calls = self._file is None and hasattr(self.source.X, "read_direct")
        block = BLOCK_BYTES * (8 if h5py_calls else 1)  # an HDF5 call has a fixed cost
        step = max(1, block // (self.source.n_features * self.source.X.dtype.itemsize))
        try:
            with np.errstate(over="ignore"):  # a cast that overflows is reported by check_rows
                for a in range(0, len(rows), step):
                    self._block(rows[a:a + step], X_out[a:a + step])
        except OSError as exc:  # noted, not raised: the other ranks may be mid-collective
            self._note(f"{self.source.name}: cannot read rows {int(rows[0])}..{int(rows[-1])}: "
                       f"{exc}", None)
        finally:
            if self._file is not None:
                os.close(self._file[0])
            self._file = None
        lo = int(rows[0])
        y = np.asarray(self.source.y[lo:int(rows[-1]) + 1])[rows - lo]
        self.clock.lap("read")
        no_X = np.empty((len(rows), 0), X_out.dtype)  # X was checked block by block
        # checked as stored (a uint64 label past int64 must not be named as its cast)
        error = check_rows(self.source, no_X, y, rows, self.n_classes, dtype=self.y_dtype)
        self._note(error, y if error is None else None)
        with np.errstate(over="ignore", invalid="ignore"):  # reported by the check
            y_out[...] = y
        self.clock.lap("check")

    def _block(self, rows: np.ndarray, X_out: np.ndarray) -> None:
        X = self._copy(rows, X_out)
        self.clock.lap("read")
        if self.error is None and not finite_at_a_glance(X_out):  # cast: overflow shows
            lo, hi = int(rows[0]), int(rows[-1]) + 1
            y = np.asarray(self.source.y[lo:hi])[rows - lo]
            self._note(check_rows(self.source, np.asarray(X), y, rows, self.n_classes,
                                  dtype=self.dtype), None)
        self.clock.lap("check")

    def _copy(self, rows: np.ndarray, X_out: np.ndarray) -> np.ndarray:
        """Copy ``X[rows]`` into ``X_out`` (cast); returns the rows in the source dtype."""
        lo, hi = int(rows[0]), int(rows[-1]) + 1
        source_X, contiguous = self.source.X, hi - lo == len(rows)
        same = source_X.dtype == X_out.dtype
        if self._in_place:
            return X_out
        if contiguous and same and self._file is not None:  # a plain read, no page faults
            fd, offset, row_bytes = self._file
            pread_into(fd, X_out, offset + lo * row_bytes)
            return X_out
        if contiguous and same and hasattr(source_X, "read_direct"):
            source_X.read_direct(X_out, np.s_[lo:hi])  # HDF5 straight into place
            return X_out
        span = source_X[lo:hi]  # a memmap view, or an HDF5 slab read here
        if contiguous:
            X_out[...] = span
            return X_out if same else span
        if same and isinstance(span, np.ndarray):
            # rows - lo lie in [0, hi - lo): "clip" never clips, and unlike the default
            # "raise" it does not gather through a temporary buffer
            return np.take(span, rows - lo, axis=0, out=X_out, mode="clip")
        X = np.asarray(span)[rows - lo]
        X_out[...] = X
        return X

    def _map(self, rows: np.ndarray) -> np.ndarray | None:
        """``X[rows]`` as a copy-on-write map when ``rows`` are one run stored as plain bytes in
        the load dtype, aligned for it; else (or where the file system cannot map) None."""
        if (len(rows) == 0 or int(rows[-1]) - int(rows[0]) + 1 != len(rows)
                or self.source.X.dtype != self.dtype):
            return None
        where = open_mapped(self.source.X)
        if where is None:
            return None
        fd, offset, row_bytes = where
        try:
            if (offset + int(rows[0]) * row_bytes) % self.dtype.alignment:
                return None  # (an .npz member after its zip header): BLAS wants aligned rows
            return map_rows(fd, offset + int(rows[0]) * row_bytes,
                            (len(rows), *self.source.sample_shape), self.dtype)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def _note(self, error: str | None, y: np.ndarray | None) -> None:
        self.error = self.error or error
        if y is not None and self.source.classification and len(y):
            self.max_label = max(self.max_label, int(np.max(y)))
