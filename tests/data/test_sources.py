"""Dataset sources (``mpidp.data.sources``): file formats, row reads, synthetic data and errors."""

from __future__ import annotations

import json
import zipfile

import numpy as np
import pytest

from mpidp.data.sources import ArraySource, SyntheticSource, check_rows, open_source

h5py = pytest.importorskip("h5py")


@pytest.fixture
def arrays():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((37, 5))
    y = rng.integers(0, 4, 37)
    return X, y


ROW_SETS = [np.array([0]), np.array([36]), np.array([2, 3, 4]), np.array([0, 5, 17, 36]),
            np.arange(37), np.array([], np.int64)]


def _check_reads(src, X, y):
    assert (src.n_samples, *src.sample_shape) == X.shape
    assert src.n_features == int(np.prod(X.shape[1:]))
    for rows in ROW_SETS:
        Xr, yr = src.read(rows)
        assert Xr.shape == (len(rows), *X.shape[1:])
        assert yr.shape == (len(rows),) + y.shape[1:]
        np.testing.assert_array_equal(Xr, X[rows])
        np.testing.assert_array_equal(yr, y[rows])


# ---------------------------------------------------------------------------- formats


def test_npz_uncompressed_is_memory_mapped(tmp_path, arrays):
    X, y = arrays
    path = tmp_path / "d.npz"
    np.savez(path, X=X, y=y)
    src = open_source(str(path))
    assert isinstance(src, ArraySource)
    assert isinstance(src.X, np.memmap)
    assert src.classification and src.target_shape == ()
    _check_reads(src, X, y)


def test_npz_uncompressed_fortran_and_float32(tmp_path):
    X = np.asfortranarray(np.arange(24, dtype=np.float32).reshape(6, 4))
    y = np.linspace(0, 1, 12).reshape(6, 2)
    path = tmp_path / "f.npz"
    np.savez(path, X=X, y=y)
    src = open_source(str(path))
    assert not src.classification and src.target_shape == (2,)
    Xr, yr = src.read(np.array([1, 4]))
    assert Xr.dtype == np.float32
    np.testing.assert_array_equal(Xr, X[[1, 4]])
    np.testing.assert_array_equal(yr, y[[1, 4]])


def test_npz_compressed(tmp_path, arrays):
    X, y = arrays
    path = tmp_path / "c.npz"
    np.savez_compressed(path, X=X, y=y)
    src = open_source(str(path))
    _check_reads(src, X, y)


def test_folder_is_memory_mapped(tmp_path, arrays):
    X, y = arrays
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    src = open_source(str(tmp_path))
    assert isinstance(src.X, np.memmap) and isinstance(src.y, np.memmap)
    _check_reads(src, X, y)


@pytest.mark.parametrize("ext", [".h5", ".hdf5"])
def test_hdf5(tmp_path, arrays, ext):
    X, y = arrays
    path = tmp_path / f"d{ext}"
    with h5py.File(path, "w") as f:
        f["X"] = X
        f["y"] = y
    src = open_source(str(path))
    assert src.classification
    _check_reads(src, X, y)


