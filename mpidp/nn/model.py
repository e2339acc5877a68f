"""``Sequential``: a stack of layers whose parameters are views into ONE flat buffer, so
synchronising a model is one ``Bcast`` and combining gradients one ``Allreduce``; saved to and
loaded from one ``model.npz`` (:func:`save`, :func:`load`), the file ``mpidp train`` writes."""

from __future__ import annotations

import json
import os
import warnings
import zipfile
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..atomic import check_place, numpy_kind, write_atomic
from ..errors import is_whole
from .context import Context, _unheard
from .layers import RESERVED, Layer, _where, layer_class, layer_name, layer_spec, registered_layers
from .losses import outputs

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
MODEL_FILE = "model.npz"


def as_shape(n_in: int | Sequence[int], what: str = "n_in") -> tuple[int, ...]:
    """A per-sample shape from a width or a sequence of sizes (each >= 1)."""
    shape = (n_in,) if isinstance(n_in, (int, np.integer)) else tuple(n_in)
    if not shape or not all(is_whole(d, 1) for d in shape):
        raise ValueError(f"{what} must be a positive width or a tuple of positive sizes, got {n_in!r}")
    return tuple(int(d) for d in shape)


def chain_shapes(layers: Sequence[Layer], in_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Per-sample shapes ``[in_shape, out of layer 0, ..., out of the last layer]``; raises
    ``ValueError`` naming the first layer that cannot take its input's shape, or one that
    reads the data's rows themselves (:attr:`Layer.reads`) after another layer."""
    if (late := next((i for i, la in enumerate(layers) if i and getattr(la, "reads", "")), None)) is not None:
        raise ValueError(f"layer {late} ({layers[late]!r}) reads {layers[late].reads} from the data set "
                         f"itself, so it must be the first layer; here {layers[late - 1]!r} comes before it")
    shapes = [tuple(in_shape)]
    for i, layer in enumerate(layers):
        try:
            shapes.append(as_shape(layer.output_shape(shapes[-1]), "an output shape"))
        except ValueError as exc:
            got = f"{shapes[-1][0]} features" if len(shapes[-1]) == 1 else f"samples of shape {shapes[-1]}"
            raise ValueError(f"layer shapes do not chain: layer {i} ({layer!r}) gets "
                             f"{got} from the layer before it: {exc}") from None
    return shapes


def _sizes(layers: Sequence[Layer], which: str) -> list[int]:
    """Values per layer of ``layer.<which>()`` (``"param_shapes"`` or ``"state_shapes"``)."""
    return [sum(int(np.prod(s)) for s in getattr(la, which)().values()) for la in layers]


def _carve(buffer: np.ndarray, layers: Sequence[Layer], which: str) -> list[dict]:
    """Views of ``buffer``, one ``{name: view}`` per layer, by ``layer.<which>()`` in order."""
    views, offset = [], 0
    for layer in layers:
        views.append({})
        for name, shape in getattr(layer, which)().items():
            size = int(np.prod(shape))
            views[-1][name] = buffer[offset:offset + size].reshape(shape)
            offset += size
    return views


class Sequential:
    """Layers applied in order to inputs ``(n_samples, *in_shape)``; ``n_in``: a number of
    features or a per-sample shape; ``dtype``: ``float32`` or ``float64``, of everything.
    ``params`` and ``grads`` ``(n_params,)`` (contiguous) hold every ``layer.params[k]`` as a view,
    in layer then ``param_shapes`` order; ``state`` ``(n_state,)`` likewise the untrained state.
    ``in_shape`` / ``out_shape``: per-sample shapes (``n_in`` / ``n_out`` their sizes); ``context``:
    the :class:`Context` the layers share; ``meta``: a JSON-able dict saved with the model."""

    def __init__(self, layers: Sequence[Layer], n_in: int | Sequence[int],
                 dtype: npt.DTypeLike = np.float32) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype not in _FLOATS:
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype}")
        if not layers:
            raise ValueError("Sequential needs at least one layer")
        self.layers = list(layers)
        self.in_shape = as_shape(n_in)
        self.shapes = chain_shapes(self.layers, self.in_shape)
        self.out_shape = self.shapes[-1]
        self.n_in, self.n_out = int(np.prod(self.in_shape)), int(np.prod(self.out_shape))
        edges = np.cumsum([0, *_sizes(self.layers, "param_shapes")]).tolist()
        #: ``[lo, hi)`` of each layer in ``params`` and ``grads``
        self.layer_ranges: list[tuple[int, int]] = list(zip(edges[:-1], edges[1:]))
        self.n_params, self.n_state = edges[-1], sum(_sizes(self.layers, "state_shapes"))
        self._bind(np.zeros(self.n_params, self.dtype), np.zeros(self.n_params, self.dtype))
        self.state = np.zeros(self.n_state, self.dtype)
        for layer, views in zip(self.layers, _carve(self.state, self.layers, "state_shapes")):
            layer.bind_state(views)
        self.set_context(Context())
        self.meta: dict[str, Any] = {}

    @property
    def needs(self) -> frozenset[str]:
        """What the layers need from the trainer (:attr:`mpidp.nn.Layer.needs`), together."""
        return frozenset().union(*(layer.needs for layer in self.layers))

    def set_context(self, context: Context) -> None:
        """Share ``context`` with every layer (a trainer's, filled before each step)."""
        self.context = context
        for i, layer in enumerate(self.layers):
            layer.set_context(context, (i,))

    def _bind(self, params: np.ndarray, grads: np.ndarray) -> None:
        self.params, self.grads = params, grads
        for layer, p, g in zip(self.layers, _carve(params, self.layers, "param_shapes"),
                               _carve(grads, self.layers, "param_shapes")):
            layer.bind(p, g)

    def use_grad_buffer(self, buffer: np.ndarray) -> None:
        """Make ``grads`` (and the layers' gradient views) live in ``buffer[:n_params]`` (a
        trainer's extra slots after them then travel in the same collective)."""
        if buffer.dtype != self.dtype or buffer.ndim != 1 or len(buffer) < self.n_params:
            raise ValueError(f"grad buffer must be 1-D {self.dtype} with >= {self.n_params} items")
        self._bind(self.params, buffer[:self.n_params])

    def use_param_buffer(self, buffer: np.ndarray) -> None:
        """Move ``params`` (and the layers' views) into ``buffer`` ``(n_params,)``, keeping
        their values; arrays taken from ``params`` before no longer follow the model."""
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

    def forward(self, x: np.ndarray, on_layer_params: Callable[[int, int | None], None] | None = None,
                piece: int = 0) -> np.ndarray:
        """``x`` ``(n, *in_shape)`` → output ``(n, *out_shape)``; caches activations for
        ``backward``. Runs in the mode ``context.training`` says (False: evaluation).

        ``on_layer_params(i, upto)`` returns once the first ``upto`` values of layer ``i``'s
        range of ``params`` (None: all) are final: called before each layer's ``forward``,
        or before each part of about ``piece`` values of a layer that reads its parameters
        in parts (a ``Dense``; the same parts whatever the timing)."""
        if tuple(x.shape[1:]) != self.in_shape and not (
                len(self.in_shape) == 1 and x.ndim == 2 and x.shape[1] == self.n_in):
            raise ValueError(f"the model takes samples of shape {self.in_shape}, got a batch "
                             f"of shape {tuple(x.shape)}")
        if on_layer_params is None:
            for layer in self.layers:
                x = layer.forward(x)
            return x
        ctx = self.context
        try:
            ctx.params_piece = max(int(piece), 0)
            for i, layer in enumerate(self.layers):
                ctx.params_ready = (lambda who, upto=None, i=i, layer=layer: on_layer_params(
                    i, None if upto is None else int(upto)) if who is layer else None)
                if not getattr(layer, "reads_params_in_parts", False):
                    on_layer_params(i, None)
                x = layer.forward(x)
        finally:
            ctx.params_ready, ctx.params_piece = _unheard, 0
        return x

    __call__ = forward

    def predict(self, x: np.ndarray, output: str = "scores") -> np.ndarray:
        """Predictions for ``x`` ``(n, *in_shape)`` as ``output`` (:data:`mpidp.nn.OUTPUTS`;
        ``scores`` for a regression), always in evaluation mode."""
        was, self.context.training = self.context.training, False
        try:
            return outputs(self.forward(x), output)
        finally:
            self.context.training = was

    def backward(self, dy: np.ndarray, accumulate: bool = False, input_grad: bool = True,
                 on_layer_done: Callable[[int], None] | None = None,
                 on_layer_part: Callable[[int, int], None] | None = None,
                 piece: int = 0) -> np.ndarray | None:
        """Back-propagate dL/dy ``(n, n_out)``; writes (or adds to) ``grads``; returns dL/dx
        ``(n, n_in)``, or None with ``input_grad=False`` (then its cost is skipped).

        ``on_layer_done(i)``: layer ``i``'s gradients are final (last layer first), at its
        ``context.grads_final(layer)`` if it calls it (a ``Dense`` does, before its input
        gradient), else once its ``backward`` returns. ``on_layer_part(i, done)`` (with
        ``piece > 0``): the first ``done`` values of layer ``i``'s range of ``grads`` are
        final, after each part of ``piece`` values of a layer that computes them in parts."""
        last = len(self.layers) - 1
        told = set()  # the layers on_layer_done has heard of

        def final(layer: object, i: int, done: int | None = None) -> None:
            if layer is not self.layers[i] or i in told:
                return
            if done is None:
                told.add(i)
                if on_layer_done is not None:
                    on_layer_done(i)
            elif on_layer_part is not None:
                on_layer_part(i, int(done))

        ctx, heard = self.context, on_layer_done is not None or on_layer_part is not None
        try:
            for i, layer in enumerate(reversed(self.layers)):
                if heard:
                    ctx.grads_final = lambda who, done=None, i=last - i: final(who, i, done)
                    ctx.grads_piece = max(int(piece), 0) if on_layer_part is not None else 0
                dy = layer.backward(dy, accumulate, need_input_grad=input_grad or i < last)
                if heard:
                    final(layer, last - i)
        finally:
            ctx.grads_final, ctx.grads_piece = _unheard, 0
        return dy

    def spec(self) -> list[dict]:
        """JSON-able, for :func:`from_spec` (no parameters): ``{"type": <registered name>, **layer.config()}``
        per layer, the first also holding ``"model_n_in"`` (flat inputs) or ``"model_in_shape"`` (a list)."""
        shape = {"model_n_in": self.n_in} if len(self.in_shape) == 1 else {"model_in_shape": [*self.in_shape]}
        out = [layer_spec(layer) for layer in self.layers]
        out[0].update(shape)
        return out

    def save(self, path: str | os.PathLike, meta: dict | None = None) -> str:
        """Write the model to ``path``: see :func:`save`. Returns the path written."""
        return save(self, path, meta, stacklevel=3)

    def __repr__(self) -> str:
        inner = ", ".join(map(repr, self.layers))
        shape = self.n_in if len(self.in_shape) == 1 else self.in_shape
        return f"Sequential([{inner}], n_in={shape}, dtype={self.dtype}, n_params={self.n_params})"


