"""In-place BLAS updates ``C += A @ B`` through SciPy's ``gemm`` (``beta = 1``), saving NumPy's
temporary and extra pass, where SciPy is installed and NumPy's BLAS runs one thread
(:func:`single_threaded`, as under mpidp with one rank per core: SciPy's OpenBLAS pool and NumPy's
starve each other's threads, docs/benchmarks.md); plain NumPy otherwise, the same up to rounding
(float32 results differ in the last bits with and without the ``fast`` extra)."""

from __future__ import annotations

import os

import numpy as np

_blas: object = ...  # scipy.linalg.blas, or None without SciPy; resolved on first use
_FLOATS = (np.float32, np.float64)


def scipy_blas():
    """``scipy.linalg.blas``, or None without SciPy or with multi-threaded BLAS."""
    global _blas
    if _blas is ...:
        try:
            from scipy.linalg import blas
        except ImportError:
            blas = None
        _blas = blas if blas is not None and single_threaded() else None
    return _blas


_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def single_threaded() -> bool:
    """True when this process's BLAS runs one thread: one usable core, a thread variable
    set to 1, or (with threadpoolctl) every BLAS pool limited to one thread. Read now."""
    one_core = hasattr(os, "sched_getaffinity") and len(os.sched_getaffinity(0)) == 1  # Linux only
    if one_core or any(os.environ.get(v, "").strip() == "1" for v in _THREAD_VARS):
        return True
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return False
    pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    return bool(pools) and all(p.get("num_threads") == 1 for p in pools)


def _fast(*arrays: np.ndarray):
    """SciPy's BLAS when every array is a C-contiguous float32/float64 of one dtype."""
    dtype = arrays[0].dtype
    if dtype not in _FLOATS or any(a.dtype != dtype or not a.flags.c_contiguous for a in arrays):
        return None
    return scipy_blas()


def _gemm_(blas, c: np.ndarray, a: np.ndarray, b: np.ndarray, **how) -> None:
    """``c.T += a @ b`` by ``gemm`` in place (Fortran order, ``c`` C-contiguous): no copies."""
    out = blas.get_blas_funcs("gemm", (c,))(1.0, a, b, beta=1.0, c=c.T, overwrite_c=True, **how)
    if not np.shares_memory(out, c):  # not expected: SciPy returned a copy
        c[...] = out.T


def add_xt_dy_(dW: np.ndarray, x: np.ndarray, dy: np.ndarray) -> None:
    """``dW += x.T @ dy`` in place: ``dW`` ``(n_in, n_out)``, ``x`` ``(n, n_in)``, ``dy`` ``(n, n_out)``."""
    blas = _fast(dW, x, dy) if len(x) else None
    if blas is None:
        dW += x.T @ dy
    else:  # dW.T (n_out, n_in) += dy.T (n_out, n) @ x (n, n_in)
        _gemm_(blas, dW, dy.T, x.T, trans_b=True)


def add_matmul_(y: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """``y += a @ b`` in place: ``y`` ``(n, m)`` C-contiguous, ``a`` ``(n, k)``, ``b`` ``(k, m)``."""
    blas = _fast(y, b) if len(a) and a.dtype == y.dtype else None
    if blas is None:
        y += a @ b
    else:  # y.T (m, n) += b.T (m, k) @ a.T (k, n)
        _gemm_(blas, y, b.T, np.ascontiguousarray(a).T)