def test_hdf5_missing_dataset(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f["X"] = np.zeros((3, 2))
    with pytest.raises(ValueError, match="'y'"):
        open_source(str(path))


def test_regression_targets_from_arrays():
    X = np.ones((4, 2))
    src = ArraySource("mem", X, np.array([0.5, 1.5, 2.5, 3.5]))
    assert not src.classification and src.target_shape == ()
    src = ArraySource("mem", X, np.ones((4, 3)))
    assert src.target_shape == (3,)


# ---------------------------------------------------------------------------- built-ins


def test_synthetic_rows_do_not_depend_on_what_is_requested_with_them():
    n = 2 * SyntheticSource.CHUNK + 1000  # three chunks, the last one partial
    src = open_source("synthetic", n_samples=n, n_features=3, n_classes=5, seed=4)
    assert isinstance(src, SyntheticSource)
    X_all, y_all = src.read(np.arange(n))
    assert X_all.shape == (n, 3) and y_all.shape == (n,)
    c = SyntheticSource.CHUNK
    subsets = [
        np.array([0]), np.array([c - 1]), np.array([c]), np.array([n - 1]),
        np.array([c - 1, c]),                       # across a chunk boundary
        np.array([5, c - 2, c + 3, 2 * c, n - 1]),  # every chunk
        np.arange(c - 10, c + 10),
        np.sort(np.random.default_rng(0).choice(n, 300, replace=False)),
    ]
    for rows in subsets:
        Xr, yr = src.read(rows)
        np.testing.assert_array_equal(Xr, X_all[rows])
        np.testing.assert_array_equal(yr, y_all[rows])
    for i in (0, c - 1, c, n - 1):  # one row at a time, from a fresh instance
        Xi, yi = SyntheticSource(n, 3, 5, seed=4).read(np.array([i]))
        np.testing.assert_array_equal(Xi[0], X_all[i])
        assert yi[0] == y_all[i]


def test_synthetic_classification():
    src = SyntheticSource(3000, 4, n_classes=3, seed=1)
    assert src.classification and src.n_samples == 3000 and src.n_features == 4
    X, y = src.read(np.arange(3000))
    assert X.dtype == np.float64 and np.issubdtype(y.dtype, np.integer)
    assert set(np.unique(y)) == {0, 1, 2}
    # unit-variance noise around the class centres
    resid = X - np.stack([X[y == k].mean(axis=0) for k in range(3)])[y]
    assert resid.std() == pytest.approx(1.0, rel=0.05)
    # seeded: same seed same data, another seed other data
    np.testing.assert_array_equal(SyntheticSource(3000, 4, 3, seed=1).read(np.arange(10))[0], X[:10])
    assert not np.array_equal(SyntheticSource(3000, 4, 3, seed=2).read(np.arange(10))[0], X[:10])


def test_synthetic_regression():
    src = open_source("synthetic", n_samples=5000, n_features=6, seed=3, regression=True)
    assert not src.classification
    X, y = src.read(np.arange(5000))
    assert y.dtype == np.float64 and y.shape == (5000,)
    w, *_ = np.linalg.lstsq(X, y, rcond=None)
    assert (y - X @ w).std() == pytest.approx(0.1, rel=0.1)  # y = X @ w + 0.1 * noise
    assert np.linalg.norm(w) > 0.5


@pytest.mark.parametrize("kw", [
    dict(n_samples=0, n_features=3), dict(n_samples=5, n_features=0),
    dict(n_samples=5, n_features=3, n_classes=1),
])
def test_synthetic_rejects_bad_sizes(kw):
    with pytest.raises(ValueError, match="synthetic"):
        SyntheticSource(**kw)


def test_digits_are_images():
    pytest.importorskip("sklearn")
    src = open_source("digits")
    assert (src.n_samples, src.sample_shape, src.n_features) == (1797, (1, 8, 8), 64)
    assert src.classification and src.fixed_test is None
    X, y = src.read(np.arange(1797))
    assert X.shape == (1797, 1, 8, 8) and X.dtype == np.float64
    assert X.min() == 0.0 and X.max() == 1.0
    assert sorted(np.unique(y).tolist()) == list(range(10))
    from sklearn.datasets import load_digits
    d = load_digits()
    rows = np.array([0, 100, 1796])
    Xr, yr = src.read(rows)
    np.testing.assert_array_equal(Xr[:, 0], d.images[rows] / 16.0)
    np.testing.assert_array_equal(Xr.reshape(3, 64), d.data[rows] / 16.0)  # the same pixels
    np.testing.assert_array_equal(yr, d.target[rows])


# ---------------------------------------------------------------------------- errors


def test_missing_path(tmp_path):
    missing = tmp_path / "nope.npz"
    with pytest.raises(ValueError, match="not found") as e:
        open_source(str(missing))
    assert "nope.npz" in str(e.value)


def test_folder_without_y(tmp_path):
    np.save(tmp_path / "X.npy", np.zeros((3, 2)))
    with pytest.raises(ValueError, match="y.npy"):
        open_source(str(tmp_path))


def test_npz_without_y(tmp_path):
    np.savez_compressed(tmp_path / "d.npz", X=np.zeros((3, 2)))
    with pytest.raises(ValueError, match="'y'"):
        open_source(str(tmp_path / "d.npz"))


BAD_ARRAYS = {
    "X-1D": (np.zeros(5), np.zeros(5, np.int64),
             r"X must be \(n_samples, \*sample_shape\) with at least 2 dimensions"),
    "X-0D": (np.float64(3.0), np.zeros(5, np.int64), "at least 2 dimensions"),
    "empty": (np.zeros((0, 3)), np.zeros(0, np.int64), "empty"),
    "empty-images": (np.zeros((0, 1, 2, 2)), np.zeros(0, np.int64), "empty"),
    "no-features": (np.zeros((4, 0)), np.zeros(4, np.int64), "no features"),
    "no-features-3D": (np.zeros((4, 3, 0)), np.zeros(4, np.int64), "no features"),
    "length-3D": (np.zeros((4, 2, 2)), np.zeros(5, np.int64), "X has 4 rows but y has 5"),
    "string-y": (np.zeros((3, 2)), np.array(["a", "b", "c"]), "numeric"),
    "int-2D-y": (np.zeros((3, 2)), np.zeros((3, 2), np.int64), "1-D"),
}


@pytest.mark.parametrize("writer, case", [
    (w, c) for w in ("folder", "npz", "npz_compressed", "h5") for c in BAD_ARRAYS
    if not (w == "h5" and c == "string-y")  # h5py cannot store numpy unicode strings
])
def test_bad_arrays_are_refused(tmp_path, writer, case):
    X, y, pattern = BAD_ARRAYS[case]
    path = _write(tmp_path, writer, X, y)
    with pytest.raises(ValueError, match=pattern):
        open_source(path)


@pytest.mark.parametrize("writer", ["folder", "npz", "npz_compressed", "h5"])
def test_length_mismatch_names_both_lengths(tmp_path, writer):
    path = _write(tmp_path, writer, np.zeros((7, 2)), np.zeros(5, np.int64))
    with pytest.raises(ValueError) as e:
        open_source(path)
    assert "7" in str(e.value) and "5" in str(e.value)


def _write(tmp_path, writer, X, y) -> str:
    if writer == "folder":
        np.save(tmp_path / "X.npy", X)
        np.save(tmp_path / "y.npy", y)
        return str(tmp_path)
    if writer == "npz":
        np.savez(tmp_path / "d.npz", X=X, y=y)
        return str(tmp_path / "d.npz")
    if writer == "npz_compressed":
        np.savez_compressed(tmp_path / "d.npz", X=X, y=y)
        return str(tmp_path / "d.npz")
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["X"], f["y"] = X, y
    return str(tmp_path / "d.h5")


OBJ = np.array([[1, "a"], [2, "b"]], dtype=object)


@pytest.mark.parametrize("writer", ["folder", "npz", "npz_compressed"])
@pytest.mark.parametrize("which", ["X", "y"])
def test_object_arrays_are_refused(tmp_path, writer, which):
    X, y = np.zeros((2, 2)), np.zeros(2, np.int64)
    if which == "X":
        X = OBJ
    else:
        y = np.array([None, 1], dtype=object)
    path = _write(tmp_path, writer, X, y)  # numpy pickles object arrays by default
    with pytest.raises(ValueError, match="(?i)object"):
        open_source(path)


def test_pickle_file_is_refused(tmp_path):
    import pickle

    path = tmp_path / "d.npz"
    path.write_bytes(pickle.dumps({"X": np.zeros((2, 2)), "y": np.zeros(2)}))
    with pytest.raises(ValueError, match="d.npz"):
        open_source(str(path))


@pytest.mark.parametrize("compressed", [False, True])
@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.9, 0.99])
def test_truncated_npz(tmp_path, arrays, compressed, keep):
    X, y = arrays
    good = tmp_path / "good.npz"
    (np.savez_compressed if compressed else np.savez)(good, X=X, y=y)
    data = good.read_bytes()
    bad = tmp_path / "bad.npz"
    bad.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(ValueError, match="bad.npz"):
        open_source(str(bad))


