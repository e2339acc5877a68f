"""Pooling over 1-D ``(n, C, L)`` and 2-D ``(n, C, H, W)`` inputs: :class:`MaxPool`,
:class:`AvgPool` (windows, no padding; per axis ``out = floor((L - size) / stride) + 1``)
and :class:`GlobalAvgPool`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from .conv import as_sizes, out_sizes, tap
from .layers import ParameterFree, register_layer


def _spec(value: int | Sequence[int] | None, what: str) -> int | tuple[int, ...] | None:
    """A pool size or stride as given (an int, a pair, or None), checked and normalised."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{what} must be an int or a pair (for 2-D inputs), got {value!r}")
        return as_sizes(value, 2, what)
    return as_sizes(value, 1, what)[0]


class _WindowPool(ParameterFree):
    """Shapes of :class:`MaxPool` and :class:`AvgPool`: ``size`` an int (every spatial axis)
    or a pair ``(h, w)``; ``stride`` likewise, None (default) meaning ``size``."""

    def __init__(self, size: int | Sequence[int], stride: int | Sequence[int] | None = None) -> None:
        super().__init__()
        name = type(self).__name__
        self.size = _spec(size, f"{name} size")
        self.stride = _spec(stride, f"{name} stride")

    def config(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v
                for k, v in (("size", self.size), ("stride", self.stride))}

    def _geometry(self, shape: Sequence[int], batch: bool) -> tuple[tuple[int, ...], ...]:
        """``(size, stride, out)`` per spatial axis for a sample (or, with ``batch``, a
        batch) of ``shape``."""
        nd = len(shape) - (2 if batch else 1)
        if nd not in (1, 2):
            what = "a batch of shape (n, C, L) or (n, C, H, W)" if batch else \
                "samples of shape (C, L) or (C, H, W)"
            raise ValueError(f"{self!r} takes {what}, got {tuple(shape)}")
        if nd == 1 and any(isinstance(v, tuple) for v in (self.size, self.stride)):
            raise ValueError(f"{self!r} has a 2-D window, so it needs (n, C, H, W) inputs, "
                             f"got shape {tuple(shape)}; give an int size for 1-D inputs")
        size = as_sizes(self.size, nd, "size")
        stride = size if self.stride is None else as_sizes(self.stride, nd, "stride")
        return size, stride, out_sizes(repr(self), shape[-nd:], size, stride)

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (in_shape[0], *self._geometry(in_shape, batch=False)[2])

    def _check_dy(self, dy: np.ndarray) -> None:
        if getattr(self, "_x_shape", None) is None:
            raise ValueError(f"{self!r}: backward before forward")
        want = (*self._x_shape[:2], *self._geom[2])
        if dy.shape != want:
            raise ValueError(f"{self!r}: dy has shape {tuple(dy.shape)}, but the forward output was {want}")

    def _taps(self):
        """(offset number, input slices) for every window offset of the cached forward."""
        size, stride, out = self._geom
        for k, offset in enumerate(itertools.product(*map(range, size))):
            yield k, (slice(None), slice(None), *tap(offset, stride, out))

    def _by_offset(self, x: np.ndarray) -> np.ndarray:
        """``(K, n, C, *out)``: for every window offset (row-major), the input value each
        output position reads there, copied once (contiguous reductions follow)."""
        self._geom = self._geometry(x.shape, batch=True)
        self._x_shape = x.shape
        size, stride, out = self._geom
        sn, sc, *ss = x.strides
        view = as_strided(x, (*size, *x.shape[:2], *out),
                          (*ss, sn, sc, *(s * st for s, st in zip(ss, stride))), writeable=False)
        return np.ascontiguousarray(view).reshape(int(np.prod(size)), *x.shape[:2], *out)  # no -1: n may be 0

    def __repr__(self) -> str:
        stride = "" if self.stride is None else f", stride={self.stride}"
        return f"{type(self).__name__}({self.size}{stride})"


@register_layer
class MaxPool(_WindowPool):
    """Maximum over windows: ``(n, C, L)`` or ``(n, C, H, W)`` -> ``(n, C, *out)``; backward
    routes each output's gradient to the first (row-major) maximum of its window."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        taps = self._by_offset(x)
        n_taps = len(taps)
        y = np.max(taps, axis=0)
        # each window's first maximum, branch-free: n_taps - max(n_taps - k where it is)
        code = np.uint8 if n_taps < 256 else np.int32
        best, eq, cand = np.zeros(y.shape, code), np.empty(y.shape, bool), np.empty(y.shape, code)
        for k in range(n_taps):
            np.equal(taps[k], y, out=eq)
            np.multiply(eq, code(n_taps - k), out=cand)
            np.maximum(best, cand, out=best)
        self._arg = np.subtract(code(n_taps), best, out=best)  # n_taps where y is NaN: no gradient
        return y

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        self._check_dy(dy)
        size, stride, _ = self._geom
        dx = np.zeros(self._x_shape, dy.dtype)
        disjoint = all(s >= k for s, k in zip(stride, size))  # each input in one window at most
        part = None if disjoint else np.empty(dy.shape, dy.dtype)
        for k, where in self._taps():
            if disjoint:
                np.multiply(dy, self._arg == k, out=dx[where])
            else:
                np.multiply(dy, self._arg == k, out=part)
                dx[where] += part
        return dx


@register_layer
class AvgPool(_WindowPool):
    """Mean over windows: ``(n, C, L)`` or ``(n, C, H, W)`` -> ``(n, C, *out)``."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        taps = self._by_offset(x)
        y = np.sum(taps, axis=0)
        y *= 1.0 / len(taps)
        return y

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        self._check_dy(dy)
        g = dy * (1.0 / int(np.prod(self._geom[0])))
        dx = np.zeros(self._x_shape, g.dtype)
        for _, where in self._taps():
            dx[where] += g
        return dx


@register_layer
class GlobalAvgPool(ParameterFree):
    """Mean over every spatial axis: ``(n, C, *spatial)`` -> ``(n, C)``."""

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(in_shape) < 2:
            raise ValueError(f"GlobalAvgPool takes samples of shape (channels, *spatial), got "
                             f"{tuple(in_shape)}: it needs at least one spatial axis")
        return (in_shape[0],)

    def forward(self, x: np.ndarray) -> np.ndarray:
        if x.ndim < 3:
            raise ValueError(f"GlobalAvgPool takes a batch of shape (n, C, *spatial), got {tuple(x.shape)}")
        self._x_shape = x.shape
        return x.mean(axis=tuple(range(2, x.ndim)))

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        shape = self._x_shape
        if dy.shape != shape[:2]:
            raise ValueError(f"GlobalAvgPool: dy has shape {tuple(dy.shape)}, but the forward "
                             f"output was {shape[:2]}")
        g = dy * (1.0 / int(np.prod(shape[2:])))
        return np.broadcast_to(g.reshape(*shape[:2], *(1,) * (len(shape) - 2)), shape).copy()
