"""Blocks: layers built of layers. ``Residual``: ``y = x + f(x)``."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np

from .context import Context
from .layers import Layer, Shapes, layer_spec, register_layer
from .model import Sequential, chain_shapes
from .modelfile import MAX_NESTING, layers_from


@register_layer
class Residual(Layer):
    """``y = x + f(x)``, ``f`` the chain of ``layers``, which must keep the per-sample shape
    and whose first may not overwrite its input. Inner parameters and state are named by
    position: ``"0.W"``, ``"2.gamma"`` (a block in a block: ``"1.0.W"``); inner layer ``j`` gets
    the key ``key + (j,)``."""

    def __init__(self, layers: Sequence[Layer]) -> None:
        super().__init__()
        layers = list(layers)
        if not layers or not all(isinstance(la, Layer) for la in layers):
            raise ValueError(f"Residual needs a non-empty list of layers, got {layers!r}")
        if (reads := next((la for la in layers if la.reads), None)) is not None:
            raise ValueError(f"Residual: its layer {reads!r} reads {reads.reads} from the data "
                             f"set itself, so it can only be a model's first layer")
        #: how many blocks deep its layers go (1: none of them is a block)
        self.nesting = 1 + max(getattr(la, "nesting", 0) for la in layers)
        if self.nesting > MAX_NESTING:
            raise ValueError(f"Residual: blocks nested {self.nesting} deep; they may nest at "
                             f"most {MAX_NESTING} deep")
        if getattr(layers[0], "inplace", False):
            raise ValueError(f"Residual: its first layer {layers[0]!r} overwrites its input, "
                             f"which the block adds to the output; build it with inplace=False")
        self.layers = layers

    needs = Sequential.needs  # type: ignore[assignment]  # what the inner layers need

    def config(self) -> dict:
        return {"layers": [layer_spec(la) for la in self.layers]}

    @classmethod
    def from_config(cls, settings: dict) -> Residual:
        """Rebuild from :meth:`config`, the inner specs as a model file's layers."""
        specs = settings.get("layers")
        if set(settings) != {"layers"} or not isinstance(specs, list):
            raise ValueError(f"Residual settings are {{'layers': [layer specs]}}, got {settings!r}")
        if not all(isinstance(d, dict) and isinstance(d.get("type"), str) for d in specs):
            raise ValueError(f"Residual: each of its layers is a dict with a 'type' string, got {specs!r}")
        return cls(layers_from(specs, where="Residual"))

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        in_shape = tuple(in_shape)
        out = chain_shapes(self.layers, in_shape)[-1]
        if out != in_shape:
            raise ValueError(f"Residual adds its input to the output of its layers, so they "
                             f"must keep the per-sample shape: they map {in_shape} to {out}")
        return in_shape

    def param_shapes(self) -> Shapes:
        return {f"{j}.{k}": s for j, la in enumerate(self.layers) for k, s in la.param_shapes().items()}

    def state_shapes(self) -> Shapes:
        return {f"{j}.{k}": s for j, la in enumerate(self.layers) for k, s in la.state_shapes().items()}

    def _split(self, views: dict[str, np.ndarray], shapes: str) -> list[dict[str, np.ndarray]]:
        """``views`` (``"j.name"`` keys) as one dict per inner layer, by its ``shapes()``."""
        return [{k: views[f"{j}.{k}"] for k in getattr(la, shapes)()} for j, la in enumerate(self.layers)]

    def bind(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        super().bind(params, grads)
        inner = self._split(grads, "param_shapes") if grads else [{}] * len(self.layers)
        for la, p, g in zip(self.layers, self._split(params, "param_shapes"), inner):
            la.bind(p, g)

    def bind_state(self, state: dict[str, np.ndarray]) -> None:
        super().bind_state(state)
        for la, s in zip(self.layers, self._split(state, "state_shapes")):
            la.bind_state(s)

    def set_context(self, context: Context, key: tuple[int, ...] = ()) -> None:
        super().set_context(context, key)
        for j, la in enumerate(self.layers):
            la.set_context(context, (*self.key, j))

    def init_(self, rng: np.random.Generator) -> None:
        for la in self.layers:
            la.init_(rng)

    def forward(self, x: np.ndarray) -> np.ndarray:
        h = x
        for la in self.layers:
            h = la.forward(h)
        if h.shape != x.shape:
            raise ValueError(f"Residual: its layers map a batch of shape {x.shape} to {h.shape}")
        return x + h  # a new array: h may be x itself or an inner layer's cache

    def backward(self, dy: np.ndarray, accumulate: bool = False,
                 need_input_grad: bool = True) -> np.ndarray | None:
        g = dy.copy() if getattr(self.layers[-1], "inplace", False) else dy
        for j in range(len(self.layers) - 1, -1, -1):
            g = self.layers[j].backward(g, accumulate, need_input_grad=need_input_grad or j > 0)
        return dy + g if need_input_grad else None

    def __copy__(self) -> Residual:
        """A copy with its own copies of the inner layers (sharing their parameter views)."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        new.layers = [copy.copy(la) for la in self.layers]
        return new

    def __repr__(self) -> str:
        return f"Residual([{', '.join(map(repr, self.layers))}])"