def test_corrupt_compressed_npz_member(tmp_path, arrays):
    """A compressed member whose deflate stream is garbage (directory intact) is a ValueError."""
    X, y = arrays
    path = tmp_path / "bad.npz"
    np.savez_compressed(path, X=X, y=y)
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("X.npy")
    data = bytearray(path.read_bytes())
    h = info.header_offset
    start = h + 30 + int.from_bytes(data[h + 26:h + 28], "little") \
        + int.from_bytes(data[h + 28:h + 30], "little")
    data[start] = 0x07  # BFINAL=1, BTYPE=11: a reserved (invalid) deflate block type
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="bad.npz"):
        open_source(str(path))


# ---------------------------------------------------------------------------- check_rows


def test_check_rows_clean_is_none(arrays):
    X, y = arrays
    src = ArraySource("mem", X, y)
    rows = np.array([1, 2, 30])
    assert check_rows(src, *src.read(rows), rows, n_classes=4) is None
    assert check_rows(src, *src.read(rows), rows) is None


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_check_rows_reports_nonfinite_x_with_its_row(arrays, bad):
    X, y = arrays
    X = X.copy()
    X[17, 3] = bad
    X[25, 0] = bad
    src = ArraySource("mem", X, y)
    rows = np.array([3, 10, 17, 25, 30])
    msg = check_rows(src, *src.read(rows), rows)
    assert msg is not None and "X" in msg and "NaN or Inf" in msg
    assert "row 17" in msg  # the dataset row number, not the position in the batch (2)
    rows = np.array([3, 25])
    assert "row 25" in check_rows(src, *src.read(rows), rows)
    rows = np.array([3, 10])
    assert check_rows(src, *src.read(rows), rows) is None