def from_spec(spec: Sequence[dict], dtype: npt.DTypeLike = np.float32) -> Sequential:
    """Rebuild a model, parameters zero, from :meth:`Sequential.spec` (each layer by its
    class's ``from_config(settings)``, else ``cls(**settings)``). ``ValueError`` if a layer
    type is not registered, its settings do not rebuild it, or ``spec`` is malformed."""
    if not isinstance(spec, Sequence) or not spec or \
            not all(isinstance(d, dict) and isinstance(d.get("type"), str) for d in spec):
        raise ValueError("a model spec is a non-empty list of dicts, each with a 'type' string")
    layers = []
    for d in spec:
        cls = layer_class(d["type"])
        settings = {k: v for k, v in d.items() if k not in RESERVED}
        try:
            layers.append(cls.from_config(settings) if callable(getattr(cls, "from_config", None))
                          else cls(**settings))
        except TypeError as exc:
            raise ValueError(f"layer {d['type']!r} cannot be rebuilt from its settings "
                             f"{settings} ({exc}); a layer whose constructor does not take "
                             f"them defines config() and from_config()") from None
    n_in = spec[0].get("model_in_shape", spec[0].get("model_n_in", spec[0].get("n_in")))
    try:
        shape = as_shape(n_in)
    except (ValueError, TypeError):
        raise ValueError(f"the model spec gives no input shape ('model_n_in' or "
                         f"'model_in_shape'), got {n_in!r}") from None
    return Sequential(layers, shape, dtype)


