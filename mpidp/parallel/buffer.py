"""The flat buffer every synchronous trainer reduces:
``gradients (n_params) | loss sum | sample count | correct predictions | stop | early``.
Gradients are SUMS over the local samples; ``stop`` is 1 on a rank that asks to stop;
``early`` 1 on a rank whose periodic synchronisation comes early for an epoch's end.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

EXTRAS = ("loss_sum", "count", "correct", "stop", "early")
N_EXTRA = len(EXTRAS)
STOP = EXTRAS.index("stop")
EARLY = EXTRAS.index("early")


def new(n_params: int, dtype: npt.DTypeLike, length: int | None = None) -> np.ndarray:
    """A zeroed buffer ``(n_params + N_EXTRA,)`` of ``dtype`` (``(length,)`` when given,
    e.g. padded to equal blocks)."""
    return np.zeros(n_params + N_EXTRA if length is None else length, dtype)


def put(buf: np.ndarray, n_params: int, loss_sum: float, count: int, correct: int,
        stop: bool, add: bool = False) -> None:
    """Write this rank's extras after the gradients (``add``: add the loss and counts to
    those there; the early mark is cleared)."""
    extras = buf[n_params:n_params + STOP]
    if add:
        extras += (loss_sum, count, correct)
    else:
        extras[...] = (loss_sum, count, correct)
    buf[n_params + STOP] = float(bool(stop))
    buf[n_params + EARLY] = 0.0


def mark_early(buf: np.ndarray, n_params: int, early: bool) -> None:
    """Say whether this rank's synchronisation now comes early (see the module's notes)."""
    buf[n_params + EARLY] = float(bool(early))


def early_ranks(buf: np.ndarray, n_params: int) -> int:
    """How many ranks marked the (reduced) buffer's synchronisation early."""
    return int(round(float(buf[n_params + EARLY])))


def totals(buf: np.ndarray, n_params: int) -> tuple[float, int, int]:
    """``(loss_sum, count, correct)`` from the slots after the gradients."""
    loss, count, correct = (float(v) for v in buf[n_params:n_params + STOP])
    return loss, int(round(count)), int(round(correct))


def stopping(buf: np.ndarray, n_params: int) -> bool:
    """True when the (reduced) stop slot says some rank asked to stop."""
    return bool(buf[n_params + STOP] > 0)