def test_check_rows_reports_nonfinite_regression_targets():
    X = np.zeros((6, 2))
    y = np.arange(12.0).reshape(6, 2)
    y[4, 1] = np.nan
    src = ArraySource("mem", X, y)
    rows = np.array([0, 4, 5])
    msg = check_rows(src, *src.read(rows), rows)
    assert msg is not None and "y" in msg and "row 4" in msg


def test_check_rows_labels(arrays):
    X, y = arrays
    y = y.copy()
    y[8] = -3
    src = ArraySource("mem", X, y)
    rows = np.array([0, 8, 9])
    msg = check_rows(src, *src.read(rows), rows, n_classes=4)
    assert msg is not None and "-3" in msg and ">= 0" in msg

    y[8] = 6
    src = ArraySource("mem", X, y)
    msg = check_rows(src, *src.read(rows), rows, n_classes=4)
    assert msg is not None and "6" in msg and "4 classes" in msg
    assert check_rows(src, *src.read(rows), rows, n_classes=7) is None
    assert check_rows(src, *src.read(rows), rows) is None  # no class count: no range check
    # label == n_classes is already out of range
    y[8] = 4
    src = ArraySource("mem", X, y)
    assert check_rows(src, *src.read(rows), rows, n_classes=4) is not None


def test_check_rows_empty_selection(arrays):
    X, y = arrays
    src = ArraySource("mem", X, y)
    rows = np.array([], np.int64)
    assert check_rows(src, *src.read(rows), rows, n_classes=4) is None


# ---------------------------------------------------------------------------- bad files, named


@pytest.mark.parametrize("writer", ["folder", "npz", "npz_compressed", "h5"])
@pytest.mark.parametrize("which", ["X", "y"])
def test_complex_arrays_are_refused_not_truncated_to_real(tmp_path, writer, which):
    X, y = np.ones((4, 2)), np.linspace(0, 1, 4)
    if which == "X":
        X = X + 1j
    else:
        y = y + 2j
    path = _write(tmp_path, writer, X, y)
    with pytest.raises(ValueError, match=f"{which} is complex .* real numbers") as e:
        open_source(path)
    assert path in str(e.value)


def _member_data_start(path, member):
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(member)
    data = path.read_bytes()
    h = info.header_offset
    return h + 30 + int.from_bytes(data[h + 26:h + 28], "little") \
        + int.from_bytes(data[h + 28:h + 30], "little"), info


@pytest.mark.parametrize("member,where", [("X.npy", "values"), ("y.npy", "values"),
                                          ("X.npy", "header")])
def test_one_flipped_byte_in_an_uncompressed_npz_is_detected(tmp_path, arrays, member, where):
    X, y = arrays
    path = tmp_path / "d.npz"
    np.savez(path, X=X, y=y)
    start, info = _member_data_start(path, member)
    at = start + (info.file_size - 5 if where == "values" else 20)
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError) as e:
        open_source(str(path))
    assert str(path) in str(e.value) and f"member {member} fails its CRC-32 check" in str(e.value)