def _model_path(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    return os.path.join(path, MODEL_FILE) if os.path.isdir(path) else path


def _unregistered(layers: Sequence[Layer]) -> list[type]:
    """The classes among ``layers`` (also in blocks) not registered under their name."""
    found: list[type] = []
    for layer in layers:
        cls = type(layer)
        if registered_layers().get(layer_name(cls)) is not cls and cls not in found:
            found.append(cls)
        inner = getattr(layer, "layers", None)
        if isinstance(inner, (list, tuple)) and all(isinstance(la, Layer) for la in inner):
            found += [c for c in _unregistered(inner) if c not in found]
    return found


def save(model: Sequential, path: str | os.PathLike, meta: dict | None = None, *,
         stacklevel: int = 2) -> str:
    """Write ``model`` atomically to ``path`` (a folder: ``model.npz`` in it); returns it. The archive
    (``np.savez``, no pickles) holds ``params`` ``(n_params,)`` and ``state`` ``(n_state,)`` (if any) in the
    model's dtype, ``dtype`` (``"float32"`` or ``"float64"``), and JSON ``spec`` (:meth:`Sequential.spec`) and
    ``meta`` (``meta``, else ``model.meta``). Raises ``ValueError`` (writing nothing) if they are not
    JSON-able; warns (``UserWarning``) for each layer class, also inside a block, that is not registered
    (:func:`mpidp.nn.register_layer`): :func:`load` could not rebuild it."""
    path = _model_path(path)
    meta = model.meta if meta is None else meta
    try:
        spec_json, meta_json = json.dumps(model.spec()), json.dumps(meta)
    except TypeError as exc:
        raise ValueError(f"cannot save the model to {path!r}: {exc} (a layer's config() and "
                         f"meta must be JSON-able)") from None
    extra = {"state": model.state} if model.n_state else {}
    write_atomic(path, lambda f: np.savez(f, params=model.params, spec=spec_json,
                                          dtype=str(model.dtype), meta=meta_json, **extra))
    for cls in _unregistered(model.layers):
        other = registered_layers().get(layer_name(cls))
        why = "so mpidp.nn.load cannot rebuild this file" if other is None else \
            f"and its name is registered to {_where(other)}, which mpidp.nn.load would build in its place"
        warnings.warn(f"{path}: layer class {cls.__name__!r} ({_where(cls)}) is not "
                      f"registered, {why}; register it with mpidp.nn.register_layer (decorate the class "
                      f"with @mpidp.nn.register_layer) where it is defined",
                      UserWarning, stacklevel=stacklevel)
    return path


def load(path: str | os.PathLike, check_finite: bool = True) -> Sequential:
    """The model :func:`save` wrote to ``path`` (a ``model.npz`` or a folder holding one), with its
    parameters, state and ``meta`` (``{}`` if none); a layer class of the user's own must be
    registered first. ``ValueError`` naming the file if it is missing, damaged, not a saved model,
    names an unregistered class, or (``check_finite``) holds NaN or Inf."""
    path = _model_path(path)
    check_place(path, "model file")
    try:
        kind = numpy_kind(path)
        if kind != ".npz":
            raise ValueError("not a .npz archive (" + ("a single .npy array)" if kind else
                             "nor any NumPy file: a text file, say)"))
        with np.load(path, allow_pickle=False) as saved:  # every member read in full: each CRC-32 checked
            if missing := [k for k in ("params", "spec", "dtype") if k not in saved.files]:
                raise ValueError(f"not a saved model: no {', '.join(map(repr, missing))} in the archive "
                                 f"(it holds {', '.join(map(repr, saved.files)) or 'nothing'})")
            saved = {k: saved[k] for k in saved.files}
        spec, dtype = json.loads(str(saved["spec"])), str(saved["dtype"])
        meta = json.loads(str(saved["meta"])) if "meta" in saved else {}
        if not isinstance(meta, dict):
            raise ValueError(f"meta is a {type(meta).__name__}, not a dict")
        model = from_spec(spec, dtype)
        for name, have in (("params", saved["params"]),
                           ("state", saved.get("state", np.zeros(0, model.dtype)))):
            into = getattr(model, name)  # an empty one may have any dtype
            if have.shape != into.shape or (into.size and have.dtype != model.dtype):
                raise ValueError(f"{name} is {have.dtype} {have.shape}, but the spec needs "
                                 f"{model.dtype} ({into.size},)")
            into[...] = have
        model.meta = meta
    except (OSError, KeyError, ValueError, TypeError, EOFError, RecursionError,
            zipfile.BadZipFile, zlib.error) as exc:  # a file damaged, truncated or foreign
        raise ValueError(f"{path!r}: cannot load a saved model ({type(exc).__name__}: {exc})") from None
    if check_finite and not (np.isfinite(model.params).all() and np.isfinite(model.state).all()):
        raise ValueError(f"{path!r}: the saved parameters contain NaN or Inf")
    return model
