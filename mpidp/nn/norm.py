"""Normalisation layers: :class:`BatchNorm` over the GLOBAL batch (P ranks holding parts
of it, uneven or empty, compute what one process computes on the whole batch), and
:class:`LayerNorm` per sample (no collective)."""

from __future__ import annotations

import numpy as np

from .layers import Layer, Shapes, is_finite_number, register_layer, write_grad


def _positive(v, what: str) -> float:
    if not is_finite_number(v) or v <= 0:
        raise ValueError(f"{what} must be a finite number > 0, got {v!r}")
    return float(v)


def _channel_sums(a: np.ndarray, b: np.ndarray | None = None) -> np.ndarray:
    """Per-channel sums of ``a`` (or of ``a * b``) over the batch and spatial axes of an
    ``(n, C, *spatial)`` array, as float64 ``(C,)``: the spatial sums in the arrays' dtype
    (pairwise, and without a temporary for the product), the sum over samples in float64."""
    if a.ndim == 2:
        return np.sum(a if b is None else a * b, axis=0, dtype=np.float64)
    n, c = a.shape[:2]
    a3 = a.reshape(n, c, int(np.prod(a.shape[2:])))
    part = a3.sum(axis=2) if b is None else np.einsum("ncs,ncs->nc", a3, b.reshape(a3.shape))
    return part.sum(axis=0, dtype=np.float64)


class _SampleShaped(Layer):
    """A layer whose output has the per-sample shape of its input, fixed by the first
    :meth:`output_shape` call (``self.shape``)."""

    shape: tuple[int, ...] | None = None

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        in_shape = tuple(int(d) for d in in_shape)
        if self.shape is not None and in_shape != self.shape:
            raise ValueError(f"{type(self).__name__} was set up for per-sample shape "
                             f"{self.shape}, got {in_shape}")
        self.shape = in_shape
        return in_shape

    def _check_batch(self, x: np.ndarray) -> None:
        if tuple(x.shape[1:]) != self.shape:
            raise ValueError(f"{type(self).__name__} takes samples of shape {self.shape}, got a "
                             f"batch of shape {x.shape}")

    def _known_shape(self) -> tuple[int, ...]:
        if self.shape is None:
            raise ValueError(f"{type(self).__name__} does not know its per-sample shape yet: "
                             f"put it in a Sequential (or call output_shape) first")
        return self.shape