def test_pickled_arrays_name_the_file(tmp_path):
    np.save(tmp_path / "X.npy", OBJ, allow_pickle=True)
    np.save(tmp_path / "y.npy", np.zeros(2, np.int64))
    with pytest.raises(ValueError) as e:
        open_source(str(tmp_path))
    assert f"{tmp_path / 'X.npy'}" in str(e.value) and "Python objects (pickled)" in str(e.value)
    np.savez_compressed(tmp_path / "c.npz", X=OBJ, y=np.zeros(2))
    with pytest.raises(ValueError, match=f"{tmp_path / 'c.npz'}: X holds Python objects"):
        open_source(str(tmp_path / "c.npz"))


def test_truncated_npy_in_a_folder_names_the_file_and_the_sizes(tmp_path, arrays):
    X, y = arrays
    np.save(tmp_path / "X.npy", X)
    np.save(tmp_path / "y.npy", y)
    full = (tmp_path / "X.npy").stat().st_size
    with open(tmp_path / "X.npy", "r+b") as f:
        f.truncate(full - 8)
    with pytest.raises(ValueError) as e:
        open_source(str(tmp_path))
    msg = str(e.value)
    assert f"{tmp_path / 'X.npy'}" in msg and "truncated" in msg
    assert f"{full - 8} bytes" in msg and f"({full} bytes)" in msg


def test_hdf5_group_instead_of_dataset_is_named(tmp_path):
    path = tmp_path / "d.h5"
    with h5py.File(path, "w") as f:
        f.create_group("X").create_dataset("values", data=np.zeros((3, 2)))
        f["y"] = np.zeros(3)
    with pytest.raises(ValueError, match=f"{path}: 'X' is an HDF5 group, not a dataset"):
        open_source(str(path))


def test_a_file_that_is_not_hdf5_is_named(tmp_path):
    path = tmp_path / "d.h5"
    path.write_bytes(b"not hdf5 at all" * 10)
    with pytest.raises(ValueError, match=f"cannot read dataset '{path}' as HDF5"):
        open_source(str(path))


@pytest.mark.parametrize("name", ["X.npy", "data.bin"])
def test_a_bare_npy_says_which_forms_are_accepted(tmp_path, name):
    path = tmp_path / name
    np.save(tmp_path / "tmp.npy", np.zeros((3, 2)))
    (tmp_path / "tmp.npy").rename(path)
    with pytest.raises(ValueError) as e:
        open_source(str(path))
    msg = str(e.value)
    assert str(path) in msg and "single .npy array" in msg
    assert "a folder with X.npy and y.npy" in msg and ".npz file with arrays X and y" in msg


def test_a_file_that_is_not_a_zip_lists_the_accepted_forms(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("1,2,3\n")
    with pytest.raises(ValueError, match="not a readable .npz .*expected 'digits'"):
        open_source(str(path))


# ---------------------------------------------------------------------------- value ranges


def test_values_beyond_float32_are_named_by_row_when_casting_to_float32():
    X = np.ones((6, 3))
    X[4, 1] = -1e300
    src = ArraySource("mem", X, np.arange(6) % 2)
    rows = np.array([1, 3, 4, 5])
    msg = check_rows(src, *src.read(rows), rows, dtype=np.float32)
    assert msg == ("mem: X row 4 holds -1e+300, beyond the float32 range (+-3.403e+38): as "
                   "float32 it would be inf; rescale the data or train with dtype='float64'")
    assert check_rows(src, *src.read(rows), rows, dtype=np.float64) is None
    assert check_rows(src, *src.read(rows), rows) is None
    X[4, 1] = 3.0e38  # the largest float32 is about 3.4028e38: still representable
    assert check_rows(ArraySource("mem", X, np.arange(6) % 2), *src.read(rows), rows,
                      dtype=np.float32) is None


def test_regression_targets_and_sparse_rows_beyond_float32():
    from mpidp.nn.sparse import CSR
    y = np.zeros(5)
    y[2] = 1e39
    src = ArraySource("mem", np.ones((5, 2)), y)
    rows = np.arange(5)
    assert "y row 2 holds 1e+39" in check_rows(src, *src.read(rows), rows, dtype=np.float32)
    X = CSR(np.array([0, 1, 3, 4]), np.array([0, 1, 0, 1]), np.array([1.0, 2.0, 5e40, 3.0]), 2)
    assert "X row 11 holds 5e+40" in check_rows(src, X, np.zeros(3), np.array([10, 11, 12]),
                                                 dtype=np.float32)


def test_nan_is_reported_before_range():
    X = np.ones((3, 2))
    X[1, 0], X[2, 0] = 1e300, np.nan
    src = ArraySource("mem", X, np.zeros(3, np.int64))
    rows = np.arange(3)
    assert "NaN or Inf (first at row 2)" in check_rows(src, *src.read(rows), rows, dtype=np.float32)


def test_scan_rows_reads_in_blocks_and_names_the_first_bad_row(tmp_path):
    from mpidp.data.sources import scan_rows
    X = np.ones((1000, 4))
    X[777, 3] = np.nan
    np.savez(tmp_path / "d.npz", X=X, y=np.zeros(1000))
    src = open_source(str(tmp_path / "d.npz"))
    rows = np.arange(1000)
    assert "first at row 777" in scan_rows(src, rows, block_bytes=320)  # 10 rows a block
    assert scan_rows(src, rows[:777], block_bytes=320) is None
    assert scan_rows(open_source("synthetic", n_samples=50, n_features=3), np.arange(50)) is None


# ---------------------------------------------------------------------------- at the command line


def _cli_error(r):
    """The job failed cleanly: status 2, one message, no traceback."""
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "Warning" not in r.stderr, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("mpidp: error:")]
    assert len(lines) == 1, r.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("distribute", ["scatter", "local"])
