"""Exported names whose modules are imported on first use, so importing a package starts no MPI."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable


def exports(package: str, names: dict[str, str | None]) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: ``names`` maps an exported name to the module
    that defines it, relative to ``package`` (``".data_parallel"``, ``"..run.stats"``), or to a
    module whose last name is the exported name (None: the submodule of that name)."""

    def __getattr__(name: str):
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        where = names[name]
        target = importlib.import_module(where or f".{name}", package)
        value = target if where is None or where.endswith(f".{name}") else getattr(target, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return __getattr__, __dir__
