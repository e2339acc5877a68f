"""In-place BLAS updates through SciPy when it is installed; plain NumPy otherwise.

NumPy has no ``C += A @ B``: it forms the product in a temporary and adds it, one more
pass over the output. SciPy exposes BLAS ``gemm`` with ``beta = 1``, which accumulates in
place. Results are the same up to rounding (so a pipeline's float32 parameters differ in
the last bits between installs with and without SciPy); SciPy is optional (the ``fast``
extra) and imported on first use.
"""

from __future__ import annotations

import numpy as np

_blas: object = ...  # scipy.linalg.blas, or None without SciPy; resolved on first use
_FLOATS = (np.float32, np.float64)


def scipy_blas():
    """``scipy.linalg.blas``, or None when SciPy is not installed."""
    global _blas
    if _blas is ...:
        try:
            from scipy.linalg import blas
            _blas = blas
        except ImportError:
            _blas = None
    return _blas


def _fast(*arrays: np.ndarray):
    """SciPy's BLAS when every array is a C-contiguous float32/float64 of one dtype."""
    dtype = arrays[0].dtype
    if dtype not in _FLOATS or any(a.dtype != dtype or not a.flags.c_contiguous for a in arrays):
        return None
    return scipy_blas()


def add_xt_dy_(dW: np.ndarray, x: np.ndarray, dy: np.ndarray) -> None:
    """``dW += x.T @ dy`` in place: ``dW`` ``(n_in, n_out)``, ``x`` ``(n, n_in)``, ``dy``
    ``(n, n_out)``.

    One ``gemm`` with ``beta = 1`` writing into ``dW`` when SciPy is there; NumPy alone
    must form ``x.T @ dy`` in a temporary and add it, which for small micro-batches costs
    about as much as the product itself (docs/benchmarks.md, "Figures behind the code").
    """
    blas = _fast(dW, x, dy) if len(x) else None
    if blas is None:
        dW += x.T @ dy
        return
    gemm = blas.get_blas_funcs("gemm", (dW,))
    # Fortran order: dW.T (n_out, n_in) += dy.T (n_out, n) @ x (n, n_in); no copies
    out = gemm(1.0, dy.T, x.T, beta=1.0, c=dW.T, trans_b=True, overwrite_c=True)
    if not np.shares_memory(out, dW):  # not expected: SciPy returned a copy
        dW[...] = out.T