def test_train_refuses_a_corrupt_npz_and_a_float32_overflow_on_every_rank(tmp_path, distribute):
    from helpers import run_mpi
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((120, 4)), rng.integers(0, 3, 120)
    X[77, 2] = 1e300
    np.savez(tmp_path / "big.npz", X=X, y=y)
    X[77, 2] = 0.5
    np.savez(tmp_path / "flip.npz", X=X, y=y)
    start, info = _member_data_start(tmp_path / "flip.npz", "X.npy")
    data = bytearray((tmp_path / "flip.npz").read_bytes())
    data[start + info.file_size // 2] ^= 0x40
    (tmp_path / "flip.npz").write_bytes(bytes(data))
    common = ["--dtype", "float32", "--epochs", "1", "--no-progress", "--distribute", distribute]
    r = run_mpi(2, "train", "--dataset", str(tmp_path / "flip.npz"), *common,
                "--out", str(tmp_path / "a"))
    assert f"{tmp_path / 'flip.npz'}: member X.npy fails its CRC-32 check" in _cli_error(r)
    r = run_mpi(2, "train", "--dataset", str(tmp_path / "big.npz"), *common,
                "--out", str(tmp_path / "b"))
    assert "X row 77 holds 1e+300, beyond the float32 range" in _cli_error(r)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.fixture
def saved_model(tmp_path):
    from mpidp import nn
    model = nn.mlp(4, (8,), 3).init_(0)
    path = tmp_path / "model.npz"
    np.savez(path, params=model.params, spec=json.dumps(model.spec()), dtype=str(model.dtype),
             meta="{}")
    return path


def test_predict_refuses_a_corrupt_model_and_nan_rows(tmp_path, saved_model):
    from helpers import run_mpi
    X = np.random.default_rng(1).standard_normal((60, 4))
    X[41, 0] = np.nan
    np.savez(tmp_path / "nan.npz", X=X, y=np.arange(60) % 3)
    out = tmp_path / "p.npy"
    r = run_mpi(2, "predict", "--model", str(saved_model), "--dataset", str(tmp_path / "nan.npz"),
                "--out", str(out))
    msg = _cli_error(r)
    assert f"{tmp_path / 'nan.npz'}: X contains NaN or Inf (first at row 41)" in msg
    assert "predictions" in msg and not out.exists()
    X[41, 0] = 0.0
    np.savez(tmp_path / "wide.npz", X=np.hstack([X, X]), y=np.arange(60) % 3)
    r = run_mpi(2, "predict", "--model", str(saved_model), "--dataset", str(tmp_path / "wide.npz"),
                "--out", str(out))
    assert "has 8 features, but the model in" in _cli_error(r)
    data = bytearray(saved_model.read_bytes())
    start, info = _member_data_start(saved_model, "params.npy")
    data[start + info.file_size - 3] ^= 0x01
    saved_model.write_bytes(bytes(data))
    np.savez(tmp_path / "ok.npz", X=X, y=np.arange(60) % 3)
    r = run_mpi(2, "predict", "--model", str(saved_model), "--dataset", str(tmp_path / "ok.npz"),
                "--out", str(out))
    msg = _cli_error(r)
    assert f"--model '{saved_model}': cannot load a saved model" in msg and "CRC-32" in msg
    assert not out.exists()


def test_verify_false_skips_the_crc_pass(tmp_path, arrays):
    X, y = arrays
    path = tmp_path / "d.npz"
    np.savez(path, X=X, y=y)
    start, info = _member_data_start(path, "X.npy")
    data = bytearray(path.read_bytes())
    data[start + info.file_size - 1] ^= 0x01  # the last byte of X's last value
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="CRC-32"):
        open_source(str(path))
    src = open_source(str(path), verify=False)  # the caller verified elsewhere, or chose not to
    assert src.read(np.array([36]))[0][0, -1] != X[36, -1]


