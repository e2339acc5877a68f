"""The flat buffer every synchronous trainer reduces, named once:
``gradients (n_params) | loss sum | sample count | correct predictions``.

Gradients are SUMS over the local samples (not means), so summing the buffer over ranks
and dividing by the global count gives the single-process gradient for any split.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

EXTRAS = ("loss_sum", "count", "correct")
N_EXTRA = len(EXTRAS)


def new(n_params: int, dtype: npt.DTypeLike) -> np.ndarray:
    """A zeroed buffer ``(n_params + N_EXTRA,)`` of ``dtype``."""
    return np.zeros(n_params + N_EXTRA, dtype)


def totals(buf: np.ndarray, n_params: int) -> tuple[float, int, int]:
    """``(loss_sum, count, correct)`` from the slots after the gradients."""
    loss, count, correct = (float(v) for v in buf[n_params:n_params + N_EXTRA])
    return loss, int(round(count)), int(round(correct))
