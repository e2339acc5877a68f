"""Layers: pure NumPy, no MPI.

A layer declares the shapes of its parameters; :class:`mpidp.nn.Sequential` allocates
one flat buffer for every layer's parameters (and one for gradients) and hands each layer
views into it through :meth:`Layer.bind`. Gradients are SUMS over the samples of a batch,
never means: the caller divides by the global sample count after combining ranks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from .blas import add_xt_dy_

Shapes = dict[str, tuple[int, ...]]

class Layer(ABC):
    """Base class. ``forward`` caches what ``backward`` needs; ``backward`` writes grads."""

    params: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]

    def __init__(self) -> None:
        self.params = {}
        self.grads = {}

    def param_shapes(self) -> Shapes:
        """Shapes of this layer's parameters, in a fixed order (empty: no parameters)."""
        return {}

    def bind(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        """Attach views into the model's flat parameter and gradient buffers."""
        self.params, self.grads = params, grads

    def init_(self, rng: np.random.Generator) -> None:  # noqa: B027 - no parameters: nothing to do
        """Fill this layer's parameters in place from ``rng``."""

    def output_dim(self, n_in: int) -> int:
        """Number of output features for ``n_in`` input features."""
        return n_in

    @abstractmethod
    def forward(self, x: np.ndarray) -> np.ndarray:
        """Map ``x`` ``(n, n_in)`` to ``(n, n_out)``, caching what ``backward`` needs."""

    @abstractmethod
    def backward(self, dy: np.ndarray, accumulate: bool = False,
                 need_input_grad: bool = True) -> np.ndarray | None:
        """Given dL/dy ``(n, n_out)`` return dL/dx ``(n, n_in)``; write (or add to) grads.

        With ``need_input_grad=False`` (the first layer of a model) dL/dx is not computed
        and None is returned: for a ``Dense`` layer that saves a third of its backward work.
        """

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class Dense(Layer):
    """Fully connected layer ``y = x @ W + b``; ``W`` is ``(n_in, n_out)``, ``b`` ``(n_out,)``.

    ``init="he"`` (default, for ReLU) draws ``W ~ N(0, 2/n_in)``; ``"xavier"`` draws
    ``U(±sqrt(6/(n_in+n_out)))``; ``"zeros"`` is for linear models. ``b`` starts at zero.
    """

    def __init__(self, n_in: int, n_out: int, init: str = "he") -> None:
        super().__init__()
        if n_in < 1 or n_out < 1:
            raise ValueError(f"Dense needs n_in >= 1 and n_out >= 1, got {n_in}, {n_out}")
        if init not in ("he", "xavier", "zeros"):
            raise ValueError(f"unknown init {init!r}; expected 'he', 'xavier' or 'zeros'")
        self.n_in, self.n_out, self.init = n_in, n_out, init
        self._x: np.ndarray | None = None

    def param_shapes(self) -> Shapes:
        return {"W": (self.n_in, self.n_out), "b": (self.n_out,)}

    def output_dim(self, n_in: int) -> int:
        if n_in != self.n_in:
            raise ValueError(f"Dense expects {self.n_in} input features, got {n_in}")
        return self.n_out

    def init_(self, rng: np.random.Generator) -> None:
        W, b = self.params["W"], self.params["b"]
        if self.init == "he":
            W[...] = rng.standard_normal(W.shape) * np.sqrt(2.0 / self.n_in)
        elif self.init == "xavier":
            limit = np.sqrt(6.0 / (self.n_in + self.n_out))
            W[...] = rng.uniform(-limit, limit, W.shape)
        else:
            W[...] = 0
        b[...] = 0

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._x = x  # (n, n_in)
        y = x @ self.params["W"]  # (n, n_out)
        y += self.params["b"]
        return y

    def backward(self, dy: np.ndarray, accumulate: bool = False,
                 need_input_grad: bool = True) -> np.ndarray | None:
        x, dW, db = self._x, self.grads["W"], self.grads["b"]
        if accumulate:
            add_xt_dy_(dW, x, dy)
            db += dy.sum(axis=0)
        else:
            np.matmul(x.T, dy, out=dW)
            np.sum(dy, axis=0, out=db)
        return dy @ self.params["W"].T if need_input_grad else None  # (n, n_in)

    def __repr__(self) -> str:
        return f"Dense({self.n_in}, {self.n_out})"


class ReLU(Layer):
    """``max(x, 0)``; the derivative at 0 is taken as 0.

    ``inplace=True`` overwrites ``x`` in forward and ``dy`` in backward instead of
    allocating new arrays; use it only where both are temporaries (after a ``Dense``, as
    :func:`mpidp.nn.mlp` does), never as a model's first layer.
    """

    def __init__(self, inplace: bool = False) -> None:
        super().__init__()
        self.inplace = inplace

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._y = np.maximum(x, 0, out=x if self.inplace else None)
        return self._y

    def backward(self, dy: np.ndarray, accumulate: bool = False,
                 need_input_grad: bool = True) -> np.ndarray | None:
        if not need_input_grad:
            return None
        return np.multiply(dy, self._y > 0, out=dy if self.inplace else None)


class Tanh(Layer):
    """``tanh(x)``."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._y = np.tanh(x)
        return self._y

    def backward(self, dy: np.ndarray, accumulate: bool = False,
                 need_input_grad: bool = True) -> np.ndarray | None:
        return dy * (1 - self._y * self._y) if need_input_grad else None


class Sigmoid(Layer):
    """``1 / (1 + exp(-x))``, computed without overflow for large ``|x|``."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        e = np.exp(-np.abs(x))
        self._y = np.where(x >= 0, 1 / (1 + e), e / (1 + e))
        return self._y

    def backward(self, dy: np.ndarray, accumulate: bool = False,
                 need_input_grad: bool = True) -> np.ndarray | None:
        return dy * self._y * (1 - self._y) if need_input_grad else None