def test_a_pathlib_path_is_accepted_like_a_string(tmp_path, arrays):
    X, y = arrays
    np.savez(tmp_path / "d.npz", X=X, y=y)
    src = open_source(tmp_path / "d.npz")
    assert src.n_samples == len(X) and np.array_equal(np.asarray(src.X), X)


# ---------------------------------------------------------------------------- samples of any shape

SHAPES = [(3,), (2, 5), (1, 8, 8), (2, 3, 2, 2)]  # flat, signals, images, 4-D samples


def _images(shape, n=37, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *shape)).astype(dtype), rng.integers(0, 4, n)


@pytest.mark.parametrize("writer", ["folder", "npz", "npz_compressed", "h5", "h5-chunked"])
@pytest.mark.parametrize("shape", SHAPES)
def test_samples_keep_their_shape_in_every_format(tmp_path, writer, shape):
    X, y = _images(shape)
    if writer == "h5-chunked":
        with h5py.File(tmp_path / "d.h5", "w") as f:
            f.create_dataset("X", data=X, chunks=(5, *shape), compression="gzip")
            f["y"] = y
        path = str(tmp_path / "d.h5")
    else:
        path = _write(tmp_path, writer, X, y)
    src = open_source(path)
    assert src.sample_shape == shape and src.n_features == int(np.prod(shape))
    _check_reads(src, X, y)


def test_fortran_ordered_images_in_an_npz_are_read_in_c_order(tmp_path):
    X = np.asfortranarray(np.arange(37 * 2 * 3 * 4, dtype=np.float32).reshape(37, 2, 3, 4))
    np.savez(tmp_path / "f.npz", X=X, y=np.arange(37) % 2)
    src = open_source(str(tmp_path / "f.npz"))
    assert src.sample_shape == (2, 3, 4) and not src.X.flags.c_contiguous
    _check_reads(src, X, np.arange(37) % 2)
    Xr, _ = _reader(src, np.float32, maps=True).read(np.arange(37))  # not mappable: copied
    assert Xr.flags.c_contiguous and np.array_equal(Xr, X)


def _reader(src, dtype, maps=False):
    from mpidp.data.rows import RowReader, Timings
    return RowReader(src, dtype, None, Timings(None), maps=maps)


def _base_map(a):
    import mmap
    while isinstance(a, np.ndarray):
        a = a.base
    if isinstance(a, memoryview):
        a = a.obj
    return a if isinstance(a, mmap.mmap) else None


@pytest.mark.parametrize("writer", ["folder", "npz", "h5", "h5-chunked"])
@pytest.mark.parametrize("file_dtype", [np.float32, np.float64])
def test_row_reader_reads_4d_samples_block_by_block(tmp_path, monkeypatch, writer, file_dtype):
    """Blocks of a few rows (tiny block size), a cast or none, runs and scattered rows:
    every path of the reader gives the file's rows with their shape, in the load dtype."""
    from mpidp.data import rows as R
    monkeypatch.setattr(R, "BLOCK_BYTES", 3 * 24 * 4)  # about 3 samples a block
    X, y = _images((2, 3, 2, 2), n=41, dtype=file_dtype, seed=1)
    if writer == "h5-chunked":
        with h5py.File(tmp_path / "d.h5", "w") as f:
            f.create_dataset("X", data=X, chunks=(4, 2, 3, 2, 2))
            f["y"] = y
        path = str(tmp_path / "d.h5")
    else:
        path = _write(tmp_path, writer, X, y)
    src = open_source(path)
    for rows in (np.arange(41), np.arange(5, 30), np.array([0, 3, 4, 17, 40]), np.array([], np.int64)):
        reader = _reader(src, np.float32)
        Xr, yr = reader.read(rows)
        assert Xr.shape == (len(rows), 2, 3, 2, 2) and Xr.dtype == np.float32
        np.testing.assert_array_equal(Xr, X[rows].astype(np.float32))
        np.testing.assert_array_equal(yr, y[rows])
        assert reader.error is None


