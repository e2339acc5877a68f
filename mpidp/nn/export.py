"""A trained model as an ONNX graph (:func:`export_onnx`) or as named tensors in a safetensors
file (:func:`export_safetensors`); the ``onnx`` and ``safetensors`` packages (the ``export`` extra)
are imported only when a file is written. Every parameter and state array is named ``"<i>.<name>"``
(``"0.W"``, ``"2.mean"``; inside a :class:`~mpidp.nn.Residual` ``"3.0.W"``), in both formats; the
ONNX graph maps ``x`` ``(batch, *in_shape)`` to ``scores``, as ``predict`` in evaluation mode
(``docs/models.md``)."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..atomic import write_atomic
from .activations import _GELU_A, _GELU_C, GELU, LeakyReLU, ReLU, Sigmoid, Softmax, Tanh
from .blocks import Residual
from .conv import _ConvNd, tap
from .dropout import Dropout
from .embedding import Embedding
from .layers import Dense, Layer
from .model import Sequential, chain_shapes
from .norm import BatchNorm, LayerNorm
from .pool import AvgPool, GlobalAvgPool, MaxPool
from .reshape import Flatten, Reshape
from .sparse import SparseDense
from .standardize import Standardize

#: The ONNX operator set the graphs are written for (the default domain).
OPSET = 17
EXTRA_HINT = "install the export extra: pip install 'mpidp[export]'"


class ExportError(ValueError):
    """A model that cannot be exported: one line naming the layer and the reason."""


def need_extra(module: str):
    """Import ``module`` (onnx, safetensors.numpy); ImportError naming the extra if absent."""
    try:
        return __import__(module, fromlist=["_"])
    except ImportError:
        raise ImportError(f"exporting needs the {module.split('.')[0]} package: {EXTRA_HINT}") from None


class OnnxGraph:
    """The graph an exporter adds its layer to: ``op`` adds a node, ``const`` an
    initializer; ``name`` is the layer's name (``"3"``, ``"3.0"``), ``dtype`` the model's."""

    def __init__(self, dtype: np.dtype) -> None:
        self.dtype, self.nodes, self.inits, self.name = np.dtype(dtype), [], [], ""
        self._count = 0

    def fresh(self, hint: str) -> str:
        """A new value name, ``<layer>/<hint>_<k>``."""
        self._count += 1
        return f"{self.name}/{hint}_{self._count}"

    def const(self, value: Any, name: str | None = None, dtype: Any = None) -> str:
        """An initializer holding ``value`` (in the model's dtype unless ``dtype``);
        ``name`` (below the layer's name) for a parameter or state, else a fresh name."""
        from onnx import numpy_helper
        full = f"{self.name}.{name}" if name else self.fresh("const")
        arr = np.ascontiguousarray(np.asarray(value, self.dtype if dtype is None else dtype))
        self.inits.append(numpy_helper.from_array(arr, full))
        return full

    def op(self, op_type: str, *inputs: str, **attrs: Any) -> str:
        """Add node ``op_type`` on ``inputs`` with ``attrs``; returns its output's name."""
        from onnx import helper
        out = self.fresh(op_type)
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def ints(self, values) -> str:
        """An int64 initializer (shapes, axes, slice bounds)."""
        return self.const(list(values), dtype=np.int64)


#: ``fn(graph, layer, x, in_shape) -> output name``: how a layer class is written to ONNX.
Exporter = Callable[[OnnxGraph, Layer, str, tuple[int, ...]], str]
_EXPORTERS: dict[type, Exporter] = {}
_REFUSED: dict[type, str] = {SparseDense: "it takes sparse (CSR) input, which ONNX cannot "
                                          "express as a dense tensor"}


def register_exporter(cls: type, fn: Exporter | None = None):
    """Register ``fn(graph, layer, x, in_shape) -> y`` as the ONNX exporter of layer class
    ``cls`` (subclasses included unless they have their own); usable as a decorator,
    ``@register_exporter(MyLayer)``. ``graph`` is an :class:`OnnxGraph`, ``x`` the name of
    the layer's input ``(batch, *in_shape)``, and the returned name its output."""
    def add(f: Exporter) -> Exporter:
        _EXPORTERS[cls] = f
        return f
    return add if fn is None else add(fn)


def _exporter(layer: Layer) -> Exporter | str:
    """The exporter of ``layer``'s class (its nearest registered base), or why there is none."""
    for cls in type(layer).__mro__:
        if cls in _REFUSED:
            return _REFUSED[cls]
        if cls in _EXPORTERS:
            return _EXPORTERS[cls]
    return ("no ONNX exporter is registered for its class; register one with "
            "mpidp.nn.register_exporter (see docs/extending.md)")


def _layers(g: OnnxGraph, layers, x: str, shapes, prefix: str = "") -> str:
    for i, layer in enumerate(layers):
        fn = _exporter(layer)
        if isinstance(fn, str):
            raise ExportError(f"cannot export layer {prefix}{i} ({layer!r}) to ONNX: {fn}")
        g.name = f"{prefix}{i}"
        x = fn(g, layer, x, tuple(shapes[i]))
    return x


def onnx_model(model: Sequential):
    """The ``onnx.ModelProto`` of ``model`` (see the module's note), checked by
    ``onnx.checker``. Raises :class:`ExportError` naming the first layer that cannot be
    exported, ImportError (naming the extra) without the onnx package."""
    onnx = need_extra("onnx")
    from onnx import helper
    g = OnnxGraph(model.dtype)
    y = _layers(g, model.layers, "x", model.shapes)
    kind = helper.np_dtype_to_tensor_dtype(model.dtype)
    graph = helper.make_graph(
        g.nodes + [helper.make_node("Identity", [y], ["scores"], name="scores")], "mpidp",
        [helper.make_tensor_value_info("x", kind, ["batch", *model.in_shape])],
        [helper.make_tensor_value_info("scores", kind, ["batch", *model.out_shape])], g.inits)
    out = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="mpidp")
    out.ir_version = min(out.ir_version, 8)  # readable by older runtimes too
    helper.set_model_props(out, {"mpidp.spec": json.dumps(model.spec()), "mpidp.dtype": str(model.dtype)})
    onnx.checker.check_model(out, full_check=True)
    return out


def export_onnx(model: Sequential, path: str | os.PathLike) -> str:
    """Write ``model`` as an ONNX graph (opset :data:`OPSET`) to ``path``, atomically;
    returns the path. Nothing is written when it raises (see :func:`onnx_model`)."""
    return _write(path, onnx_model(model).SerializeToString())


def _write(path: str | os.PathLike, data: bytes) -> str:
    path = os.fspath(path)
    write_atomic(path, lambda f: f.write(data))
    return path


def tensors(model: Sequential) -> dict[str, np.ndarray]:
    """Every parameter and state array of ``model`` by name (``"0.W"``, ``"2.mean"``, ...:
    see the module's note), as contiguous copies in layer order (a block's: ``"j.name"``)."""
    return {f"{i}.{k}": np.ascontiguousarray(v) for i, layer in enumerate(model.layers)
            for which in (layer.params, layer.state) for k, v in which.items()}


def export_safetensors(model: Sequential, path: str | os.PathLike) -> str:
    """Write :func:`tensors` of ``model`` to ``path`` (safetensors, atomically), with the
    metadata ``format`` ``"mpidp"``, ``dtype`` and ``spec`` (the JSON layer list of
    ``model.npz``); returns the path. ImportError naming the extra without safetensors."""
    st = need_extra("safetensors.numpy")
    return _write(path, st.save(tensors(model), metadata={
        "format": "mpidp", "dtype": str(model.dtype), "spec": json.dumps(model.spec())}))


# ---------------------------------------------------------------------------- exporters


def _single(op_type: str, **attrs: Any) -> Exporter:
    return lambda g, layer, x, shape: g.op(op_type, x, **attrs)


for _cls, _op, _attrs in ((ReLU, "Relu", {}), (Tanh, "Tanh", {}), (Sigmoid, "Sigmoid", {}),
                          (Dropout, "Identity", {}), (Flatten, "Flatten", {"axis": 1}),
                          (Softmax, "Softmax", {"axis": -1})):
    register_exporter(_cls, _single(_op, **_attrs))


@register_exporter(Reshape)
def _reshape(g, layer, x, shape):
    return g.op("Reshape", x, g.ints([0, *layer.output_shape(shape)]))  # 0: the batch as is


@register_exporter(LeakyReLU)
def _leaky(g, layer, x, shape):  # as mpidp computes it, the slope in the model's dtype
    return g.op("Where", g.op("Greater", x, g.const(0)), x, g.op("Mul", x, g.const(layer.slope)))


@register_exporter(GELU)
def _gelu(g, layer, x, shape):  # the tanh form, in mpidp's order of operations
    u = g.op("Mul", g.op("Mul", g.op("Add", g.op("Mul", g.op("Mul", x, x), g.const(_GELU_A)),
                                    g.const(1)), x), g.const(_GELU_C))
    return g.op("Mul", g.op("Mul", g.op("Add", g.op("Tanh", u), g.const(1)), x), g.const(0.5))


@register_exporter(Dense)
def _dense(g, layer, x, shape):
    return g.op("Gemm", x, g.const(layer.params["W"], "W"), g.const(layer.params["b"], "b"))


@register_exporter(Embedding)
def _embedding(g, layer, x, shape):
    return g.op("Gather", g.const(layer.params["W"], "W"), g.op("Cast", x, to=7), axis=0)  # ids: int64


@register_exporter(Standardize)
def _standardize(g, layer, x, shape):
    return g.op("Div", g.op("Sub", x, g.const(layer.state["mean"], "mean")),
                g.const(layer.state["std"], "std"))


@register_exporter(BatchNorm)
def _batchnorm(g, layer, x, shape):
    """Evaluation form from the running statistics, in mpidp's order: ``x * scale +
    (beta - mean * scale)``, ``scale = gamma / sqrt(var + eps)`` (eps in the model's dtype)."""
    b = (len(shape) - 1) * [1]
    as_b = lambda a, k: g.const(a.reshape(-1, *b), k)  # noqa: E731 - channel vector as (C, 1, ..)
    inv = g.op("Div", g.const(1), g.op("Sqrt", g.op("Add", as_b(layer.state["var"], "var"),
                                                     g.const(layer.eps))))
    scale = g.op("Mul", as_b(layer.params["gamma"], "gamma"), inv)
    shift = g.op("Sub", as_b(layer.params["beta"], "beta"),
                 g.op("Mul", as_b(layer.state["mean"], "mean"), scale))
    return g.op("Add", g.op("Mul", x, scale), shift)


@register_exporter(LayerNorm)
def _layernorm(g, layer, x, shape):
    axes = list(range(1, len(shape) + 1))
    xc = g.op("Sub", x, g.op("ReduceMean", x, axes=axes, keepdims=1))
    var = g.op("ReduceMean", g.op("Mul", xc, xc), axes=axes, keepdims=1)
    inv = g.op("Div", g.const(1), g.op("Sqrt", g.op("Add", var, g.const(layer.eps))))
    y = g.op("Mul", g.op("Mul", xc, inv), g.const(layer.params["gamma"], "gamma"))
    return g.op("Add", y, g.const(layer.params["beta"], "beta"))


@register_exporter(GlobalAvgPool)
def _global_avg(g, layer, x, shape):
    return g.op("ReduceMean", x, axes=list(range(2, len(shape) + 1)), keepdims=0)


def _taps(g: OnnxGraph, x: str, kernel, stride, out):
    """One Slice of ``x`` ``(n, C, *spatial)`` per window offset (row-major): the input
    value every output position reads there, ``(n, C, *out)``."""
    axes = g.ints(range(2, 2 + len(kernel)))
    for offset in itertools.product(*map(range, kernel)):
        sl = tap(offset, stride, out)
        yield g.op("Slice", x, g.ints(s.start for s in sl), g.ints(s.stop for s in sl), axes, g.ints(stride))


@register_exporter(MaxPool)
def _maxpool(g, layer, x, shape):
    size, stride, _ = layer._geometry((1, *shape), batch=True)  # noqa: SLF001
    return g.op("MaxPool", x, kernel_shape=list(size), strides=list(stride))


@register_exporter(AvgPool)
def _avgpool(g, layer, x, shape):
    size, stride, out = layer._geometry((1, *shape), batch=True)  # noqa: SLF001
    if g.dtype == np.float32:
        return g.op("AveragePool", x, kernel_shape=list(size), strides=list(stride))
    # float64: onnxruntime has no AveragePool for it; the sum over window offsets instead
    total = g.op("Sum", *_taps(g, x, size, stride, out))
    return g.op("Mul", total, g.const(1.0 / int(np.prod(size))))


@register_exporter(_ConvNd)
def _conv(g, layer, x, shape):
    W, b, nd = layer.params["W"], layer.params["b"], layer.nd
    if g.dtype == np.float32:
        pads = list(layer.padding) * 2
        return g.op("Conv", x, g.const(W, "W"), g.const(b, "b"), kernel_shape=list(layer.kernel),
                    strides=list(layer.stride), pads=pads)
    # float64: onnxruntime has no Conv for it; im2col by one Slice per kernel offset, then
    # one MatMul, as mpidp computes it: cols (n, *out, K*C) @ W (K*C, F)
    if any(layer.padding):
        x = g.op("Pad", x, g.ints([0, 0, *layer.padding, 0, 0, *layer.padding]))
    out = layer.output_shape(shape)[1:]
    cols = g.op("Concat", *_taps(g, x, layer.kernel, layer.stride, out), axis=1)
    cols = g.op("Transpose", cols, perm=[0, *range(2, 2 + nd), 1])
    F = layer.out_channels
    w = g.const(np.moveaxis(W, 1, -1).reshape(F, -1).T, "W")  # rows (offset, channel)
    y = g.op("Transpose", g.op("MatMul", cols, w), perm=[0, nd + 1, *range(1, nd + 1)])
    return g.op("Add", y, g.const(b.reshape(F, *[1] * nd), "b"))


@register_exporter(Residual)
def _residual(g, layer, x, shape):
    name = g.name
    h = _layers(g, layer.layers, x, chain_shapes(layer.layers, shape), prefix=f"{name}.")
    g.name = name
    return g.op("Add", x, h)
