"""The optimizers' rules over one flat parameter vector: elementwise (SGD with momentum, Adam,
AdamW) and with a layer-wise trust ratio (LARS, LAMB); one by name. Their base (rate, clipping,
where a slice lies) is :class:`~mpidp.nn.optim.Optimizer`."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .optim import Optimizer
from .schedules import Schedule, _positive

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "lars", "lamb")


def _momentum(value: float) -> float:
    if not 0 <= value < 1:
        raise ValueError(f"momentum must be in [0, 1), got {value}")
    return float(value)


def _accumulate_(v: np.ndarray, g: np.ndarray, momentum: float, first: bool) -> np.ndarray:
    """The velocity ``v = momentum * v + g`` in place (``g`` on a first step); returns ``v``."""
    if first:
        v[...] = g
    else:
        v *= momentum
        v += g
    return v


class SGD(Optimizer):
    """SGD with optional momentum and L2 weight decay: ``v = momentum * v + g``;
    ``p -= lr * v`` (Nesterov: ``p -= lr * (g + momentum * v)``)."""

    def __init__(self, lr: float | Schedule = 0.01, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False, **clip: float | None) -> None:
        super().__init__(lr, weight_decay, **clip)
        self.momentum, self.nesterov = _momentum(momentum), nesterov
        if nesterov and momentum == 0:
            raise ValueError("nesterov momentum needs momentum > 0")

    def _prepare(self, params: np.ndarray) -> bool:
        if not self.momentum or "velocity" in self.state:
            return False
        self.state["velocity"] = np.empty_like(params)
        return True

    def _update(self, params: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray],
                scale: float, first: bool) -> None:
        if self.momentum == 0 and not self.weight_decay:  # the common case: two passes
            # (not a BLAS axpy, which rounds differently from a plain NumPy loop)
            grad *= self.lr * scale
            params -= grad
            return
        g = self._grad(params, grad, scale)
        if self.momentum:
            v = _accumulate_(state["velocity"], g, self.momentum, first)
            if self.nesterov:
                g += self.momentum * v
            else:
                g[...] = v
        g *= self.lr
        params -= g


def _betas(betas: tuple[float, float], what: str) -> tuple[float, float]:
    b1, b2 = betas
    if not (0 <= b1 < 1 and 0 <= b2 < 1):
        raise ValueError(f"{what} betas must be in [0, 1), got {betas}")
    return float(b1), float(b2)


class Adam(Optimizer):
    """Adam (Kingma & Ba, 2015) with bias correction; ``weight_decay`` is classic L2."""

    def __init__(self, lr: float | Schedule = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, **clip: float | None) -> None:
        super().__init__(lr, weight_decay, **clip)
        self.b1, self.b2 = _betas(betas, type(self).__name__)
        self.eps = _positive("eps", eps)

    def _prepare(self, params: np.ndarray) -> bool:
        if self.state:
            return False
        self.state.update(m=np.zeros_like(params), v=np.zeros_like(params))
        return True

    def _moments(self, g: np.ndarray, state: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        m, v = state["m"], state["v"]
        m *= self.b1
        m += (1 - self.b1) * g
        v *= self.b2
        v += (1 - self.b2) * (g * g)
        return m, v

    def _update(self, params: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray],
                scale: float, first: bool) -> None:
        m, v = self._moments(self._grad(params, grad, scale), state)
        m_hat_scale = 1 / (1 - self.b1 ** self.t)
        v_hat = v / (1 - self.b2 ** self.t)
        params -= (self.lr * m_hat_scale) * m / (np.sqrt(v_hat) + self.eps)


class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter, 2019), outside the gradient
    (moments, clipping): ``p -= lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``."""

    def __init__(self, lr: float | Schedule = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, **clip: float | None) -> None:
        super().__init__(lr, betas, eps, weight_decay, **clip)

    def _update(self, params: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray],
                scale: float, first: bool) -> None:
        if scale != 1.0:
            grad *= scale
        m, v = self._moments(grad, state)
        step = (self.lr / (1 - self.b1 ** self.t)) * m / (np.sqrt(v / (1 - self.b2 ** self.t)) + self.eps)
        if self.weight_decay:
            params *= 1 - self.lr * self.weight_decay
        params -= step


