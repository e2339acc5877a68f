"""Where samples come from: built-in datasets and files, read by row, and what identifies
their contents. No MPI. A :class:`Source` knows its shape from metadata alone and reads
only the rows asked for (``.npy`` and stored ``.npz`` members memory-mapped, HDF5 sliced).
Built in (:data:`BUILTIN`): :mod:`~.datasets`' sets, :class:`SyntheticSource`, :class:`BowSource`."""

from __future__ import annotations

import contextlib
import os
import zipfile
import zlib

import numpy as np

from ..atomic import check_place, numpy_kind
from ..errors import setting
from ..nn.sparse import CSR
from . import datasets
from .crc32 import of_range
from .datasets import ArraySource, Source

IMAGES = ("digits", "mnist1d", "mnist")  # mpidp.data.datasets makes them
BUILTIN = (*IMAGES, "synthetic", "bow")
ACCEPTED = ("expected " + ", ".join(map(repr, BUILTIN)) + ", an .npz file with arrays X and y, "
            "a folder with X.npy and y.npy, or an .h5/.hdf5 file with datasets X and y")


class SyntheticSource(Source):
    """Seeded synthetic data generated in fixed chunks, so any rank can make any rows (row
    ``i`` is the same whatever rows are read with it). Classification: ``k`` Gaussian
    clusters (centres ``N(0, 6.25/d)``, about 3.5 noise deviations apart; unit noise).
    Regression: ``X ~ N(0, 1)``, ``y = X @ w + 0.1 * noise`` with ``w ~ N(0, 1/d)``."""

    CHUNK = 4096

    def __init__(self, n_samples: int, n_features: int, n_classes: int = 10, seed: int = 0,
                 regression: bool = False) -> None:
        if n_samples < 1 or n_features < 1:
            raise ValueError(f"synthetic: need n_samples >= 1 and n_features >= 1, got "
                             f"{n_samples}, {n_features}")
        if not regression and n_classes < 2:
            raise ValueError(f"synthetic: need n_classes >= 2, got {n_classes}")
        self.name, self.seed, self.classification = "synthetic", seed, not regression
        self.n_samples, self.n_features, self.n_classes = n_samples, n_features, n_classes
        rng = np.random.default_rng([seed, 0xC])
        if regression:
            self._w = rng.standard_normal(n_features) / np.sqrt(n_features)
        else:
            self._centres = 2.5 / np.sqrt(n_features) * rng.standard_normal((n_classes, n_features))

    def _chunk(self, c: int) -> tuple[np.ndarray, np.ndarray]:
        m = min(self.CHUNK, self.n_samples - c * self.CHUNK)
        rng = np.random.default_rng([self.seed, 0x5EED, c])
        if self.classification:
            y = rng.integers(0, self.n_classes, m)
            return self._centres[y] + rng.standard_normal((m, self.n_features)), y
        X = rng.standard_normal((m, self.n_features))
        return X, X @ self._w + 0.1 * rng.standard_normal(m)

    def read(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        X = np.empty((len(rows), self.n_features))
        y = np.empty(len(rows), np.int64 if self.classification else np.float64)
        chunk_of = rows // self.CHUNK
        for c in np.unique(chunk_of):
            sel = chunk_of == c
            Xc, yc = self._chunk(int(c))
            local = rows[sel] - c * self.CHUNK
            X[sel], y[sel] = Xc[local], yc[local]
        return X, y


class BowSource(Source):
    """``n_samples`` sparse documents of Zipf-drawn words out of ``n_features``, valued
    ``1/sqrt(length)``, rows of ascending Pareto-tailed lengths (a contiguous split is skewed),
    labelled by a planted linear rule; chunked as :class:`SyntheticSource`."""

    CHUNK = 1024

    def __init__(self, n_samples: int = 20000, n_features: int = 2000, n_classes: int = 10,
                 seed: int = 0, min_len: int = 5, max_len: int = 1000, alpha: float = 1.1,
                 overhead: float = 8.0) -> None:
        if n_samples < 1 or n_features < 1 or n_classes < 2:
            raise ValueError(f"bow: need n_samples >= 1, n_features >= 1 and n_classes >= 2, "
                             f"got {n_samples}, {n_features}, {n_classes}")
        self.name, self.classification = "bow", True
        self.n_samples, self.n_features, self.n_classes = n_samples, n_features, n_classes
        self.seed, self.overhead = seed, float(overhead)
        rng = np.random.default_rng([seed, 0xB0])
        tail = min_len * (1.0 - rng.random(n_samples)) ** (-1.0 / alpha)
        self.lengths = np.sort(np.minimum(np.round(tail), max_len).astype(np.int64))
        ranks = np.arange(1, n_features + 1, dtype=np.float64)
        self._word_p = (1.0 / ranks) / np.sum(1.0 / ranks)  # Zipf word frequencies
        self._affinity = rng.standard_normal((n_features, n_classes))

    def costs(self) -> np.ndarray:
        """Work of each row, float64 ``(n_samples,)``: its non-zeros plus a fixed overhead
        (the dense layers after the sparse one)."""
        return self.lengths + self.overhead

    def _chunk(self, c: int) -> CSR:
        lo, hi = c * self.CHUNK, min((c + 1) * self.CHUNK, self.n_samples)
        lengths = self.lengths[lo:hi]
        rng = np.random.default_rng([self.seed, 0xB1, c])
        words = rng.choice(self.n_features, int(lengths.sum()), p=self._word_p)
        values = np.repeat(1.0 / np.sqrt(np.maximum(lengths, 1)), lengths)
        return CSR(np.concatenate([[0], np.cumsum(lengths)]), words, values, self.n_features)

    def _labels(self, X: CSR) -> np.ndarray:
        rows = np.repeat(np.arange(len(X)), X.row_lengths())  # a class at a time: no (nnz, k) array
        score = np.stack([np.bincount(rows, self._affinity[X.indices, k] * X.data, len(X))
                          for k in range(self.n_classes)], axis=1)
        return score.argmax(axis=1).astype(np.int64)

    def read(self, rows: np.ndarray) -> tuple[CSR, np.ndarray]:
        rows = np.asarray(rows, np.int64)
        chunk_of = rows // self.CHUNK
        X = CSR.concat([self._chunk(int(c))[rows[chunk_of == c] - c * self.CHUNK]
                        for c in np.unique(chunk_of)], self.n_features, np.float64)
        by_chunk = np.argsort(chunk_of, kind="stable")  # parts came chunk by chunk
        if (np.diff(by_chunk) < 0).any():
            X = X[np.argsort(by_chunk)]
        return X, self._labels(X)


def _npz_member(path: str, zf: zipfile.ZipFile, key: str, verify: bool = True):
    """Memory-map member ``key`` of an uncompressed ``.npz`` after checking its CRC-32 (a
    memory map bypasses zipfile's check); load it if compressed (zipfile checks it then)."""
    name = key + ".npy"
    what = f"{path}: member {name}"
    if name not in zf.namelist():
        raise ValueError(f"{path}: no array named {key!r} (found {sorted(zf.namelist())})")
    info = zf.getinfo(name)
    objects = ValueError(f"{path}: {key} holds Python objects (pickled); expected a numeric "
                         f"array")
    if info.compress_type != zipfile.ZIP_STORED:
        shape = ()  # the header first (a few bytes inflated): numpy reads a negative shape
        with contextlib.suppress(Exception), zf.open(name) as f:  # else reading it all says why
            shape = read_npy_header(f)[0]
        _check_shape(what, shape, "numpy.savez")
        try:  # compressed: cannot map, read it whole (zipfile checks the CRC-32)
            with zf.open(name) as f:
                return np.lib.format.read_array(f, allow_pickle=False)
        except ValueError as exc:
            if "Object arrays" in str(exc):
                raise objects from None
            raise ValueError(f"{what} cannot be read: {exc}") from None
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as exc:
            raise ValueError(f"{what} is corrupted ({exc}): re-create or re-copy the "
                             f"file") from None
    with open(path, "rb") as f:
        offset = _member_offset(f, info)
        if verify:
            _check_crc(path, offset, info)
        f.seek(offset)
        try:
            shape, fortran, dtype = read_npy_header(f)
        except ValueError as exc:
            raise ValueError(f"{what} is not a valid .npy array ({exc})") from None
        data_offset = f.tell()
    _check_shape(what, shape, "numpy.savez")
    if dtype.hasobject:
        raise objects
    try:
        return np.memmap(path, dtype, "r", offset=data_offset, shape=shape,
                         order="F" if fortran else "C")
    except ValueError as exc:
        raise ValueError(f"{what} cannot be memory-mapped ({exc})") from None


def read_npy_header(f) -> tuple[tuple[int, ...], bool, np.dtype]:
    """``(shape, fortran_order, dtype)`` of the ``.npy`` header at the position of binary
    file ``f``, left at the first data byte; ValueError if there is none."""
    if np.lib.format.read_magic(f) == (1, 0):
        return np.lib.format.read_array_header_1_0(f)
    return np.lib.format.read_array_header_2_0(f)


def _check_shape(what: str, shape: tuple[int, ...], writer: str) -> None:
    """ValueError naming ``what`` when a ``.npy`` header's ``shape`` has a negative dimension;
    ``writer``: the numpy function that writes a good one."""
    if any(d < 0 for d in shape):
        raise ValueError(f"{what}: its header gives the shape {tuple(shape)}, with a negative "
                         f"dimension: the header was edited or damaged; write the array again "
                         f"with {writer}")


def _member_offset(f, info: zipfile.ZipInfo) -> int:
    """Byte offset in open zip file ``f`` where the stored bytes of member ``info`` begin."""
    f.seek(info.header_offset)
    local = f.read(30)
    return (info.header_offset + 30 + int.from_bytes(local[26:28], "little")
            + int.from_bytes(local[28:30], "little"))


def _check_crc(path: str, offset: int, info: zipfile.ZipInfo) -> None:
    """ValueError naming ``path`` unless the stored member at ``offset`` matches its CRC-32."""
    try:
        crc = of_range(path, offset, info.compress_size)
    except OSError:
        raise ValueError(f"{path}: member {info.filename} is truncated") from None
    if crc != info.CRC:
        raise ValueError(crc_mismatch(path, info.filename))


def crc_mismatch(path: str, member: str) -> str:
    """The message for a member of ``path`` whose bytes do not match its CRC-32."""
    return (f"{path}: member {member} fails its CRC-32 check: the file is corrupted (a byte "
            f"changed on disk or in a copy); re-create or re-copy it")


def stored_members(path: str) -> list[tuple[str, int, int, int]]:
    """``(name, offset, size, crc)`` of the uncompressed ``X.npy``, ``y.npy`` members of the
    ``.npz`` file ``path``; empty for anything else (never reading a FIFO or a device)."""
    if not os.path.isfile(path):
        return []
    try:
        with zipfile.ZipFile(path) as zf, open(path, "rb") as f:
            infos = [zf.getinfo(n) for n in ("X.npy", "y.npy") if n in zf.namelist()]
            return [(i.filename, _member_offset(f, i), i.compress_size, i.CRC) for i in infos
                    if i.compress_type == zipfile.ZIP_STORED]
    except (OSError, zipfile.BadZipFile, EOFError, ValueError):
        return []


def not_regular(path: str) -> ValueError:
    """The error for a path that exists but is no regular file (a FIFO or a device such as
    /dev/zero would be read without end): :func:`mpidp.atomic.check_place`'s."""
    try:
        check_place(path, "dataset", folder=True, fix=" (copy the data into a file first)")
    except ValueError as exc:
        return exc
    return ValueError(f"dataset {path!r} is not a regular file: give one")


def _open_npy(folder: str, name: str):
    """Memory-map ``folder/name``; ValueError naming the file, and why, if it cannot be."""
    path = os.path.join(folder, name)
    if os.path.exists(path) and not os.path.isfile(path):
        raise not_regular(path)
    if not os.path.isfile(path):
        raise ValueError(f"dataset folder {folder!r} has no {name}")
    cannot = f"dataset file {path!r} cannot be memory-mapped: "
    try:
        with open(path, "rb") as f:
            shape, _, dtype = read_npy_header(f)
            need = f.tell() + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    except (OSError, ValueError) as bad:
        raise ValueError(f"{cannot}not a valid .npy file ({bad})") from None
    _check_shape(f"dataset file {path!r}", shape, "numpy.save")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        size = os.path.getsize(path)
        if dtype.hasobject:
            why = "it holds Python objects (pickled); expected a numeric array"
        elif size < need:
            why = (f"it is truncated: {size} bytes, but its header describes {shape} {dtype} "
                   f"({need} bytes)")
        else:
            why = str(exc)
        raise ValueError(cannot + why) from None


def _open_path(path: str, verify: bool = True) -> Source:
    if not os.path.exists(path):
        raise ValueError(f"dataset not found: {path!r} ({ACCEPTED})")
    if os.path.isdir(path):
        return ArraySource(path, _open_npy(path, "X.npy"), _open_npy(path, "y.npy"))
    if not os.path.isfile(path):
        raise not_regular(path)
    if path.endswith((".h5", ".hdf5")):
        return _open_hdf5(path)
    try:
        if numpy_kind(path) == ".npy":
            raise ValueError(f"{path!r} is a single .npy array, but a dataset needs features X "
                             f"and targets y: save both in one .npz (numpy.savez(path, X=X, "
                             f"y=y)), or as X.npy and y.npy in a folder and give the folder; "
                             f"{ACCEPTED}")
        with zipfile.ZipFile(path) as zf:
            X, y = _npz_member(path, zf, "X", verify), _npz_member(path, zf, "y", verify)
    except zipfile.BadZipFile as exc:
        raise ValueError(f"cannot read dataset {path!r}: not a readable .npz (zip) file, or "
                         f"truncated ({exc}); {ACCEPTED}") from None
    except (EOFError, OSError, zlib.error) as exc:
        raise ValueError(f"cannot read dataset {path!r}: {exc}") from None
    return ArraySource(path, X, y)


def _open_hdf5(path: str) -> Source:
    try:
        import h5py
    except ImportError as exc:
        raise ValueError(f"{path}: reading HDF5 needs h5py: pip install 'mpidp[hdf5]'") from exc
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise ValueError(f"cannot read dataset {path!r} as HDF5: {exc}") from None
    try:
        found = {}
        for key in ("X", "y"):
            if key not in f:
                raise ValueError(f"{path}: no dataset named {key!r} (found {sorted(f.keys())})")
            try:
                found[key] = f[key]
            except (KeyError, OSError) as exc:  # a link to nothing: h5py says KeyError
                raise ValueError(_unresolved(h5py, path, f, key, exc)) from None
            if not isinstance(found[key], h5py.Dataset):
                raise ValueError(f"{path}: {key!r} is an HDF5 {type(found[key]).__name__.lower()}, "
                                 f"not a dataset; expected arrays X and y at the top level")
        return ArraySource(path, found["X"], found["y"])
    except BaseException:
        f.close()
        raise


def _unresolved(h5py, path: str, f, key: str, exc: Exception) -> str:
    """Why ``key`` of the open HDF5 file ``f`` (at ``path``) names no object, in words."""
    why = str(exc).strip("'\"").removeprefix("Unable to synchronously open object ")
    link = f.get(key, getlink=True)
    if isinstance(link, h5py.ExternalLink):
        where = f"{path}: {key!r} is an external link to {link.path!r} in {link.filename!r}"
        beside = os.path.join(os.path.dirname(path), link.filename)
        if os.path.exists(beside) or os.path.exists(link.filename):
            return (f"{where}, which does not hold it as HDF5 {why}: point the link at the "
                    f"dataset, or copy the data into {path} itself")
        return (f"{where}, a file that is not there {why}: put {link.filename} beside "
                f"{path}, or copy the data into {path} itself")
    if isinstance(link, h5py.SoftLink):
        return (f"{path}: {key!r} is a soft link to {link.path!r}, which is not in the file "
                f"{why}: store the dataset {key} in the file, or point the link at it")
    return (f"{path}: {key!r} cannot be opened {why}: the file may be damaged; re-create or "
            f"re-copy it")


def open_source(spec: str | os.PathLike, *, n_samples: int = 60000,
                n_features: int = 784, n_classes: int = 10, seed: int = 0,
                regression: bool = False, verify: bool = True) -> Source:
    """Open ``spec``: a built-in (:data:`BUILTIN`; ``synthetic`` and ``bow`` sized by the
    keywords), or a path to an ``.npz`` with ``X`` and ``y``, a folder with ``X.npy`` and
    ``y.npy``, or an ``.h5`` file (``X`` ``(n_samples, *sample_shape)``, at least 2-D).
    ``verify``: check the CRC-32 of uncompressed ``.npz`` members before mapping them (one more
    pass over the file; docs/benchmarks-data.md). ValueError naming the problem."""
    spec = os.fspath(spec)
    if spec in IMAGES:
        return getattr(datasets, spec)()
    if spec == "synthetic":
        return SyntheticSource(n_samples, n_features, n_classes, seed, regression)
    if spec == "bow":  # sparse, variable-cost rows sorted by length
        return BowSource(n_samples, n_features, n_classes, seed)
    return _open_path(spec, verify)


def _first_row(a, bad: np.ndarray, rows: np.ndarray) -> int:
    """Dataset row of the first ``True`` in ``bad`` (per element of dense ``a``, value of CSR ``a``)."""
    if hasattr(a, "indptr"):
        return int(rows[np.searchsorted(a.indptr, np.flatnonzero(bad)[0], side="right") - 1])
    return int(rows[np.flatnonzero(bad.reshape(len(bad), -1).any(axis=1))[0]])


def check_values(name: str, label: str, a, rows: np.ndarray, dtype=None) -> str | None:
    """NaN/Inf in ``a`` (dense ``(m, ...)`` or CSR rows ``rows``), complex values, or, when
    ``dtype`` is a narrower float, finite values beyond its range; None if fine."""
    values = a.data if hasattr(a, "indptr") else a
    if values.dtype.kind == "c":
        return (f"{name}: {label} is complex ({values.dtype}) but mpidp trains on real numbers: "
                f"store its real part, its magnitude, or both as separate columns")
    if values.dtype.kind != "f" or values.size == 0:
        return None
    finite = np.isfinite(values)
    if not finite.all():
        return f"{name}: {label} contains NaN or Inf (first at row {_first_row(a, ~finite, rows)})"
    target = np.dtype(dtype) if dtype is not None else values.dtype
    if target.kind == "f" and target.itemsize < values.dtype.itemsize:
        limit = np.finfo(target).max
        big = np.abs(values) > limit
        if big.any():
            value = values.reshape(-1)[np.flatnonzero(big.reshape(-1))[0]]
            return (f"{name}: {label} row {_first_row(a, big, rows)} holds {value:.4g}, beyond "
                    f"the {target} range (+-{limit:.4g}): as {target} it would be inf; rescale "
                    f"the data or train with {setting('dtype', 'float64')}")
    return None


def check_rows(source: Source, X: np.ndarray, y: np.ndarray, rows: np.ndarray,
               n_classes: int | None = None, *, dtype=None) -> str | None:
    """Problems in the rows read (None if fine): NaN/Inf, values ``dtype`` (the cast's, when
    given) cannot hold, bad or out-of-range labels. ``X`` and ``y`` hold dataset rows ``rows``
    ``(m,)`` in the source's dtypes; messages name the dataset row."""
    for label, a in (("X", X), ("y", y)):
        if problem := check_values(source.name, label, a, rows, dtype):
            return problem
    if source.classification and len(y):
        lo, hi = int(y.min()), int(y.max())  # Python ints: exact in any integer dtype
        if lo < 0:
            return f"{source.name}: class labels must be >= 0, found {lo}"
        if n_classes is not None and hi >= n_classes:
            return (f"{source.name}: class label {hi} is out of range for {n_classes} classes "
                    f"(labels must be in [0, {n_classes - 1}])")
        if hi > np.iinfo(np.int64).max:
            return (f"{source.name}: class label {hi} (row {int(rows[np.argmax(y)])}) is beyond "
                    f"int64: labels are class numbers 0, 1, ...; fix that row, or store the "
                    f"targets as floats for regression")
    return None


def scan_rows(source: Source, rows: np.ndarray, *, dtype=None, block_bytes: int = 1 << 24
              ) -> str | None:
    """:func:`check_values` over the features of sorted ``rows`` of ``source``, read
    ``block_bytes`` at a time; None if fine (generated sources are finite and not read)."""
    if not isinstance(source, ArraySource) or len(rows) == 0:
        return None
    step = max(1, block_bytes // (source.n_features * max(source.X.dtype.itemsize, 1)))
    for a in range(0, len(rows), step):
        part = rows[a:a + step]
        if problem := check_values(source.name, "X", source.read(part)[0], part, dtype):
            return problem
    return None


def metadata_fingerprint(spec: str) -> dict:
    """What identifies dataset ``spec`` (JSON-able; recorded with a run, so that a resume can
    tell whether its data changed): a built-in's name (its parameters are in the configuration);
    the size of a file (or of a folder's ``X.npy`` and ``y.npy``), for a zip (``.npz``) each
    member's size and CRC-32 from its directory (:func:`~.distribute.data_fingerprint` adds the
    CRC-32 of other files). ValueError naming a file that cannot be read."""
    if spec in BUILTIN:
        return {"builtin": spec}
    paths = [os.path.join(spec, n) for n in ("X.npy", "y.npy")] if os.path.isdir(spec) else [spec]
    return {"files": [_file_fingerprint(p) for p in paths]}


def _file_fingerprint(path: str) -> dict:
    if os.path.exists(path) and not os.path.isfile(path):
        raise not_regular(path)  # a FIFO or a device would be read without end
    try:
        out: dict = {"name": os.path.basename(path), "size": os.path.getsize(path)}
        if zipfile.is_zipfile(path):  # the members' CRCs cover every byte, timestamps aside
            with zipfile.ZipFile(path) as z:
                out["crc"] = {i.filename: [i.file_size, i.CRC] for i in z.infolist()}
    except (OSError, zipfile.BadZipFile) as exc:
        raise ValueError(f"cannot fingerprint dataset file {path}: {exc}") from exc
    return out


def fingerprint_change(was: dict, now: dict) -> str:
    """How fingerprint ``now`` differs from ``was``, in a few words (for a refusal)."""
    if "builtin" in was or "builtin" in now:
        return f"{was.get('builtin', 'files')} -> {now.get('builtin', 'files')}"
    for a, b in zip(was.get("files", []), now.get("files", [])):
        if a["size"] != b["size"]:
            return f"{b['name']} was {a['size']} bytes, now {b['size']}"
        if a != b:
            return f"{b['name']} has the same size but different contents"
    return "its files differ"
