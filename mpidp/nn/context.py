"""What a layer may know of the step it runs in, without importing MPI.

A :class:`Context` is shared by every layer of a :class:`mpidp.nn.Sequential`
(``model.context``, also ``layer.context``); the trainer fills it before each forward
pass. On one process ``reduce_sum`` is the identity, so a layer written against it
(:class:`mpidp.nn.BatchNorm`) gives the same numbers at any number of ranks.
"""

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
        raise ValueError(f"index must hold the global positions of the batch's rows, whole "
                         f"numbers >= 0 in one dimension; got {a.dtype} of shape {a.shape} "
                         f"starting {shown}")
    return a.astype(np.int64)


@dataclass
class Context:
    """The step a model's forward and backward passes belong to.

    Attributes
    ----------
    training : True in a training step (dropout drops, batch norm uses batch statistics
        and updates its running ones); False for evaluation and prediction.
    seed : the run's seed; randomness inside layers (dropout) derives from it.
    epoch : the epoch of the current step (0-based).
    step : the global step (0 for the first step of a run; it continues across a resume).
    index : ``(n,)`` int64, the global position in the training set of each row of the
        batch, or None when the caller did not say (a layer that needs it raises).
    reduce_sum : sums a float array over the replica group in place and returns it (a
        collective: the same calls on every rank of the group, in the same order).
    group_size : number of ranks ``reduce_sum`` sums over (1 on one process).
    grads_final : ``grads_final(self)`` in a layer's ``backward`` says its gradients are
        final, so they can be sent meanwhile; ``grads_final(self, done)``: their first
        ``done`` values so far. Set by :meth:`mpidp.nn.Sequential.backward` (a call from a
        layer nested in a block is ignored).
    grads_piece : gradient values to announce at a time (0: whole layers).
    params_ready : ``params_ready(self, upto)`` returns once the first ``upto`` values of
        the layer's parameters (None: all) are final; set by ``Sequential.forward``.
    params_piece : values per part in which a layer may read its parameters (0: whole).
    """

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
