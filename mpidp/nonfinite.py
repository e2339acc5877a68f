"""The NaN/Inf test that the synchronisation strategies apply to reduced gradients."""

from __future__ import annotations

import math

import numpy as np


def all_finite(values: np.ndarray) -> bool:
    """True iff no element of 1-D ``values`` is NaN or infinite.

    One BLAS dot product (a memory-speed pass; NaN and Inf reach the result). Squares of
    finite values beyond ~1.8e19 (float32) overflow it too, so only then is every element
    checked one by one.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        return math.isfinite(float(np.dot(values, values))) or bool(np.isfinite(values).all())
