"""Optimizers over one flat parameter vector: pure NumPy, no MPI, kept outside the layers.

``step_(params, grad)`` updates ``params`` in place from the global MEAN gradient. State
(momentum, Adam moments) is flat too, so it checkpoints and shards like the parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class Optimizer(ABC):
    """Base class: ``step_`` mutates ``params`` in place; ``state`` holds flat arrays."""

    def __init__(self, lr: float, weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"learning rate must be > 0, got {lr}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        self.lr, self.weight_decay = float(lr), float(weight_decay)
        self.state: dict[str, np.ndarray] = {}
        self.t = 0  # number of steps taken

    def _grad(self, params: np.ndarray, grad: np.ndarray, scale: float) -> np.ndarray:
        """``scale * grad + wd * params``, computed in ``grad``'s own buffer."""
        if scale != 1.0:
            grad *= scale
        if self.weight_decay:
            grad += self.weight_decay * params
        return grad

    @abstractmethod
    def step_(self, params: np.ndarray, grad: np.ndarray, scale: float = 1.0) -> None:
        """Update ``params`` (1-D) in place from the mean gradient ``scale * grad``.

        ``grad`` (same shape) is used as scratch space and overwritten: folding the
        ``1 / count`` of a global mean into ``scale`` saves a pass over the gradient.
        """


class SGD(Optimizer):
    """SGD with optional (heavy-ball or Nesterov) momentum and L2 weight decay.

    ``v = momentum * v + g``; ``p -= lr * v`` (Nesterov: ``p -= lr * (g + momentum * v)``).
    """

    def __init__(self, lr: float = 0.01, momentum: float = 0.0, weight_decay: float = 0.0,
                 nesterov: bool = False) -> None:
        super().__init__(lr, weight_decay)
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if nesterov and momentum == 0:
            raise ValueError("nesterov momentum needs momentum > 0")
        self.momentum, self.nesterov = float(momentum), nesterov

    def step_(self, params: np.ndarray, grad: np.ndarray, scale: float = 1.0) -> None:
        self.t += 1
        if self.momentum == 0 and not self.weight_decay:  # the common case: two passes
            # (not one BLAS axpy: that rounds differently, and this keeps plain SGD
            # bit-identical to a hand-written NumPy loop and to NumPy-only installs)
            grad *= self.lr * scale
            params -= grad
            return
        g = self._grad(params, grad, scale)
        v = self.state.get("velocity")
        if v is None:
            v = self.state["velocity"] = g.astype(params.dtype, copy=True)
        else:
            v *= self.momentum
            v += g
        if self.nesterov:
            g += self.momentum * v
        else:
            g[...] = v
        g *= self.lr
        params -= g


class Adam(Optimizer):
    """Adam (Kingma & Ba, 2015) with bias correction; ``weight_decay`` is classic L2."""

    def __init__(self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(lr, weight_decay)
        b1, b2 = betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise ValueError(f"Adam betas must be in [0, 1), got {betas}")
        self.b1, self.b2, self.eps = float(b1), float(b2), float(eps)

    def step_(self, params: np.ndarray, grad: np.ndarray, scale: float = 1.0) -> None:
        g = self._grad(params, grad, scale)
        if not self.state:
            self.state["m"] = np.zeros_like(params)
            self.state["v"] = np.zeros_like(params)
        m, v = self.state["m"], self.state["v"]
        self.t += 1
        m *= self.b1
        m += (1 - self.b1) * g
        v *= self.b2
        v += (1 - self.b2) * (g * g)
        m_hat_scale = 1 / (1 - self.b1 ** self.t)
        v_hat = v / (1 - self.b2 ** self.t)
        params -= (self.lr * m_hat_scale) * m / (np.sqrt(v_hat) + self.eps)


def make_optimizer(name: str, lr: float, momentum: float = 0.9,
                   weight_decay: float = 0.0) -> Optimizer:
    """Build an optimizer by CLI name: ``sgd``, ``momentum`` (SGD with momentum) or ``adam``."""
    if name == "sgd":
        return SGD(lr, weight_decay=weight_decay)
    if name == "momentum":
        return SGD(lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return Adam(lr, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; expected 'sgd', 'momentum' or 'adam'")
