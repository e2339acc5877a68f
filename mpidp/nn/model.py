"""``Sequential``: a stack of layers whose parameters are views into ONE flat buffer.

``model.params`` (all weights) and ``model.grads`` (all gradients) are contiguous 1-D
arrays, so synchronising a model is one ``Bcast`` and combining gradients one ``Allreduce``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from .layers import Layer

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


class Sequential:
    """Layers applied in order to inputs of shape ``(n_samples, n_in)``.

    Parameters
    ----------
    layers : the layers, in order; their shapes must chain (checked here).
    n_in : number of input features.
    dtype : ``float32`` or ``float64``; parameters, gradients and activations use it.

    Notes
    -----
    ``params`` and ``grads`` have ``n_params`` elements; ``layer.params[k]`` is a view of
    ``params`` for every layer and key, in layer order then ``param_shapes`` order.
    """

    def __init__(self, layers: Sequence[Layer], n_in: int,
                 dtype: npt.DTypeLike = np.float32) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _FLOATS:
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype}")
        if not layers:
            raise ValueError("Sequential needs at least one layer")
        self.layers = list(layers)
        self.n_in = int(n_in)
        dim = self.n_in
        for layer in self.layers:
            dim = layer.output_dim(dim)
        self.n_out = dim
        self.n_params = sum(int(np.prod(s)) for layer in self.layers
                            for s in layer.param_shapes().values())
        self.params = np.zeros(self.n_params, self.dtype)
        self._bind(self.params, np.zeros(self.n_params, self.dtype))

    def _bind(self, params: np.ndarray, grads: np.ndarray) -> None:
        self.params, self.grads = params, grads
        offset = 0
        self.layer_ranges: list[tuple[int, int]] = []  # [lo, hi) of each layer in the buffers
        for layer in self.layers:
            p, g, lo = {}, {}, offset
            for name, shape in layer.param_shapes().items():
                size = int(np.prod(shape))
                p[name] = params[offset:offset + size].reshape(shape)
                g[name] = grads[offset:offset + size].reshape(shape)
                offset += size
            layer.bind(p, g)
            self.layer_ranges.append((lo, offset))

    def use_grad_buffer(self, buffer: np.ndarray) -> None:
        """Make ``grads`` (and every layer's gradient views) live in ``buffer[:n_params]``.

        Lets a trainer append extra slots (loss, counts) to the gradient buffer so one
        collective carries them all.
        """
        if buffer.dtype != self.dtype or buffer.ndim != 1 or len(buffer) < self.n_params:
            raise ValueError(f"grad buffer must be 1-D {self.dtype} with >= {self.n_params} items")
        self._bind(self.params, buffer[:self.n_params])

    def use_param_buffer(self, buffer: np.ndarray) -> None:
        """Move ``params`` (and every layer's parameter views) into ``buffer`` ``(n_params,)``,
        keeping their values: e.g. into memory other processes can read. Arrays taken from
        ``params`` before the move no longer follow the model."""
        if buffer.dtype != self.dtype or buffer.shape != (self.n_params,):
            raise ValueError(f"param buffer must be 1-D {self.dtype} with {self.n_params} items")
        buffer[...] = self.params
        self._bind(buffer, self.grads)

    def init_(self, rng: np.random.Generator | int) -> Sequential:
        """Initialise every layer's parameters from ``rng`` (a Generator or a seed); returns self."""
        rng = np.random.default_rng(rng) if not isinstance(rng, np.random.Generator) else rng
        for layer in self.layers:
            layer.init_(rng)
        return self

    def forward(self, x: np.ndarray) -> np.ndarray:
        """``x`` ``(n, n_in)`` → output ``(n, n_out)``; caches activations for ``backward``."""
        for layer in self.layers:
            x = layer.forward(x)
        return x

    __call__ = forward

    def backward(self, dy: np.ndarray, accumulate: bool = False, input_grad: bool = True,
                 on_layer_done: Callable[[int], None] | None = None) -> np.ndarray | None:
        """Back-propagate dL/dy ``(n, n_out)``; writes (or adds to) ``grads``; returns dL/dx
        ``(n, n_in)``, or None with ``input_grad=False`` (then its cost is skipped).

        ``on_layer_done(i)`` is called as soon as layer ``i``'s gradients are final (last
        layer first), so a trainer can start communicating them during the rest of backward.
        """
        last = len(self.layers) - 1
        for i, layer in enumerate(reversed(self.layers)):
            dy = layer.backward(dy, accumulate, need_input_grad=input_grad or i < last)
            if on_layer_done is not None:
                on_layer_done(last - i)
        return dy

    def spec(self) -> list[dict]:
        """A JSON-able description from which :func:`mpidp.nn.from_spec` rebuilds the model."""
        out = []
        for layer in self.layers:
            d: dict = {"type": type(layer).__name__}
            if hasattr(layer, "n_out"):
                d.update(n_in=layer.n_in, n_out=layer.n_out)
            out.append(d)
        out[0]["model_n_in"] = self.n_in
        return out

    def __repr__(self) -> str:
        inner = ", ".join(map(repr, self.layers))
        return f"Sequential([{inner}], n_in={self.n_in}, dtype={self.dtype}, n_params={self.n_params})"
