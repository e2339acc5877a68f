"""The optimizer base over one flat parameter vector: its rate, where its vector lies in the
model, clipping, and updates in pieces; the rules (SGD, Adam, LARS ...) are in
:mod:`mpidp.nn.optimizers`, how to write one in ``docs/extending.md``.

Norms of whole tensors (LARS, LAMB, clipping by global norm) need :meth:`Optimizer.place`
where the vector is a slice of the model (its tensors, offset and ``reduce_sum``, a
collective); each update reduces its squared norms in ONE call (LAMB with ``clip_norm``
or ``track_grad_norm``: two). An optimizer never placed treats its vector as one tensor."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from ..errors import setting
from .schedules import Schedule, as_schedule

ReduceSum = Callable[[np.ndarray], np.ndarray]


def chunk_edges(n: int, chunks: int) -> list[int]:
    """``chunks + 1`` boundaries cutting ``range(n)`` into near-equal consecutive pieces."""
    chunks = max(1, min(int(chunks), n)) if n else 1
    return [n * k // chunks for k in range(chunks + 1)]


class Segments:
    """The tensors of a model's flat parameter vector: ``bounds`` ``(k + 1,)`` int64 (tensor
    ``j`` is ``[bounds[j], bounds[j + 1])``, ``bounds[0] = 0``), ``ndim`` ``(k,)`` their
    dimensions (1: a bias or a norm's scale, by default not adapted by LARS and LAMB)."""

    __slots__ = ("bounds", "ndim")

    def __init__(self, bounds: Sequence[int], ndim: Sequence[int] | None = None) -> None:
        b = np.asarray(bounds, np.int64)
        if b.ndim != 1 or len(b) < 1 or b[0] != 0 or np.any(np.diff(b) < 0):
            raise ValueError(f"segment bounds must rise from 0, got {np.asarray(bounds).tolist()}")
        d = np.full(len(b) - 1, 2, np.int64) if ndim is None else np.asarray(ndim, np.int64)
        if d.shape != (len(b) - 1,):
            raise ValueError(f"{len(b) - 1} segments need as many ndim values, got {d.size}")
        self.bounds, self.ndim = b, d

    @classmethod
    def of(cls, layers: Any) -> Segments:
        """One segment per parameter tensor of ``layers`` (or of a Sequential), in order."""
        shapes = [s for la in getattr(layers, "layers", layers) for s in la.param_shapes().values()]
        return cls(np.cumsum([0, *(int(np.prod(s)) for s in shapes)]), [len(s) for s in shapes])

    @classmethod
    def whole(cls, n: int) -> Segments:
        """The vector as one tensor (never left out of adaptation)."""
        return cls([0, int(n)], [2])

    @property
    def n(self) -> int:
        """The whole model's parameter count."""
        return int(self.bounds[-1])

    def __len__(self) -> int:
        return len(self.ndim)

    def __repr__(self) -> str:
        return f"Segments({len(self)} tensors, {self.n} parameters)"


def _clip_setting(what: str, value: float | None) -> float | None:
    if value is None:
        return None
    flag = isinstance(value, (bool, np.bool_))
    value = value if flag else float(value)
    if flag or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number > 0 (or None: no clipping), got {value}")
    return value


class Optimizer(ABC):
    """Base class: ``step_`` updates ``params`` in place from the global MEAN gradient; ``state``
    (momentum, Adam moments) holds flat arrays, so it checkpoints and shards like the parameters.

    ``lr``: a rate or a :class:`~mpidp.nn.schedules.Schedule` of the update count.
    ``weight_decay`` >= 0: L2 (added to the gradient) unless the subclass says otherwise.
    ``clip_norm``: the mean gradient is scaled down to this global L2 norm (over the whole model)
    when longer; ``clip_value``: each of its components clipped to ``[-clip_value, clip_value]``
    first. ``t``: updates taken (checkpointed). ``lr_scale``: a factor on every rate (1.0), not
    checkpointed. ``last_grad_norm``: the global norm of the last mean gradient before
    ``clip_norm`` where computed (``clip_norm``, ``track_grad_norm``, LARS), else None. A
    subclass implements ``_update`` (and ``_prepare``) for an elementwise rule, or
    ``_begin`` (norms, one reduction) and ``_apply`` (one piece, through ``_pieces``)."""

    #: True where the update needs each tensor's norms with the global one (:class:`LARS`)
    layer_norms = False

    def __init__(self, lr: float | Schedule, weight_decay: float = 0.0, *,
                 clip_norm: float | None = None, clip_value: float | None = None) -> None:
        self.lr = lr
        if not (weight_decay >= 0 and math.isfinite(weight_decay)):
            raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay}")
        self.weight_decay = float(weight_decay)
        self.clip_norm = _clip_setting("clip_norm", clip_norm)
        self.clip_value = _clip_setting("clip_value", clip_value)
        self.lr_scale = 1.0
        self.track_grad_norm = False
        self.last_grad_norm: float | None = None
        self.state: dict[str, np.ndarray] = {}
        self.t = 0  # number of steps taken
        self.segments: Segments | None = None
        self.offset = 0
        self.reduce_sum: ReduceSum | None = None
        self._now: float | None = None  # the rate of the update in progress

    @property
    def lr(self) -> float:
        """The rate of the update in progress (inside ``step_``), else of the next one."""
        return self._now if self._now is not None else self.lr_at(self.t)

    @lr.setter
    def lr(self, value: float | Schedule) -> None:
        self.schedule = as_schedule(value)
        self._now = None

    def lr_at(self, t: int) -> float:
        """The rate of update ``t`` (0: the first): ``schedule(t) * lr_scale``."""
        return self.schedule(t) * self.lr_scale

    def place(self, segments: Segments | None = None, offset: int = 0,
              reduce_sum: ReduceSum | None = None) -> Optimizer:
        """Where the vectors given to ``step_`` lie (module notes; no ``reduce_sum``: all on this rank)."""
        if offset < 0 or segments is not None and offset > segments.n:
            raise ValueError(f"offset {offset} is outside the model's "
                             f"{segments.n if segments else 0} parameters")
        self.segments, self.offset, self.reduce_sum = segments, int(offset), reduce_sum
        self._located = None
        return self

    def _locate(self, n: int) -> None:
        """Set ``_segs``, ``_local`` (tensor bounds within the vector) and ``_live``."""
        key = (n, id(self.segments), self.offset)
        if getattr(self, "_located", None) == key:
            return
        segs, offset = (self.segments, self.offset) if self.segments is not None else (Segments.whole(n), 0)
        if offset + n > segs.n:
            raise ValueError(f"the optimizer got {n} parameters at offset {offset} but its "
                             f"model has {segs.n}: place() it for this model")
        self._segs = segs
        self._local = np.clip(segs.bounds - offset, 0, n)
        self._live = np.flatnonzero(self._local[1:] > self._local[:-1]).tolist()
        self._located = key

    def _pieces(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """``(j, a, b)``: ``[a, b)`` is tensor ``j``'s part of ``[lo, hi)`` of the vector."""
        local = self._local
        for j in self._live:
            a, b = max(int(local[j]), lo), min(int(local[j + 1]), hi)
            if a < b:
                yield j, a, b

    def _squared_norms(self, *vectors: np.ndarray) -> np.ndarray:
        """float64 ``(len(vectors) * k,)``: at ``i * k + j`` the squared norm of tensor ``j``
        in ``vectors[i]``, this rank's parts summed in ONE ``reduce_sum`` call (in place)."""
        k, local = len(self._segs), self._local
        parts = np.zeros(len(vectors) * k, np.float64)
        for i, x in enumerate(vectors):
            for j in self._live:
                piece = x[local[j]:local[j + 1]]
                parts[i * k + j] = np.dot(piece, piece)
        if self.reduce_sum is not None:
            self.reduce_sum(parts)
        return parts

    def step_(self, params: np.ndarray, grad: np.ndarray, scale: float = 1.0, chunks: int = 1,
              on_chunk: Callable[[int, int], None] | None = None) -> None:
        """Update ``params`` (1-D) in place from the mean gradient ``scale * grad`` (``grad``, same shape, is
        overwritten); ``chunks > 1``: piece by piece (the same numbers), calling ``on_chunk(lo, hi)`` once
        ``params[lo:hi]`` is final. Collective over ``reduce_sum``'s ranks where norms are needed."""
        self._now, first = self._start(params)
        try:
            scale = self._begin(params, grad, self._clip_values(grad, scale), first)
            edges = chunk_edges(len(params), chunks)
            for lo, hi in zip(edges[:-1], edges[1:]):
                self._apply(params, grad, lo, hi, scale, first)
                if on_chunk is not None:
                    on_chunk(lo, hi)
        finally:
            self._now = None

    def refuses_pieces(self) -> str | None:
        """Why :meth:`update_in_pieces_` cannot be used, or None."""
        if self.clip_norm is not None:
            return f"{setting('clip_norm')} scales by the norm of the whole gradient"
        if self.track_grad_norm:
            return "tracking the gradient norm needs the whole gradient"
        if type(self)._begin is not Optimizer._begin or type(self)._apply is not Optimizer._apply:
            return f"{type(self).__name__} scales each tensor by norms of the whole tensor"
        return None

    def update_in_pieces_(self, params: np.ndarray,
                          scale: float = 1.0) -> Callable[[np.ndarray, int, int], None]:
        """Begin one update of ``params`` (1-D) applied as its gradient arrives: the returned ``apply(grad,
        lo, hi)`` updates ``params[lo:hi]`` from ``scale * grad[lo:hi]`` (overwritten); all values applied,
        the numbers are those of ``step_``. Counted, its rate fixed, here. Elementwise rules only."""
        if why := self.refuses_pieces():
            raise ValueError(f"this update cannot be applied in pieces: {why}")
        rate, first = self._start(params)
        self.last_grad_norm = None

        def apply(grad: np.ndarray, lo: int, hi: int) -> None:
            self._now = rate
            try:
                self._apply(params, grad, lo, hi, self._clip_values(grad[lo:hi], scale), first)
            finally:
                self._now = None
        return apply

    def _start(self, params: np.ndarray) -> tuple[float, bool]:
        """Count an update of ``params``: its rate, and whether it is a first step."""
        self._locate(len(params))
        self.t += 1
        return self.lr_at(self.t - 1), self._prepare(params)

    def _clip_values(self, g: np.ndarray, scale: float) -> float:
        """The scale left to apply: 1.0 after clipping ``g`` (scaled) in place, else ``scale``."""
        if self.clip_value is None:
            return scale
        if scale != 1.0:
            g *= scale
        np.clip(g, -self.clip_value, self.clip_value, out=g)
        return 1.0

    def _begin(self, params: np.ndarray, grad: np.ndarray, scale: float, first: bool) -> float:
        """The global norm (one reduction, with parameter norms where :attr:`layer_norms`), clipping folded
        into the returned ``scale``; sets each tensor's squared norms ``_g2`` (after clipping) and ``_w2``."""
        if not (self.clip_norm is not None or self.track_grad_norm or self.layer_norms):
            self.last_grad_norm = None
            return scale
        k = len(self._segs)
        parts = self._squared_norms(grad, params) if self.layer_norms else self._squared_norms(grad)
        g2 = parts[:k] * (scale * scale)
        self.last_grad_norm = norm = math.sqrt(float(g2.sum()))
        if self.clip_norm is not None and norm > self.clip_norm:
            factor = self.clip_norm / norm
            scale *= factor
            g2 *= factor * factor
        self._g2, self._w2 = g2, parts[k:]
        return scale

    def _apply(self, params: np.ndarray, grad: np.ndarray, lo: int, hi: int, scale: float,
               first: bool) -> None:
        """Update ``[lo, hi)`` of the vector (an elementwise rule: ``_update`` on the slices)."""
        state = {k: v[lo:hi] for k, v in self.state.items()}
        self._update(params[lo:hi], grad[lo:hi], state, scale, first)

    def _grad(self, params: np.ndarray, grad: np.ndarray, scale: float) -> np.ndarray:
        """``scale * grad + wd * params``, computed in ``grad``'s own buffer."""
        if scale != 1.0:
            grad *= scale
        if self.weight_decay:
            grad += self.weight_decay * params
        return grad

    def _prepare(self, params: np.ndarray) -> bool:
        """Allocate missing state for ``params``; True if it was missing (a first step)."""
        return False

    @abstractmethod
    def _update(self, params: np.ndarray, grad: np.ndarray, state: dict[str, np.ndarray],
                scale: float, first: bool) -> None:
        """Apply this step to one piece: ``params``, ``grad`` and ``state`` are matching slices."""
