"""Layers that only change the per-sample shape: :class:`Flatten`, :class:`Reshape`.
Pure NumPy, no MPI; views where the input's layout allows (no copy), the batch axis kept."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import is_whole
from .layers import ParameterFree, register_layer


class _ShapeOnly(ParameterFree):
    """Forward reshapes each sample (:meth:`output_shape`); backward gives ``dy`` the input's shape back."""

    def forward(self, x: np.ndarray) -> np.ndarray:
        if x.ndim < 1:
            raise ValueError(f"{self!r} takes a batch (n, ...), got a scalar")
        self._x_shape = x.shape
        return x.reshape(len(x), *self.output_shape(x.shape[1:]))  # no -1: n may be 0

    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        if dy.size != int(np.prod(self._x_shape)):
            raise ValueError(f"{self!r}: dy has shape {tuple(dy.shape)}, which does not match "
                             f"the forward input {tuple(self._x_shape)}")
        return dy.reshape(self._x_shape)


@register_layer
class Flatten(_ShapeOnly):
    """``(n, *s)`` -> ``(n, prod(s))``: e.g. image features into a :class:`Dense` layer."""

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (int(np.prod(in_shape)),)


@register_layer
class Reshape(_ShapeOnly):
    """``(n, *s)`` -> ``(n, *shape)``, ``prod(shape) == prod(s)``; one entry of ``shape``
    may be -1 (inferred), e.g. ``Reshape((1, 28, 28))`` for flat MNIST rows. ``ValueError``
    for any other ``shape``, or one that does not hold as many values as the samples."""

    def __init__(self, shape: int | Sequence[int]) -> None:
        super().__init__()
        dims = (shape,) if isinstance(shape, (int, np.integer)) else shape
        if not isinstance(dims, (tuple, list)) or not dims or not all(
                is_whole(d, 1) or is_whole(d, -1) and d == -1 for d in dims) \
                or sum(d == -1 for d in dims) > 1:
            raise ValueError(f"Reshape needs a shape of sizes >= 1 with at most one -1, got {shape!r}")
        self.shape = tuple(int(d) for d in dims)

    def config(self) -> dict:
        return {"shape": list(self.shape)}

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        in_shape = tuple(in_shape)
        size, known = int(np.prod(in_shape)), int(np.prod([d for d in self.shape if d != -1]))
        if -1 in self.shape:
            if size % known:
                raise ValueError(f"{self!r}: samples of shape {in_shape} hold {size} values, "
                                 f"not a multiple of {known}, so -1 cannot be inferred")
            return tuple(size // known if d == -1 else d for d in self.shape)
        if size != known:
            raise ValueError(f"{self!r}: samples of shape {in_shape} hold {size} values, but "
                             f"shape {self.shape} holds {known}; the sizes must match")
        return self.shape

    def __repr__(self) -> str:
        return f"Reshape({self.shape})"
