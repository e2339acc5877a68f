"""Convolutions (cross-correlations with zero padding) over 1-D and 2-D signals: :class:`Conv1d`
``(n, C, L)``, :class:`Conv2d` ``(n, C, H, W)``, in the parameters' dtype. Each is ONE matrix
product on an im2col matrix ``cols`` ``(C*K, P*n)`` (row ``(c, *offset)``: the input under that
kernel tap for every output position and sample; ``F`` out_channels, ``K`` ``prod(kernel)``, ``P``
output positions): forward ``y = W (F, C*K) @ cols`` plus bias; ``dW = (cols @ dy.T).T``; ``dx``
scatters ``W.T @ dy`` back with one strided add per kernel tap (col2im). The batch axis is
innermost (the input is copied to ``(C, *padded, n)``), so each tap reads contiguous runs."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ..errors import is_whole
from .layers import Layer, Shapes, check_init, init_weights, register_layer, write_grad

_AXES = ("length",), ("height", "width")  # names of the spatial axes, by dimensionality


def as_sizes(value: int | Sequence[int], nd: int, what: str, minimum: int = 1) -> tuple[int, ...]:
    """``value`` (an int, or a sequence of ``nd`` ints) as a tuple of ``nd`` ints, each
    ``>= minimum``; ``ValueError`` naming ``what`` otherwise."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        sizes = (int(value),) * nd
    elif isinstance(value, (tuple, list)) and len(value) == nd and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
        sizes = tuple(int(v) for v in value)
    else:
        pair = "an int" if nd == 1 else f"an int or a sequence of {nd} ints"
        raise ValueError(f"{what} must be {pair}, got {value!r}")
    if min(sizes) < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value!r}")
    return sizes


def compact(sizes: tuple[int, ...]) -> int | list[int]:
    """A JSON-able form of ``sizes``: one int when all are equal, else a list."""
    return sizes[0] if len(set(sizes)) == 1 else list(sizes)


def out_sizes(who: str, spatial: Sequence[int], kernel: tuple[int, ...], stride: tuple[int, ...],
              padding: tuple[int, ...] | None = None) -> tuple[int, ...]:
    """Output size per spatial axis, ``floor((L + 2p - k) / s) + 1``; ``ValueError`` naming
    ``who`` and the axis when one is below 1."""
    padding = padding or (0,) * len(kernel)
    out = []
    for name, size, k, s, p in zip(_AXES[len(kernel) - 1], spatial, kernel, stride, padding):
        o = (size + 2 * p - k) // s + 1
        if o < 1:
            pad = f" + 2*{p} padding" if p else ""
            raise ValueError(f"{who}: input {name} {size}{pad} is smaller than the window "
                             f"{k}; use a smaller window, more padding or a larger input")
        out.append(o)
    return tuple(out)


def tap(offset: Sequence[int], stride: Sequence[int], out: Sequence[int]) -> tuple[slice, ...]:
    """Slices of the spatial axes picking, for kernel offset ``offset``, the input element
    that each of the ``out`` output positions reads (windows ``stride`` apart)."""
    return tuple(slice(i, i + s * (o - 1) + 1, s) for i, s, o in zip(offset, stride, out))