@register_layer
class BatchNorm(Layer):
    """Batch normalisation ``y = gamma * (x - mean) / sqrt(var + eps) + beta`` of ``(n, F)``
    (per feature) or ``(n, C, *spatial)`` (per channel) batches: ``gamma`` (ones), ``beta``
    (zeros), state ``mean`` (zeros) and ``var`` (ones), each ``(C,)``; ``momentum`` in [0, 1].

    Training uses the GLOBAL batch's mean and biased variance (two ``context.reduce_sum``
    calls forward, one backward unless ``need_input_grad`` is False, on every rank even
    without samples: ``docs/models.md``), ``dgamma`` and ``dbeta`` this rank's own sums; the
    running statistics follow the global ones (``var`` unbiased), and evaluation uses them."""

    needs = frozenset({"replica-sums"})

    def __init__(self, momentum: float = 0.1, eps: float = 1e-5) -> None:
        super().__init__()
        if not is_finite_number(momentum) or not 0 <= momentum <= 1:
            raise ValueError(f"BatchNorm momentum must be a number in [0, 1], got {momentum!r}")
        self.momentum, self.eps = float(momentum), _positive(eps, "BatchNorm eps")
        self.n_channels: int | None = None

    def config(self) -> dict:
        return {"momentum": self.momentum, "eps": self.eps}

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(in_shape) < 1:
            raise ValueError("BatchNorm needs samples with at least one axis")
        if self.n_channels is not None and in_shape[0] != self.n_channels:
            raise ValueError(f"BatchNorm was set up for {self.n_channels} channels, got "
                             f"per-sample shape {tuple(in_shape)}")
        self.n_channels = int(in_shape[0])
        return tuple(in_shape)

    def _c(self) -> int:
        if self.n_channels is None:
            raise ValueError("BatchNorm does not know its number of channels yet: put it in a "
                             "Sequential (or call output_shape) first")
        return self.n_channels

    def param_shapes(self) -> Shapes:
        return {"gamma": (self._c(),), "beta": (self._c(),)}

    def state_shapes(self) -> Shapes:
        return {"mean": (self._c(),), "var": (self._c(),)}

    def init_(self, rng: np.random.Generator) -> None:
        self.params["gamma"][...], self.params["beta"][...] = 1, 0
        if self.state:  # a scratch copy (a pipeline's other stages) may have none bound
            self.state["mean"][...], self.state["var"][...] = 0, 1

    def _bshape(self, x: np.ndarray) -> tuple[int, ...]:
        """The shape ``(C, 1, ...)`` that broadcasts a channel vector against ``x``."""
        c = self._c()
        if x.ndim < 2 or x.shape[1] != c:
            raise ValueError(f"BatchNorm takes (n, {c}, ...) batches, got shape {x.shape}")
        return (c,) + (1,) * (x.ndim - 2)

    def forward(self, x: np.ndarray) -> np.ndarray:
        bshape = self._bshape(x)
        self._training = bool(self.context.training)
        gamma, beta = self.params["gamma"].reshape(bshape), self.params["beta"].reshape(bshape)
        if not self._training:
            inv = 1 / np.sqrt(self.state["var"] + self.eps)
            scale = gamma * inv.reshape(bshape)
            self._x, self._inv = x, inv
            y = x * scale
            y += beta - self.state["mean"].reshape(bshape) * scale
            return y
        c, dt = self._c(), x.dtype
        first = np.concatenate([[x.size // c], _channel_sums(x)])  # local count per channel, sums
        first = self.context.reduce_sum(first)
        n = float(first[0])
        mean = first[1:] / n if n > 0 else np.zeros(c)
        xc = x - mean.astype(dt).reshape(bshape)
        ss = self.context.reduce_sum(_channel_sums(xc, xc))  # about the GLOBAL mean
        var = ss / n if n > 0 else np.zeros(c)
        inv = (1 / np.sqrt(var + self.eps)).astype(dt)
        xc *= inv.reshape(bshape)  # now xhat
        self._xhat, self._inv, self._n = xc, inv, n
        y = xc * gamma
        y += beta
        m = self.momentum
        if n > 0:
            mu = self.state["mean"]
            mu[...] = (1 - m) * mu.astype(np.float64) + m * mean
        if n > 1:
            v = self.state["var"]
            v[...] = (1 - m) * v.astype(np.float64) + m * var * (n / (n - 1))
        return y

    def backward(self, dy: np.ndarray, accumulate: bool = False,
                 need_input_grad: bool = True) -> np.ndarray | None:
        bshape = self._bshape(dy)
        c, dt = self._c(), dy.dtype
        gamma = self.params["gamma"]
        if not self._training:  # running statistics: a per-channel affine map
            xhat = (self._x - self.state["mean"].reshape(bshape)) * self._inv.reshape(bshape)
            write_grad(self.grads["gamma"], _channel_sums(dy, xhat), accumulate)
            write_grad(self.grads["beta"], _channel_sums(dy), accumulate)
            return dy * (gamma * self._inv).reshape(bshape) if need_input_grad else None
        xhat = self._xhat
        sums = np.concatenate([_channel_sums(dy), _channel_sums(dy, xhat)])
        write_grad(self.grads["beta"], sums[:c], accumulate)  # the trainer adds the ranks'
        write_grad(self.grads["gamma"], sums[c:], accumulate)
        if not need_input_grad:
            return None
        sums = self.context.reduce_sum(sums)
        n = self._n
        if n == 0:
            return np.zeros_like(dy)
        # dx = gamma / sqrt(var + eps) * (dy - sum(dy) / N - xhat * sum(dy * xhat) / N)
        dx = xhat * (sums[c:] / n).astype(dt).reshape(bshape)
        np.subtract(dy, dx, out=dx)
        dx -= (sums[:c] / n).astype(dt).reshape(bshape)
        dx *= (gamma * self._inv).reshape(bshape)
        return dx

    def __repr__(self) -> str:
        return f"BatchNorm(momentum={self.momentum}, eps={self.eps})"


@register_layer
class LayerNorm(_SampleShaped):
    """Layer normalisation ``y = gamma * (x - mean) / sqrt(var + eps) + beta``, mean and
    biased variance over ALL of each sample's values. ``gamma`` (ones) and ``beta`` (zeros)
    have the per-sample shape. No collective; the same in training and evaluation. ``eps`` > 0."""

    def __init__(self, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = _positive(eps, "LayerNorm eps")

    def config(self) -> dict:
        return {"eps": self.eps}

    def param_shapes(self) -> Shapes:
        return {"gamma": self._known_shape(), "beta": self._known_shape()}

    def init_(self, rng: np.random.Generator) -> None:
        self.params["gamma"][...], self.params["beta"][...] = 1, 0

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._check_batch(x)
        n, d = x.shape[0], int(np.prod(self.shape))
        xc = x.reshape(n, d) - x.reshape(n, d).mean(axis=1, keepdims=True)
        var = np.einsum("ij,ij->i", xc, xc) / d
        inv = 1 / np.sqrt(var + self.eps)
        xc *= inv[:, None]  # xhat
        self._xhat, self._inv = xc, inv
        y = xc * self.params["gamma"].reshape(d)
        y += self.params["beta"].reshape(d)
        return y.reshape(x.shape)

    def backward(self, dy: np.ndarray, accumulate: bool = False,
                 need_input_grad: bool = True) -> np.ndarray | None:
        xhat, inv = self._xhat, self._inv
        n, d = xhat.shape
        g = dy.reshape(n, d)
        write_grad(self.grads["gamma"].reshape(d), np.einsum("ij,ij->j", g, xhat), accumulate)
        write_grad(self.grads["beta"].reshape(d), g.sum(axis=0), accumulate)
        if not need_input_grad:
            return None
        gd = g * self.params["gamma"].reshape(d)  # dL/dxhat
        m2 = np.einsum("ij,ij->i", gd, xhat) / d
        dx = gd - gd.mean(axis=1, keepdims=True)
        dx -= xhat * m2[:, None]
        dx *= inv[:, None]
        return dx.reshape(dy.shape)

    def __repr__(self) -> str:
        return f"LayerNorm(eps={self.eps})"
