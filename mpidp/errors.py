"""The error mpidp raises for bad input or a failed job, how its messages name a setting,
and the test its count arguments pass (no MPI here)."""

import contextlib
import numbers
from collections.abc import Callable, Iterator
from typing import Any


class MpidpError(ValueError):
    """A problem with the input or the job, raised with the same message on every rank."""


def keyword(name: str, *value: Any) -> str:
    """A setting as a library call names it: ``bucket_bytes`` or ``bucket_bytes=1048576``."""
    return name + "".join(f"={v!r}" for v in value)


_spell: list[Callable[..., str]] = [keyword]


def setting(name: str, *value: Any) -> str:
    """How a message below the command line names the setting ``name`` (with ``value``): its
    keyword (``finish='forward'``), or as the front end running the code spells it (a flag)."""
    return _spell[-1](name, *value)


@contextlib.contextmanager
def spelled(spell: Callable[..., str]) -> Iterator[None]:
    """Within the block, :func:`setting` names settings with ``spell(name, *value)``."""
    _spell.append(spell)
    try:
        yield
    finally:
        _spell.remove(spell)


def is_whole(value: object, low: int = 0) -> bool:
    """True when ``value`` is a whole number (Python or NumPy integer, not a bool) >= ``low``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= low