@pytest.mark.parametrize("writer", ["folder", "h5"])
def test_mapped_reads_of_4d_samples_are_copy_on_write_maps_of_the_file(tmp_path, writer):
    X, y = _images((2, 3, 2, 2), n=300, dtype=np.float32, seed=2)
    path = _write(tmp_path, writer, X, y)
    src = open_source(path)
    rows = np.arange(100, 260)  # one run: mapped
    Xr, yr = _reader(src, np.float32, maps=True).read(rows)
    assert _base_map(Xr) is not None and Xr.shape == (160, 2, 3, 2, 2)
    assert Xr.flags.c_contiguous and Xr.flags.writeable
    np.testing.assert_array_equal(Xr, X[rows])
    np.testing.assert_array_equal(yr, y[rows])
    Xr[:] = -7.0  # copy-on-write: the file keeps its values
    np.testing.assert_array_equal(_reader(open_source(path), np.float32).read(rows)[0], X[rows])
    scattered = np.array([1, 5, 6, 299])  # not one run: copied
    Xs, _ = _reader(src, np.float32, maps=True).read(scattered)
    assert _base_map(Xs) is None and np.array_equal(Xs, X[scattered])
    Xc, _ = _reader(src, np.float64, maps=True).read(rows)  # a cast: copied
    assert _base_map(Xc) is None and np.array_equal(Xc, X[rows].astype(np.float64))


def test_pread_fills_a_4d_buffer_from_the_file(tmp_path):
    import os

    from mpidp.data.rows import open_mapped, pread_into
    X, y = _images((2, 3, 4), n=20, dtype=np.float32, seed=3)
    path = _write(tmp_path, "folder", X, y)
    src = open_source(path)
    fd, offset, row_bytes = open_mapped(src.X)
    try:
        assert row_bytes == 2 * 3 * 4 * 4
        out = np.empty((6, 2, 3, 4), np.float32)
        pread_into(fd, out, offset + 9 * row_bytes)
    finally:
        os.close(fd)
    np.testing.assert_array_equal(out, X[9:15])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_bad_values_in_image_rows_are_named_by_dataset_row(tmp_path, monkeypatch, bad):
    from mpidp.data import rows as R
    from mpidp.data.sources import scan_rows
    X, y = _images((1, 4, 4), n=50, seed=4)
    X[33, 0, 2, 1] = bad
    X[45, 0, 0, 0] = bad
    path = _write(tmp_path, "folder", X, y)
    src = open_source(path)
    rows = np.arange(10, 50)
    assert "first at row 33" in check_rows(src, *src.read(rows), rows)
    assert "first at row 33" in scan_rows(src, rows, block_bytes=5 * 16 * 8)  # 5 rows a block
    assert scan_rows(src, np.arange(33)) is None
    monkeypatch.setattr(R, "BLOCK_BYTES", 4 * 16 * 8)
    reader = _reader(src, np.float32)
    reader.read(rows)
    assert "first at row 33" in reader.error
    X[33, 0, 2, 1], X[45, 0, 0, 0] = 0.0, 0.0
    X[47, 0, 3, 3] = -1e300  # beyond float32
    src = ArraySource("mem", X, y)
    assert "X row 47 holds -1e+300, beyond the float32 range" in check_rows(
        src, *src.read(rows), rows, dtype=np.float32)


def test_image_labels_are_checked_like_any_others():
    X, y = _images((1, 2, 2), n=10)
    y[6] = 9
    src = ArraySource("mem", X, y)
    rows = np.arange(10)
    assert "class label 9 is out of range for 4 classes" in check_rows(src, *src.read(rows), rows,
                                                                       n_classes=4)


def test_generated_sources_are_flat():
    from mpidp.data.sources import BowSource
    assert SyntheticSource(10, 6).sample_shape == (6,)
    assert BowSource(30, 50).sample_shape == (50,)
