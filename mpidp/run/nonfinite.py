"""The NaN/Inf policy, one place for every mode: what happens when a step's global loss or
gradient is not finite. ``stop`` raises :class:`NonFiniteError` on every rank before the
update; ``skip`` drops the update and counts the step; ``ignore`` applies it (unchecked).
Every trainer reaches one verdict that all ranks share, then calls :meth:`Policy.apply`."""

from __future__ import annotations

import math

import numpy as np

from ..errors import MpidpError, setting

ON_NONFINITE = ("stop", "skip", "ignore")


def all_finite(values: np.ndarray) -> bool:
    """True iff no element of 1-D ``values`` is NaN or infinite: one BLAS dot product (NaN and
    Inf reach it), checked element by element only when that overflows."""
    with np.errstate(over="ignore", invalid="ignore"):
        return math.isfinite(float(np.dot(values, values))) or bool(np.isfinite(values).all())


class NonFiniteError(MpidpError):
    """The global loss or gradient of a step is NaN or Inf (raised on every rank)."""


class Policy:
    """The ``on_nonfinite`` policy and its count of skipped steps."""

    def __init__(self, mode: str = "stop") -> None:
        if mode not in ON_NONFINITE:
            raise ValueError(f"unknown on_nonfinite {mode!r}; expected one of {ON_NONFINITE}")
        self.mode, self.skipped = mode, 0

    @property
    def checks(self) -> bool:
        """False for ``ignore``: the check is not even computed."""
        return self.mode != "ignore"

    def apply(self, finite: bool, loss_sum: float, step: int, steps: int = 1,
              params: np.ndarray | None = None) -> bool:
        """Given a verdict every rank shares: True to go ahead with the update, False to skip
        it (``skip``, counting ``steps`` skipped steps); raises :class:`NonFiniteError` for
        ``stop`` (``params``: the parameters, read only then, to say whether an earlier
        update already overflowed)."""
        if finite or self.mode == "ignore":
            return True
        if self.mode == "skip":
            self.skipped += int(steps)
            return False
        raise self.error(loss_sum, step, params)

    @staticmethod
    def error(loss_sum: float, step: int, params: np.ndarray | None = None) -> NonFiniteError:
        what = f"non-finite loss or gradient at step {step} (global loss sum {float(loss_sum)})"
        if params is not None and not all_finite(params):
            return NonFiniteError(
                f"{what}: the parameters are not finite, so an earlier update overflowed; "
                f"{overflow_advice()}")
        return NonFiniteError(
            f"{what}; stopped before the update, so the parameters and checkpoints are from "
            f"the last good step. Lower the learning rate, check the data, or skip such steps "
            f"({setting('on_nonfinite', 'skip')})")


def overflow_advice(newest: str | None = "") -> str:
    """What a user can do when an update made the parameters NaN or Inf, and which
    checkpoint is good (none of non-finite parameters is written): ``newest``, the newest
    checkpoint's name, None when there is none, empty when not known."""
    kept = ("no checkpoint holds non-finite parameters" if newest == "" else
            f"the newest checkpoint, {newest}, is good to resume from" if newest else
            "no checkpoint was written before it")
    return f"{kept}. Lower {setting('lr')} or {setting('weight_decay')}"
