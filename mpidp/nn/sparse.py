"""Sparse inputs: a minimal CSR row container and a dense layer that reads it (cost per
sample grows with its non-zeros). Pure NumPy."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .layers import Dense, Layer, register_layer


class CSR:
    """Rows of a sparse ``(n_rows, n_cols)`` matrix in compressed sparse row form:
    ``indptr`` int64 ``(n_rows + 1,)``, ``indices`` int64 ``(nnz,)`` column numbers,
    ``data`` float ``(nnz,)``. With ``len``, ``shape``, ``dtype`` and ``X[slice]`` /
    ``X[int array]`` (a new CSR) it stands in for a dense ``X`` in a :class:`mpidp.Shard`."""

    def __init__(self, indptr, indices, data, n_cols: int) -> None:
        self.indptr = np.asarray(indptr, np.int64)
        self.indices = np.asarray(indices, np.int64)
        self.data = np.asarray(data)
        self.n_cols = int(n_cols)
        if self.indptr.ndim != 1 or len(self.indptr) < 1 or self.indptr[0] != 0:
            raise ValueError("CSR indptr must be 1-D, non-empty and start at 0")
        if len(self.indices) != len(self.data) or self.indptr[-1] != len(self.data):
            raise ValueError(f"CSR arrays disagree: indptr ends at {self.indptr[-1]}, "
                             f"{len(self.indices)} indices, {len(self.data)} values")

    @property
    def shape(self) -> tuple[int, int]:
        return len(self.indptr) - 1, self.n_cols

    @property
    def dtype(self) -> np.dtype:
        return self.data.dtype

    @property
    def nnz(self) -> int:
        return len(self.data)

    def __len__(self) -> int:
        return len(self.indptr) - 1

    def row_lengths(self) -> np.ndarray:
        """Non-zeros per row, int64 ``(n_rows,)``."""
        return np.diff(self.indptr)

    def astype(self, dtype: npt.DTypeLike) -> CSR:
        return CSR(self.indptr, self.indices, self.data.astype(dtype, copy=False), self.n_cols)

    def __getitem__(self, rows) -> CSR:
        if isinstance(rows, slice):
            lo, hi, step = rows.indices(len(self))
            if step == 1:
                a, b = self.indptr[lo], self.indptr[max(hi, lo)]
                return CSR(self.indptr[lo:max(hi, lo) + 1] - a, self.indices[a:b],
                           self.data[a:b], self.n_cols)
            rows = np.arange(lo, hi, step)
        rows = np.asarray(rows, np.int64).reshape(-1)
        starts, lengths = self.indptr[rows], self.indptr[rows + 1] - self.indptr[rows]
        indptr = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        take = np.repeat(starts - indptr[:-1], lengths) + np.arange(indptr[-1])
        return CSR(indptr, self.indices[take], self.data[take], self.n_cols)

    def toarray(self) -> np.ndarray:
        """Dense ``(n_rows, n_cols)`` copy (duplicate column entries are summed)."""
        out = np.zeros(self.shape, self.dtype)
        rows = np.repeat(np.arange(len(self)), self.row_lengths())
        np.add.at(out, (rows, self.indices), self.data)
        return out

    @staticmethod
    def concat(parts: Sequence[CSR], n_cols: int, dtype: npt.DTypeLike) -> CSR:
        """Stack row blocks in order."""
        lengths = [p.row_lengths() for p in parts]
        indptr = np.concatenate([[0], np.cumsum(np.concatenate(lengths or [np.zeros(0)]))])
        cat = (lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt))
        return CSR(indptr.astype(np.int64), cat([p.indices for p in parts], np.int64),
                   cat([p.data for p in parts], dtype), n_cols)

    def __repr__(self) -> str:
        return f"CSR(shape={self.shape}, nnz={self.nnz}, dtype={self.dtype})"


@register_layer
class SparseDense(Dense):
    """``y = x @ W + b`` for CSR input ``x`` ``(n, n_in)``; ``W`` ``(n_in, n_out)`` (xavier);
    ``n_in=None``: the data's width. The first layer only (``backward`` returns None).
    Forward gathers the rows of ``W`` the input touches, backward scatters ``value * dy``
    into them: both ``O(nnz * n_out)``."""

    reads = "sparse (CSR) input"

    def __init__(self, n_in: int | None, n_out: int) -> None:
        super().__init__(n_in, n_out, init="xavier")

    def forward(self, x: CSR) -> np.ndarray:
        if not isinstance(x, CSR):
            raise TypeError(f"SparseDense needs CSR input, got {type(x).__name__}")
        W = self.params["W"]
        self._x = x
        out = np.zeros((len(x), self.n_out), W.dtype)  # (n, n_out)
        filled = x.row_lengths() > 0
        if x.nnz:
            terms = W[x.indices] * x.data[:, None].astype(W.dtype)  # (nnz, n_out)
            out[filled] = np.add.reduceat(terms, x.indptr[:-1][filled], axis=0)
        out += self.params["b"]
        return out

    def backward(self, dy: np.ndarray, accumulate: bool = False, need_input_grad: bool = True) -> None:
        x, dW, db = self._x, self.grads["W"], self.grads["b"]
        if not accumulate:
            dW[...] = 0
            db[...] = 0
        db += dy.sum(axis=0)
        if x.nnz:
            rows = np.repeat(np.arange(len(x)), x.row_lengths())
            np.add.at(dW, x.indices, dy[rows] * x.data[:, None].astype(dW.dtype))
        return None


def input_problem(layers: Sequence[Layer], sparse: bool) -> str | None:
    """Why a model of ``layers`` cannot take a dataset's rows (CSR when ``sparse``), or None
    (a first :class:`SparseDense` takes CSR only, mpidp's other layers dense only)."""
    first = layers[0] if len(layers) else None
    if isinstance(first, SparseDense):
        return None if sparse else ("its first layer, SparseDense, takes sparse (CSR) rows, "
                                    "and the dataset's rows are dense arrays")
    if sparse and type(first).__module__.startswith(__package__ + "."):
        return (f"the dataset's rows are sparse (CSR), and only a first SparseDense layer "
                f"takes them (this model's first layer is {type(first).__name__})")
    return None
