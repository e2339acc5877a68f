"""Token embeddings: integer ids -> rows of a trained table."""

from __future__ import annotations

import numpy as np

from ..errors import is_whole, setting
from .layers import Layer, Shapes, init_weights, register_layer

_INITS = ("normal", "xavier", "zeros")


@register_layer
class Embedding(Layer):
    """Looks up ``W[id]`` for every token id: ``(n, *s)`` ids -> ``(n, *s, dim)``; ids are
    whole numbers in ``[0, n_tokens)`` (see ``docs/models.md``). ``W`` ``(n_tokens, dim)``:
    ``init`` ``"normal"`` N(0, 1), ``"xavier"`` or ``"zeros"``. ``backward`` returns **no
    input gradient** (None): it reads the data set's ids, so it must be a model's first layer."""

    reads = "token ids"

    def __init__(self, n_tokens: int, dim: int, init: str = "normal") -> None:
        super().__init__()
        for what, v in (("n_tokens", n_tokens), ("dim", dim)):
            if not is_whole(v, 1):
                raise ValueError(f"Embedding needs {what} >= 1 (an int), got {v!r}")
        self.n_tokens, self.dim = int(n_tokens), int(dim)
        if init not in _INITS:
            raise ValueError(f"unknown Embedding init {init!r}; expected one of {_INITS}")
        self.init = init

    def config(self) -> dict:
        return {"n_tokens": self.n_tokens, "dim": self.dim, "init": self.init}

    def output_dim(self, n_in: int) -> int:
        raise ValueError(f"Embedding maps each id to {self.dim} values: its output is not flat "
                         f"features (use output_shape)")

    def output_shape(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*tuple(in_shape), self.dim)

    def param_shapes(self) -> Shapes:
        return {"W": (self.n_tokens, self.dim)}

    def init_(self, rng: np.random.Generator) -> None:
        init_weights(self.params["W"], self.init, self.n_tokens, self.dim, rng)

    def token_ids(self, x: np.ndarray) -> np.ndarray:
        """``x`` as ``intp`` ids, checked to be whole numbers in ``[0, n_tokens)``."""
        x = np.asarray(x)
        if x.dtype.kind not in "iuf":
            raise ValueError(f"Embedding takes token ids as an integer or float array, got dtype {x.dtype}")
        ok = (x >= 0) & (x < self.n_tokens)
        if x.dtype.kind == "f":
            # whole numbers above it are not all held: an id of exactly 2**24 in float32 may
            # be 2**24 + 1 rounded, so it is refused too
            exact = 2 ** (np.finfo(x.dtype).nmant + 1)
            ok &= x == np.floor(x)
            if self.n_tokens > exact and (x >= exact).any():
                raise ValueError(f"Embedding({self.n_tokens}, {self.dim}): token ids above "
                                 f"2**{np.finfo(x.dtype).nmant + 1} in {x.dtype}, which cannot "
                                 f"hold every whole number there, so neighbouring ids merge: "
                                 f"use {setting('dtype', 'float64')}")
        if not ok.all():
            at = tuple(int(i) for i in np.unravel_index(int(np.argmin(ok)), x.shape))
            raise ValueError(f"Embedding({self.n_tokens}, {self.dim}): token id {x[at].item()!r} "
                             f"at batch position {at} is not a whole number in "
                             f"[0, {self.n_tokens}); {int(ok.size - ok.sum())} such value(s)")
        return x.astype(np.intp)

    def forward(self, x: np.ndarray) -> np.ndarray:
        self._ids = ids = self.token_ids(x)
        return np.take(self.params["W"], ids, axis=0)

    def backward(self, dy: np.ndarray, accumulate: bool = False,
                 need_input_grad: bool = True) -> np.ndarray | None:
        dW, d = self.grads["W"], self.dim
        if not accumulate:
            dW[...] = 0
        ids = self._ids.reshape(-1)
        if ids.size:
            # bincount over the used rows only: faster than np.add.at, less memory
            used, row = np.unique(ids, return_inverse=True)
            flat = (row.reshape(-1, 1) * d + np.arange(d)).reshape(-1)
            sums = np.bincount(flat, weights=dy.reshape(-1), minlength=len(used) * d)
            dW[used] += sums.reshape(len(used), d)
        return None

    def __repr__(self) -> str:
        return f"Embedding({self.n_tokens}, {self.dim})"