def _trust(num: np.ndarray, den: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """``num / den`` where both are > 0 and ``keep``, else 1."""
    ok = (num > 0) & (den > 0) & keep
    return np.where(ok, num / np.where(ok, den, 1.0), 1.0)


class LARS(Optimizer):
    """LARS (You, Gitman & Ginsburg, 2017, Algorithm 1): momentum SGD with a layer-wise
    trust ratio. For each whole tensor ``w`` with (clipped) mean gradient ``g``::

        ratio = eta * ||w|| / (||g|| + weight_decay * ||w||)
        v = momentum * v + lr * ratio * (g + weight_decay * w);  w -= v

    The ratio is 1 when ``||w||`` is 0 or the whole denominator is 0 (``||g||`` and
    ``weight_decay`` both 0); a zero gradient with weight decay gives ``eta / weight_decay``,
    as optax's ``lars`` does. ``exclude_1d`` (default): 1-D tensors get ratio 1 and no
    weight decay."""

    layer_norms = True

    def __init__(self, lr: float | Schedule = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.001, exclude_1d: bool = True, **clip: float | None) -> None:
        super().__init__(lr, weight_decay, **clip)
        self.momentum = _momentum(momentum)
        if not (eta > 0 and math.isfinite(eta)):
            raise ValueError(f"LARS trust coefficient eta must be a finite number > 0, got {eta}")
        self.eta, self.exclude_1d = float(eta), bool(exclude_1d)

    _prepare = SGD._prepare

    def _adapted(self) -> np.ndarray:
        return self._segs.ndim > 1 if self.exclude_1d else np.ones(len(self._segs), bool)

    def _begin(self, params: np.ndarray, grad: np.ndarray, scale: float, first: bool) -> float:
        scale = super()._begin(params, grad, scale, first)
        w, g = np.sqrt(self._w2), np.sqrt(self._g2)
        adapted = self._adapted()
        self._ratio = _trust(self.eta * w, g + self.weight_decay * w, adapted)
        self._wd = np.where(adapted, self.weight_decay, 0.0)
        return scale

    def _apply(self, params: np.ndarray, grad: np.ndarray, lo: int, hi: int, scale: float,
               first: bool) -> None:
        velocity = self.state.get("velocity")
        for j, a, b in self._pieces(lo, hi):
            p, g, wd = params[a:b], grad[a:b], float(self._wd[j])
            if scale != 1.0:
                g *= scale
            if wd:
                g += wd * p
            g *= self.lr * float(self._ratio[j])
            p -= g if velocity is None else _accumulate_(velocity[a:b], g, self.momentum, first)

    def _update(self, params, grad, state, scale, first) -> None:  # pragma: no cover
        raise AssertionError(f"{type(self).__name__} updates tensor by tensor (_apply)")


class LAMB(Optimizer):
    """LAMB (You et al., 2019, Algorithm 2): Adam's moments with a layer-wise trust ratio.
    For each whole tensor ``w``, with bias-corrected moments of the (clipped) mean gradient::

        r = m_hat / (sqrt(v_hat) + eps);  u = r + weight_decay * w
        w -= lr * ||w|| / ||u|| * u        (ratio 1 if ||w|| or ||u|| is 0)

    ``exclude_1d`` (default): 1-D tensors get ratio 1 and no weight decay."""

    def __init__(self, lr: float | Schedule = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, exclude_1d: bool = True,
                 **clip: float | None) -> None:
        super().__init__(lr, weight_decay, **clip)
        self.b1, self.b2 = _betas(betas, "LAMB")
        self.eps, self.exclude_1d = _positive("eps", eps), bool(exclude_1d)

    _prepare = Adam._prepare
    _moments = Adam._moments
    _adapted = LARS._adapted
    _update = LARS._update

    def _begin(self, params: np.ndarray, grad: np.ndarray, scale: float, first: bool) -> float:
        """The moments over the whole vector, its update ``u`` into ``grad``, then ONE
        reduction of every tensor's ``||w||^2`` and ``||u||^2``."""
        scale = super()._begin(params, grad, scale, first)  # clipping, if asked for
        if scale != 1.0:
            grad *= scale
        m, v = self._moments(grad, self.state)
        np.divide(v, 1 - self.b2 ** self.t, out=grad)
        np.sqrt(grad, out=grad)
        grad += self.eps
        np.divide(m / (1 - self.b1 ** self.t), grad, out=grad)  # r
        adapted = self._adapted()
        if self.weight_decay:
            for j, a, b in self._pieces(0, len(params)):
                if adapted[j]:
                    grad[a:b] += self.weight_decay * params[a:b]  # u
        k = len(self._segs)
        parts = self._squared_norms(params, grad)
        self._ratio = _trust(np.sqrt(parts[:k]), np.sqrt(parts[k:]), adapted)
        return 1.0

    def _apply(self, params: np.ndarray, grad: np.ndarray, lo: int, hi: int, scale: float,
               first: bool) -> None:
        for j, a, b in self._pieces(lo, hi):
            u = grad[a:b]
            u *= self.lr * float(self._ratio[j])
            params[a:b] -= u


def make_optimizer(name: str, lr: float | Schedule, momentum: float = 0.9,
                   weight_decay: float = 0.0, **settings: Any) -> Optimizer:
    """An optimizer by name (:data:`OPTIMIZERS`; ``momentum`` is SGD with momentum), other
    ``settings`` (``clip_norm``, ``clip_value``, ``betas``, ``eps``, ``eta``, ``exclude_1d``,
    ``nesterov``) to its class."""
    kinds = {"sgd": (SGD, {}), "momentum": (SGD, {"momentum": momentum}), "adam": (Adam, {}),
             "adamw": (AdamW, {}), "lars": (LARS, {"momentum": momentum}), "lamb": (LAMB, {})}
    if name not in kinds:
        raise ValueError(f"unknown optimizer {name!r}; expected one of {OPTIMIZERS}")
    cls, extra = kinds[name]
    return cls(lr, weight_decay=weight_decay, **extra, **settings)
