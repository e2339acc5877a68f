"""The layer protocol (``docs/extending.md``), the registry of layer classes, and ``Dense``. A
layer maps ``(n, *in_shape)`` to ``(n, *out_shape)``, the batch axis (split across ranks) first;
its parameters and *state* are views into the model's flat buffers, and its gradients are SUMS
over the batch's samples, never means."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from ..errors import is_whole
from .blas import add_matmul_, add_xt_dy_
from .context import Context

Shapes = dict[str, tuple[int, ...]]
INITS = ("he", "xavier", "zeros")  # what a Dense or a convolution may start from


class Layer(ABC):
    """Base class. ``forward`` caches what ``backward`` needs; ``backward`` writes grads."""

    params: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    state: dict[str, np.ndarray]
    context: Context
    #: needed from the trainer: ``"replica-sums"`` (``context.reduce_sum``), ``"sample-index"``
    needs: frozenset[str] = frozenset()
    #: what the layer reads from the data set itself rather than from features a layer
    #: computes (``"token ids"``): such a layer can only be a model's first
    reads: str = ""

    def __init__(self) -> None:
        self.params, self.grads, self.state = {}, {}, {}
        self.context = Context()
        self.key: tuple[int, ...] = ()

    def param_shapes(self) -> Shapes:
        """Shapes of this layer's parameters, in a fixed order (empty: no parameters)."""
        return {}

    def bind(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]) -> None:
        """Attach views into the model's flat parameter and gradient buffers."""
        self.params, self.grads = params, grads

    def state_shapes(self) -> Shapes:
        """Shapes of this layer's untrained state (running statistics), in a fixed order."""
        return {}

    def bind_state(self, state: dict[str, np.ndarray]) -> None:
        """Attach views into the model's flat state buffer (called after :meth:`bind`)."""
        self.state = state

    def init_(self, rng: np.random.Generator) -> None:  # noqa: B027 - no parameters: nothing to do
        """Fill this layer's parameters (and state) in place from ``rng``."""

    def config(self) -> dict:
        """JSON-able settings that rebuild the layer (``cls(**config())``); default
        ``n_in`` and ``n_out`` where the layer has ``n_out``."""
        return {"n_in": self.n_in, "n_out": self.n_out} if hasattr(self, "n_out") else {}

    def set_context(self, context: Context, key: tuple[int, ...] = ()) -> None:
        """Share the model's :class:`Context`; ``key`` is the layer's position (``(i,)``;
        inside a block ``(i, j)``), which keys anything random it draws."""
        self.context, self.key = context, tuple(key)

    def output_dim(self, n_in: int) -> int:
        """Output features for ``n_in`` input features (a layer of flat features may define
        it instead of :meth:`output_shape`); default: from :meth:`output_shape`."""
        return self.output_shape((n_in,))[0]

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Per-sample output shape for input shape ``in_shape`` (``ValueError`` if the layer
        cannot take it); called once, before :meth:`param_shapes`, so a layer may fix sizes
        here. Default: :meth:`output_dim` (if defined) for flat features, else unchanged."""
        if len(in_shape) == 1 and type(self).output_dim is not Layer.output_dim:
            return (int(self.output_dim(in_shape[0])),)
        return tuple(in_shape)

    @abstractmethod
    def forward(self, x: np.ndarray) -> np.ndarray:
        """Map ``x`` ``(n, *in_shape)`` to ``(n, *out_shape)``, caching what backward needs."""

    @abstractmethod
    def backward(self, dy: np.ndarray, accumulate: bool = False,
                 need_input_grad: bool = True) -> np.ndarray | None:
        """Given dL/dy ``(n, *out_shape)`` return dL/dx ``(n, *in_shape)``; write (or add
        to) grads. With ``need_input_grad=False`` (a model's first layer) return None."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class ParameterFree(Layer):
    """A layer without parameters: ``backward`` is :meth:`input_grad` (None if not needed)."""

    def backward(self, dy: np.ndarray, accumulate: bool = False,
                 need_input_grad: bool = True) -> np.ndarray | None:
        return self.input_grad(dy) if need_input_grad else None

    @abstractmethod
    def input_grad(self, dy: np.ndarray) -> np.ndarray:
        """dL/dx ``(n, *in_shape)`` from dL/dy ``(n, *out_shape)``."""


_LayerT = TypeVar("_LayerT", bound=type)

RESERVED = ("type", "model_n_in", "model_in_shape")  # spec keys that are not a layer's settings
_CLASSES: dict[str, type] = {}  # registered name -> layer class
_NAMES: dict[type, str] = {}    # layer class -> the name its specs are written under


def _where(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_layer(cls: _LayerT | None = None, *, name: str | None = None
                   ) -> _LayerT | Callable[[_LayerT], _LayerT]:
    """Register a layer class (returned) so saved models using it can be rebuilt, as
    ``register_layer(MyLayer)``, ``@register_layer`` or ``@register_layer(name="my-layer")``: ``name``
    (default: the class name) is its ``"type"`` in a model spec; see ``docs/extending.md``. ``TypeError`` for
    a non-:class:`Layer`, ``ValueError`` if ``name`` is another class's (a class reloaded replaces itself)."""
    def add(layer_cls: _LayerT) -> _LayerT:
        if not (isinstance(layer_cls, type) and issubclass(layer_cls, Layer)):
            raise TypeError(f"register_layer needs a subclass of mpidp.nn.Layer, got {layer_cls!r}")
        key = layer_cls.__name__ if name is None else str(name)
        if not key:
            raise ValueError("a layer class needs a non-empty name")
        if (have := _CLASSES.get(key)) is not None and have is not layer_cls:
            if _where(have) != _where(layer_cls):
                raise ValueError(f"layer name {key!r} is already registered to {_where(have)}; "
                                 f"cannot register {_where(layer_cls)} under it too (pass "
                                 f"name=... to register_layer to keep both)")
            del _NAMES[have]  # the same class, defined again: the new definition wins
        _CLASSES[key] = layer_cls
        _NAMES.setdefault(layer_cls, key)
        return layer_cls

    return add if cls is None else add(cls)


def registered_layers() -> dict[str, type]:
    """A copy of the registry: name -> layer class."""
    return dict(_CLASSES)


def layer_name(cls: type) -> str:
    """The name ``cls`` is registered under; its class name when it is not registered."""
    return _NAMES.get(cls, cls.__name__)


def layer_spec(layer: Layer) -> dict:
    """``{"type": <registered name>, **layer.config()}`` (config may not use :data:`RESERVED`)."""
    settings = dict(layer.config())
    if clash := [k for k in RESERVED if k in settings]:
        raise ValueError(f"{type(layer).__name__}.config() may not use the key(s) {clash}: "
                         f"they are reserved in a model spec")
    return {"type": layer_name(type(layer)), **settings}


def layer_class(name: str) -> type:
    """The layer class registered under ``name`` (``ValueError`` if none)."""
    try:
        return _CLASSES[name]
    except (KeyError, TypeError):
        raise ValueError(f"the model spec names layer class {name!r}, which is not registered: "
                         f"register it with mpidp.nn.register_layer (e.g. decorate the class "
                         f"with @mpidp.nn.register_layer) before loading; registered: "
                         f"{', '.join(sorted(_CLASSES))}") from None


def write_grad(grad: np.ndarray, value: np.ndarray, accumulate: bool) -> None:
    if accumulate:
        grad += value
    else:
        grad[...] = value


def check_init(init: str) -> str:
    if init not in INITS:
        raise ValueError(f"unknown init {init!r}; expected 'he', 'xavier' or 'zeros'")
    return init


def is_finite_number(value: object) -> bool:
    """True for a finite real number (Python or NumPy, not a bool), as a layer's settings are."""
    return not isinstance(value, bool) and isinstance(value, (int, float, np.number)) and math.isfinite(value)


def init_weights(W: np.ndarray, init: str, fan_in: int, fan_out: int, rng: np.random.Generator) -> None:
    """Fill ``W`` in place from ``rng`` by ``init``: ``"he"``, ``"normal"``, ``"xavier"`` or else zeros."""
    if init == "he":
        W[...] = rng.standard_normal(W.shape) * np.sqrt(2.0 / fan_in)
    elif init == "normal":
        W[...] = rng.standard_normal(W.shape)
    elif init == "xavier":
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        W[...] = rng.uniform(-limit, limit, W.shape)
    else:
        W[...] = 0


@register_layer
class Dense(Layer):
    """Fully connected layer ``y = x @ W + b``; ``W`` is ``(n_in, n_out)``, ``b`` ``(n_out,)``
    (zeros). ``init``: ``"he"`` (default, for ReLU) ``W ~ N(0, 2/n_in)``, ``"xavier"``
    ``U(±sqrt(6/(n_in+n_out)))`` or ``"zeros"``; ``n_in=None``: the width of the input."""

    def __init__(self, n_in: int | None, n_out: int, init: str = "he") -> None:
        super().__init__()
        for name, v in (("n_in", n_in), ("n_out", n_out)):
            if not (is_whole(v, 1) or name == "n_in" and v is None):
                raise ValueError(f"{type(self).__name__} needs {name} >= 1 (an int), got {v!r}")
        self.n_in, self.n_out, self.init = n_in, n_out, check_init(init)
        self._x: np.ndarray | None = None

    def param_shapes(self) -> Shapes:
        return {"W": (self.n_in, self.n_out), "b": (self.n_out,)}

    def output_dim(self, n_in: int) -> int:
        if self.n_in is None:
            self.n_in = int(n_in)
        if n_in != self.n_in:
            raise ValueError(f"{type(self).__name__} expects {self.n_in} input features, got {n_in}")
        return self.n_out

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        if len(in_shape) != 1:
            raise ValueError(f"{type(self).__name__} takes flat features, got per-sample shape "
                             f"{tuple(in_shape)}: put a Flatten in front of it")
        return (self.output_dim(in_shape[0]),)

    def init_(self, rng: np.random.Generator) -> None:
        init_weights(self.params["W"], self.init, self.n_in, self.n_out, rng)
        self.params["b"][...] = 0

    @property
    def reads_params_in_parts(self) -> bool:
        """Whether ``forward`` reads ``W`` in parts of ``context.params_piece`` as they are
        final (``context.params_ready``): a plain ``Dense`` larger than a part."""
        piece = self.context.params_piece
        return type(self).forward is Dense.forward and 0 < piece < self.n_in * self.n_out

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._x = x  # (n, n_in)
        W, ctx = self.params["W"], self.context
        if not self.reads_params_in_parts:
            y = x @ W  # (n, n_out)
        else:  # the sum over row blocks of W, each read once it is final
            rows = -(-ctx.params_piece // self.n_out)
            ctx.params_ready(self, min(rows, len(W)) * self.n_out)
            y = x[:, :rows] @ W[:rows]
            for r in range(rows, len(W), rows):
                ctx.params_ready(self, min(r + rows, len(W)) * self.n_out)
                add_matmul_(y, x[:, r:r + rows], W[r:r + rows])  # in place: no pass of its own
            ctx.params_ready(self)  # and b
        y += self.params["b"]
        return y

    def backward(self, dy: np.ndarray, accumulate: bool = False,
                 need_input_grad: bool = True) -> np.ndarray | None:
        x, dW, db = self._x, self.grads["W"], self.grads["b"]
        mine = type(self).backward is Dense.backward  # (a subclass may change them after)
        if accumulate:
            add_xt_dy_(dW, x, dy)
            db += dy.sum(axis=0)
        else:
            np.sum(dy, axis=0, out=db)
            piece = self.context.grads_piece if mine else 0
            # rows of dW per part: the listener may send each part while the next is computed
            rows = -(-piece // self.n_out) if 0 < piece < dW.size else len(dW)
            for r in range(0, len(dW), rows):
                np.matmul(x[:, r:r + rows].T, dy, out=dW[r:r + rows])
                if r + rows < len(dW):
                    self.context.grads_final(self, (r + rows) * self.n_out)
        if mine:
            self.context.grads_final(self)  # W and b may be sent while dL/dx is computed
        return dy @ self.params["W"].T if need_input_grad else None  # (n, n_in)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.n_in}, {self.n_out})"
