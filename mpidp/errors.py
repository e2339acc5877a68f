"""The error mpidp raises for bad input or a failed job, and the test its count arguments
pass (no MPI here)."""

import numbers


class MpidpError(ValueError):
    """A problem with the input or the job, raised with the same message on every rank."""


def is_whole(value: object, low: int = 0) -> bool:
    """True when ``value`` is a whole number (a Python or NumPy integer, not a bool) of at
    least ``low``: what every count argument must be."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low
