"""Optimizers over one flat parameter vector: pure NumPy, no MPI, kept outside the layers.

``step_(params, grad)`` updates ``params`` in place from the global MEAN gradient. State
(momentum, Adam moments) is flat too, so it checkpoints and shards like the parameters.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np


def chunk_edges(n: int, chunks: int) -> list[int]:
    """``chunks + 1`` boundaries cutting ``range(n)`` into near-equal consecutive pieces."""
    chunks = max(1, min(int(chunks), n)) if n else 1
    return [n * k // chunks for k in range(chunks + 1)]


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

    def step_(self, params: np.ndarray, grad: np.ndarray, scale: float = 1.0, chunks: int = 1,
              on_chunk: Callable[[int, int], None] | None = None) -> None:
        """Update ``params`` (1-D) in place from the mean gradient ``scale * grad``.

        ``grad`` (same shape) is used as scratch space and overwritten: folding the
        ``1 / count`` of a global mean into ``scale`` saves a pass over the gradient.
        ``chunks > 1`` updates ``params[lo:hi]`` piece by piece (the same numbers: every
        rule is elementwise) and calls ``on_chunk(lo, hi)`` as soon as each piece is final,
        so a caller can ship it while the next one is computed.
        """
        self.t += 1
        first = self._prepare(params)
        edges = chunk_edges(len(params), chunks)
        for lo, hi in zip(edges[:-1], edges[1:]):
            state = {k: v[lo:hi] for k, v in self.state.items()}
            self._update(params[lo:hi], grad[lo:hi], state, scale, first)
            if on_chunk is not None:
                on_chunk(lo, hi)

    def _prepare(self, params: np.ndarray) -> bool:
        """Allocate missing state for ``params``; True if it was missing (a first step)."""
        return False

    @abstractmethod
    def _update(self, params: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray],
                scale: float, first: bool) -> None:
        """Apply this step to one piece: ``params``, ``grad`` and ``state`` are matching slices."""


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

    def _prepare(self, params: np.ndarray) -> bool:
        if not self.momentum or "velocity" in self.state:
            return False
        self.state["velocity"] = np.empty_like(params)
        return True

    def _update(self, params: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray],
                scale: float, first: bool) -> None:
        if self.momentum == 0 and not self.weight_decay:  # the common case: two passes
            # (not one BLAS axpy: that rounds differently, and this keeps plain SGD
            # bit-identical to a hand-written NumPy loop and to NumPy-only installs)
            grad *= self.lr * scale
            params -= grad
            return
        g = self._grad(params, grad, scale)
        if self.momentum:
            v = state["velocity"]
            if first:
                v[...] = g
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

    def _prepare(self, params: np.ndarray) -> bool:
        if self.state:
            return False
        self.state["m"] = np.zeros_like(params)
        self.state["v"] = np.zeros_like(params)
        return True

    def _update(self, params: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray],
                scale: float, first: bool) -> None:
        g = self._grad(params, grad, scale)
        m, v = state["m"], state["v"]
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
