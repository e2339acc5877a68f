"""Activation layers, no parameters, ``(n, *shape)`` to ``(n, *shape)`` in the input's dtype: ``ReLU``,
``LeakyReLU``, ``Tanh``, ``Sigmoid`` and ``GELU`` on each element, ``Softmax`` along the last axis."""

from __future__ import annotations

import math

import numpy as np

from .layers import ParameterFree, is_finite_number, register_layer


@register_layer
class ReLU(ParameterFree):
    """``max(x, 0)``; the derivative at 0 is taken as 0. ``inplace=True`` (not saved)
    overwrites ``x`` in forward and ``dy`` in backward: only where both are temporaries
    (after a ``Dense``), never as a model's first layer."""

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._y = np.maximum(x, 0, out=x if self.inplace else None)
        return self._y

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        return np.multiply(dy, self._y > 0, out=dy if self.inplace else None)


@register_layer
class Tanh(ParameterFree):
    """``tanh(x)``."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._y = np.tanh(x)
        return self._y

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        return dy * (1 - self._y * self._y)


@register_layer
class Sigmoid(ParameterFree):
    """``1 / (1 + exp(-x))``, computed without overflow for large ``|x|``."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        e = np.exp(-np.abs(x))
        self._y = np.where(x >= 0, 1 / (1 + e), e / (1 + e))
        return self._y

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        return dy * self._y * (1 - self._y)


@register_layer
class LeakyReLU(ParameterFree):
    """``x`` where ``x > 0``, else ``slope * x`` (a finite number; 0 gives :class:`ReLU`);
    the derivative at 0 is taken as ``slope``."""

    def __init__(self, slope: float = 0.01) -> None:
        super().__init__()
        if not is_finite_number(slope):
            raise ValueError(f"LeakyReLU needs a finite number as slope, got {slope!r}")
        self.slope = float(slope)

    def config(self) -> dict:
        return {"slope": self.slope}

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._pos = x > 0
        return np.where(self._pos, x, x * self.slope)

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        return np.where(self._pos, dy, dy * self.slope)

    def __repr__(self) -> str:
        return f"LeakyReLU({self.slope})"


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


@register_layer
class GELU(ParameterFree):
    """Gaussian error linear unit, **tanh approximation** (within ~1e-3 of ``x * Phi(x)``,
    exact derivative): ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))``."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._x = x
        self._x2 = x2 = x * x
        u = x2 * _GELU_A
        u += 1
        u *= x
        u *= _GELU_C
        self._t = t = np.tanh(u, out=u)  # tanh(c (x + a x^3))
        y = t + 1
        y *= x
        y *= 0.5
        return y

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        x, t = self._x, self._t
        # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) c (1 + 3 a x^2)
        inner = self._x2 * (3 * _GELU_A)
        inner += 1
        inner *= x
        inner *= 0.5 * _GELU_C
        sech2 = t * t
        np.subtract(1, sech2, out=sech2)
        inner *= sech2
        inner += 0.5 * t
        inner += 0.5
        inner *= dy
        return inner


@register_layer
class Softmax(ParameterFree):
    """``exp(x) / sum(exp(x))`` over the last axis, without overflow. A classifier trains
    better on raw scores with :class:`mpidp.nn.SoftmaxCrossEntropy`."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        y = x - x.max(axis=-1, keepdims=True)
        np.exp(y, out=y)
        y /= y.sum(axis=-1, keepdims=True)
        self._y = y
        return y

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        dx = dy * self._y
        dx -= self._y * dx.sum(axis=-1, keepdims=True)
        return dx
