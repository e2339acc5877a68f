"""What a layer may know of the step it runs in, without importing MPI: a :class:`Context`
shared by every layer of a :class:`mpidp.nn.Sequential` (``model.context``, also
``layer.context``), filled by the trainer before each forward pass."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


def _identity(a: np.ndarray) -> np.ndarray:
    return a


def _unheard(layer: object, done: int | None = None) -> None:
    return None


def positions(index) -> np.ndarray:
    """``index`` as a context's ``(n,)`` int64 positions; ``ValueError`` unless it is one
    dimension of whole numbers >= 0 (a negative or fractional position names no sample)."""
    a = np.asarray(index)
    whole = a.dtype.kind in "iu" or a.dtype.kind == "f" and bool(np.all(np.isfinite(a) & (a == np.floor(a))))
    if a.ndim != 1 or not whole or (a.size and a.min() < 0):
        shown = np.array2string(a.ravel()[:5], separator=", ")
        raise ValueError(f"index must hold the global positions of the batch's rows, whole numbers >= 0 "
                         f"in one dimension; got {a.dtype} of shape {a.shape} starting {shown}")
    return a.astype(np.int64)


@dataclass
class Context:
    """The step a model's forward and backward passes belong to. ``training``: True in a
    training step, False for evaluation. ``seed``: the run's seed. ``epoch`` (0-based);
    ``step``: the global update count (0 first, continued on resume). ``index``: ``(n,)`` int64
    global training-set position of each batch row, or None. ``reduce_sum``: sums a float array
    in place over the replica group and returns it (a collective; the identity on one process);
    ``group_size``: the ranks it sums over (1 on one process).

    Set by :class:`mpidp.nn.Sequential` during a pass: ``grads_final(layer[, done])``: the
    layer's gradients (their first ``done`` values) are final, and ``grads_piece`` values
    to announce at a time; ``params_ready(layer, upto)`` returns once the first ``upto``
    (None: all) of its parameters are final, read in parts of ``params_piece`` (0: whole)."""

    training: bool = False
    seed: int = 0
    epoch: int = 0
    step: int = 0
    index: np.ndarray | None = None
    reduce_sum: Callable[[np.ndarray], np.ndarray] = _identity
    group_size: int = 1
    grads_final: Callable[..., None] = _unheard
    grads_piece: int = 0
    params_ready: Callable[..., None] = _unheard
    params_piece: int = 0

    def sample_index(self, n: int, who: str) -> np.ndarray:
        """The batch's global sample indices ``(n,)``; raises ``ValueError`` naming ``who``
        when they were not given or do not match the batch."""
        if self.index is None:
            raise ValueError(f"{who} needs the global index of every sample of a training "
                             f"batch: train with mpidp.fit, or pass index= to the trainer's "
                             f"step (model.context.index for a loop of your own)")
        if len(self.index) != n:
            raise ValueError(f"{who}: the batch has {n} samples but model.context.index "
                             f"holds {len(self.index)}")
        return self.index