class _ConvNd(Layer):
    """Shared implementation of :class:`Conv1d` and :class:`Conv2d` (``nd`` spatial axes)."""

    nd = 0

    def __init__(self, out_channels: int, kernel: int | Sequence[int], stride: int | Sequence[int] = 1,
                 padding: int | Sequence[int] = 0, in_channels: int | None = None, init: str = "he") -> None:
        super().__init__()
        name, nd = type(self).__name__, self.nd
        if not is_whole(out_channels, 1):
            raise ValueError(f"{name} needs out_channels >= 1, got {out_channels!r}")
        if not (in_channels is None or is_whole(in_channels, 1)):
            raise ValueError(f"{name} needs in_channels >= 1 or None (inferred), got {in_channels!r}")
        self.out_channels, self.init = int(out_channels), check_init(init)
        self.kernel = as_sizes(kernel, nd, f"{name} kernel")
        self.stride = as_sizes(stride, nd, f"{name} stride")
        self.padding = as_sizes(padding, nd, f"{name} padding", minimum=0)
        self.in_channels = None if in_channels is None else int(in_channels)
        self._cols: np.ndarray | None = None  # (C*K, n*P), cached for backward

    def config(self) -> dict:
        return {"out_channels": self.out_channels, "kernel": compact(self.kernel),
                "stride": compact(self.stride), "padding": compact(self.padding),
                "in_channels": self.in_channels, "init": self.init}

    def _out(self, spatial: Sequence[int]) -> tuple[int, ...]:
        return out_sizes(repr(self), spatial, self.kernel, self.stride, self.padding)

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(in_shape) != 1 + self.nd:
            raise ValueError(f"{type(self).__name__} takes samples of shape "
                             f"(channels, {', '.join(_AXES[self.nd - 1])}), got {tuple(in_shape)}")
        if self.in_channels is None:
            self.in_channels = int(in_shape[0])
        if in_shape[0] != self.in_channels:
            raise ValueError(f"{self!r} expects {self.in_channels} input channels, got {in_shape[0]}")
        return (self.out_channels, *self._out(in_shape[1:]))

    def _need_channels(self) -> int:
        if self.in_channels is None:
            raise ValueError(f"{self!r}: in_channels is not known yet; pass in_channels= or "
                             f"put the layer in a Sequential, which infers it from the input")
        return self.in_channels

    def param_shapes(self) -> Shapes:
        return {"W": (self.out_channels, self._need_channels(), *self.kernel), "b": (self.out_channels,)}

    def bind(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        for k, a in [*params.items(), *grads.items()]:
            if not a.flags.c_contiguous:  # the GEMMs write through reshaped views
                raise ValueError(f"{self!r}: {k} must be a C-contiguous array")
        super().bind(params, grads)

    def init_(self, rng: np.random.Generator) -> None:
        W = self.params["W"]
        init_weights(W, self.init, int(np.prod(W.shape[1:])),
                     self.out_channels * int(np.prod(self.kernel)), rng)
        self.params["b"][...] = 0

    def forward(self, x: np.ndarray) -> np.ndarray:
        W, b = self.params["W"], self.params["b"]
        C, nd = self._need_channels(), self.nd
        if x.ndim != 2 + nd or x.shape[1] != C:
            raise ValueError(f"{self!r} takes a batch of shape (n, {C}, "
                             f"{', '.join(_AXES[nd - 1])}), got {tuple(x.shape)}")
        n, spatial = x.shape[0], x.shape[2:]
        out = self._out(spatial)
        F, P = self.out_channels, int(np.prod(out))
        # the input batch-last (C, *padded, n), in the parameters' dtype (module notes)
        padded = tuple(s + 2 * p for s, p in zip(spatial, self.padding))
        xt = (np.zeros if any(self.padding) else np.empty)((C, *padded, n), W.dtype)
        inner = tuple(slice(p, p + s) for s, p in zip(spatial, self.padding))
        np.copyto(xt[(slice(None), *inner)], x.transpose(1, *range(2, 2 + nd), 0), casting="same_kind")
        sc, *ss, sn = xt.strides
        view = as_strided(xt, (C, *self.kernel, *out, n),
                          (sc, *ss, *(s * st for s, st in zip(ss, self.stride)), sn), writeable=False)
        cols = np.ascontiguousarray(view)  # im2col: rows (c, *offset), columns (*out, n)
        cols = cols.reshape(C * int(np.prod(self.kernel)), P * n)
        y2 = W.reshape(F, -1) @ cols  # (F, P*n): the one GEMM
        y = np.empty((n, F, *out), W.dtype)
        np.add(y2.reshape(F, P, n).transpose(2, 0, 1), b[:, None], out=y.reshape(n, F, P))
        self._cols, self._x_shape, self._out_shape = cols, x.shape, out
        return y

    def backward(self, dy: np.ndarray, accumulate: bool = False,
                 need_input_grad: bool = True) -> np.ndarray | None:
        W, dW, db, cols = self.params["W"], self.grads["W"], self.grads["b"], self._cols
        if cols is None:
            raise ValueError(f"{self!r}: backward before forward")
        n, F, out = self._x_shape[0], self.out_channels, self._out_shape
        P = int(np.prod(out))
        if dy.shape != (n, F, *out):
            raise ValueError(f"{self!r}: dy has shape {tuple(dy.shape)}, but the forward output "
                             f"was {(n, F, *out)}")
        dyt = np.empty((F, P, n), W.dtype)  # columns ordered as those of cols
        np.copyto(dyt, dy.reshape(n, F, P).transpose(1, 2, 0), casting="same_kind")
        dyt = dyt.reshape(F, P * n)
        write_grad(dW.reshape(F, -1), (cols @ dyt.T).T, accumulate)  # faster than dy @ cols.T
        write_grad(db, dyt.sum(axis=1), accumulate)
        if type(self).backward is _ConvNd.backward:  # (a subclass may change them after)
            self.context.grads_final(self)  # W and b may be sent while dL/dx is computed
        if not need_input_grad:
            return None
        C, spatial, nd = self.in_channels, self._x_shape[2:], self.nd
        dcols = (W.reshape(F, -1).T @ dyt).reshape(C, *self.kernel, *out, n)
        padded = tuple(s + 2 * p for s, p in zip(spatial, self.padding))
        dxt = np.zeros((C, *padded, n), W.dtype)  # batch-last and padded, as in forward
        every = slice(None)
        for offset in itertools.product(*map(range, self.kernel)):  # col2im: one add per tap
            dxt[(every, *tap(offset, self.stride, out), every)] += dcols[(every, *offset)]
        inner = tuple(slice(p, p + s) for s, p in zip(spatial, self.padding))  # the padding's share dropped
        return np.ascontiguousarray(dxt[(every, *inner)].transpose(nd + 1, 0, *range(1, nd + 1)))

    def __repr__(self) -> str:
        extra = "".join(f", {k}={compact(v)}" for k, v, d in
                        (("stride", self.stride, 1), ("padding", self.padding, 0)) if v != (d,) * self.nd)
        return f"{type(self).__name__}({self.out_channels}, kernel={compact(self.kernel)}{extra})"


@register_layer
class Conv1d(_ConvNd):
    """1-D convolution (cross-correlation): ``(n, C, L)`` -> ``(n, out_channels, L_out)``.
    ``kernel``, ``stride``: window length and step (>= 1); ``padding``: zeros at both ends;
    ``in_channels=None``: ``C`` from the input; ``init``: ``"he"`` (default), ``"xavier"`` or
    ``"zeros"``. ``W`` ``(F, C, kernel)``, ``b`` ``(F,)`` (zeros)."""

    nd = 1


@register_layer
class Conv2d(_ConvNd):
    """2-D convolution (cross-correlation): ``(n, C, H, W)`` -> ``(n, out_channels, H_out, W_out)``;
    as :class:`Conv1d`, ``kernel``, ``stride`` and ``padding`` each an int or a pair ``(h, w)``,
    ``W`` ``(F, C, kh, kw)``."""

    nd = 2
