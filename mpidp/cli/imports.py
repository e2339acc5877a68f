"""``--import MODULE``: a user's module, imported before any model is built or loaded, so
that the layer classes it registers (:func:`mpidp.nn.register_layer`) can be named in a
model file and rebuilt from a ``model.npz``. No MPI here."""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from ..atomic import check_place, special
from ..nn import registered_layers

HINT = "pass the module that registers it with --import MODULE"


def near(name: str) -> str:
    """`` (did you mean 'Dense'?)`` when ``name`` looks like a mistyped registered layer
    name, else empty."""
    known = {k.lower(): k for k in registered_layers()}
    close = difflib.get_close_matches(str(name).lower(), known, 1, cutoff=0.8)
    return f" (did you mean {known[close[0]]!r}?)" if close else ""


def imports_of(args: argparse.Namespace) -> list[str]:
    """The modules ``--import`` names in ``args``, in order, each once."""
    return list(dict.fromkeys(vars(args).get("import") or ()))


def import_modules(names: Sequence[str]) -> list[ModuleType]:
    """Import every module of ``names``: a dotted name importable from ``sys.path`` or the
    current folder, or a path to a ``.py`` file. ValueError naming the first one that
    cannot be imported, and why, in one line."""
    if os.getcwd() not in sys.path and "" not in sys.path:  # the mpidp script: cwd not there
        sys.path.append(os.getcwd())
    out = []
    for name in names:
        path = os.path.abspath(name) if _is_path(name) else None
        if path is not None:
            check_place(path, "--import")
        if path is not None and not os.path.isfile(path):
            raise ValueError(f"--import {name}: cannot import it (no such file)")
        try:
            out.append(importlib.import_module(name) if path is None else _from_file(path))
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's code: any failure
            text = (str(exc).strip().splitlines() or [""])[0]
            reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
            raise ValueError(f"--import {name}: cannot import it ({reason})") from None
    return out


def absolute_paths(names: Sequence[str]) -> list[str]:
    """``names`` with each ``.py`` path made absolute (dotted names as given), so that a
    recorded run imports the same files from another folder."""
    return [os.path.abspath(n) if _is_path(n) else n for n in names]


def _is_path(name: str) -> bool:
    return name.endswith(".py") or "/" in name or os.sep in name


def _from_file(path: str) -> ModuleType:
    """The module in file ``path``, imported under its file name (a private name when that
    one is taken by another module)."""
    stem = os.path.splitext(os.path.basename(path))[0]
    module_name = stem if stem.isidentifier() else "_" + re.sub(r"\W", "_", stem)
    have = sys.modules.get(module_name)
    if have is not None:
        where = getattr(have, "__file__", None)
        if where and os.path.exists(where) and os.path.samefile(where, path):
            return have
        module_name = f"_mpidp_import_{module_name}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError("not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def unregistered(spec) -> list[str]:
    """The layer class names in ``spec`` (a model spec or model file's layers, blocks'
    inner layers included) that no imported module has registered."""
    known, out, todo = registered_layers(), [], [spec]
    while todo:
        node = todo.pop(0)
        if isinstance(node, dict):
            kind = node.get("type")
            if isinstance(kind, str) and kind not in known and kind not in out:
                out.append(kind)
            node = list(node.values())
        if isinstance(node, list):
            todo[:0] = node
    return out


def model_file(path: str) -> str:
    """``path``, or the ``model.npz`` in it where it is a folder."""
    return os.path.join(path, "model.npz") if os.path.isdir(path) else path


def saved_spec(path: str):
    """The model spec stored in ``path`` (a ``model.npz`` or its folder); None when it
    cannot be read."""
    if special(model_file(path)):
        return None
    try:
        with np.load(model_file(path), allow_pickle=False) as saved:
            return json.loads(str(saved["spec"]))
    except Exception:  # noqa: BLE001 - any damage: the loader's own message says it
        return None
