"""Inverted dropout whose mask does not depend on how the batch is split across ranks: each
element's keep bit is a hash (splitmix64, vectorised ``uint64`` NumPy in cache-sized blocks) of
the run seed, global step, layer key, the sample's GLOBAL index and the element's position."""

from __future__ import annotations

import numpy as np

from .layers import ParameterFree, is_finite_number, register_layer

_M = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_C1, _C2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_U = np.uint64
_S30, _S27, _S31 = _U(30), _U(27), _U(31)


def _mix_(z: np.ndarray, tmp: np.ndarray | None = None) -> np.ndarray:
    """splitmix64's finaliser in place on a ``uint64`` array; ``tmp``: scratch of its shape."""
    tmp = np.empty_like(z) if tmp is None else tmp
    z ^= np.right_shift(z, _S30, out=tmp)
    z *= _U(_C1)
    z ^= np.right_shift(z, _S27, out=tmp)
    z *= _U(_C2)
    z ^= np.right_shift(z, _S31, out=tmp)
    return z


def stream_key(*values: int) -> int:
    """A 64-bit key mixing ``values`` (seed, step, the layer's key, ...) in order; tuples of
    different lengths give unrelated keys."""
    h = _mix_(np.array([len(values) * _GOLDEN & _M], np.uint64))
    for v in values:
        h ^= _U(int(v) & _M)
        _mix_(h)
        h += _U(_GOLDEN)  # wraps around, as every step here: arithmetic mod 2**64
        _mix_(h)
    return int(h[0])


_BLOCK = 1 << 14  # words hashed at a time: two 128 KiB buffers, which stay in cache


def keep_mask(key: int, index: np.ndarray, size: int, threshold: int) -> np.ndarray:
    """``(len(index), size)`` bool: whether word ``j`` of row ``r``, a splitmix64 output of
    ``key``, ``index[r]`` and ``j`` only, is ``>= threshold`` (True with probability
    ``1 - threshold / 2**64``); hashed in blocks of about ``_BLOCK`` words."""
    n = len(index)
    rows = _mix_(np.asarray(index).astype(np.uint64) ^ _U(key))
    step = np.arange(1, size + 1, dtype=np.uint64) * _U(_GOLDEN)
    out = np.empty((n, size), bool)
    per = max(1, _BLOCK // size)  # rows per block
    cols = min(size, _BLOCK)      # columns per block
    shape = (max(1, min(per, n)), cols)
    z, tmp = np.empty(shape, np.uint64), np.empty(shape, np.uint64)
    for r in range(0, n, per):
        m = min(per, n - r)
        for c in range(0, size, cols):
            w = min(cols, size - c)
            zz = np.add(rows[r:r + m, None], step[None, c:c + w], out=z[:m, :w])
            np.greater_equal(_mix_(zz, tmp[:m, :w]), _U(threshold), out=out[r:r + m, c:c + w])
    return out


@register_layer
class Dropout(ParameterFree):
    """Inverted dropout: in training each element is zeroed with probability ``rate`` (in
    ``[0, 1)``), the kept ones scaled by ``1 / (1 - rate)``; in evaluation the input itself
    is returned. The mask depends only on ``context.seed``, ``context.step``, the layer's
    ``key``, each sample's global index (``context.index``) and the element's position."""

    def __init__(self, rate: float = 0.5) -> None:
        super().__init__()
        if not is_finite_number(rate) or not 0 <= rate < 1:
            raise ValueError(f"Dropout rate must be a number with 0 <= rate < 1, got {rate!r}")
        self.rate = float(rate)
        self.needs = frozenset({"sample-index"}) if self.rate else frozenset()
        self._threshold = int(self.rate * 2.0 ** 64)  # exact: a float times a power of 2
        self._scale = 1 / (1 - self.rate)
        self._keep: np.ndarray | None = None  # the mask of the last training forward

    def config(self) -> dict:
        return {"rate": self.rate}

    def forward(self, x: np.ndarray) -> np.ndarray:
        if not self.context.training or self.rate == 0:
            self._keep = None
            return x
        ctx = self.context
        index = ctx.sample_index(x.shape[0], "Dropout")
        size = int(np.prod(x.shape[1:]))
        keep = keep_mask(stream_key(ctx.seed, ctx.step, *self.key), index, size, self._threshold)
        self._keep = keep.reshape(x.shape)
        y = x * self._keep
        y *= x.dtype.type(self._scale)
        return y

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        if self._keep is None:
            return dy
        dx = dy * self._keep
        dx *= dy.dtype.type(self._scale)
        return dx

    def __repr__(self) -> str:
        return f"Dropout({self.rate})"
