"""Models without code: a list of layers with their settings, in a TOML file (one
``[[layers]]`` table per layer) or a JSON one (``{"layers": [...]}`` or just the list); see
``docs/models.md``. ``type`` is a registered layer name (:func:`mpidp.nn.register_layer`),
the other keys its constructor's settings; ``in_channels`` and ``n_in`` may be left out
(inferred), and a ``Dense`` without ``n_out`` gets the number of outputs the data set needs."""

from __future__ import annotations

import inspect
import json
import os
import sys
from typing import Any

from ..atomic import read_text
from .layers import Layer, layer_class

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.9/3.10: the tomli package, a dependency there
    import tomli as tomllib

MODEL_FILE_SUFFIXES = (".toml", ".json")
MAX_NESTING = 64  # blocks in blocks: deeper ones would exhaust Python's recursion


def is_model_file(spec: str) -> bool:
    """True when ``spec`` names a model file (by its suffix) rather than a preset."""
    return str(spec).lower().endswith(MODEL_FILE_SUFFIXES)


def read_model_file(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The layer list of a model file: one dict per layer, each with a ``type`` string.
    Raises ``ValueError`` naming the file and the line (a syntax error) or the layer."""
    path = os.fspath(path)
    try:
        text = read_text(path, "model file")
    except OSError as exc:
        raise ValueError(f"model file {path}: cannot read it ({exc.strerror or exc})") from None
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:  # as TOML refuses them
        keys = [k for k, _ in pairs]
        twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
        if twice is not None:
            raise ValueError(f"model file {path}: key {twice!r} given twice in one object "
                             f"{{{', '.join(map(repr, dict.fromkeys(keys)))}}}")
        return dict(pairs)

    try:
        doc = (tomllib.loads(text.decode()) if path.lower().endswith(".toml")
               else json.loads(text, object_pairs_hook=unique))
    except UnicodeDecodeError:
        raise ValueError(f"model file {path}: not UTF-8 text") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"model file {path}: {exc}") from None
    except RecursionError:
        raise ValueError(f"model file {path}: nested too deep to read (blocks may nest at "
                         f"most {MAX_NESTING} deep)") from None
    layers = doc.get("layers") if isinstance(doc, dict) else doc
    if isinstance(doc, dict) and set(doc) - {"layers"}:
        raise ValueError(f"model file {path}: unknown key(s) "
                         f"{', '.join(map(repr, sorted(set(doc) - {'layers'})))}; it holds "
                         f"only 'layers', a list of tables (TOML [[layers]])")
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"model file {path}: needs a non-empty list of layers (TOML: "
                         f"[[layers]] tables; JSON: a list, or {{\"layers\": [...]}})")
    for i, d in enumerate(layers):
        if not isinstance(d, dict) or not isinstance(d.get("type"), str):
            raise ValueError(f"model file {path}: layer {i + 1} needs a 'type' string "
                             f"(a layer class name such as \"Dense\"), got {d!r}")
    return layers


def layers_from(specs: list[dict[str, Any]], n_outputs: int | None = None,
                where: str = "model file") -> list[Layer]:
    """Build the layers of ``specs`` (as :func:`read_model_file` returns them), unbound: a
    required ``n_in`` / ``in_channels`` left out is inferred, ``n_out`` is ``n_outputs``.
    ``ValueError`` names the layer (1-based) and key when a type is not registered, a
    setting is unknown or missing, the layer refuses its settings, or blocks nest deeper
    than :data:`MAX_NESTING`."""
    level, depth = list(specs), 0
    while level := [c for d in level if isinstance(d, dict) and isinstance(d.get("layers"), list)
                    for c in d["layers"]]:
        depth += 1
    if depth > MAX_NESTING:
        raise ValueError(f"{where}: blocks nested {depth} deep; they may nest at most {MAX_NESTING} deep")
    out = []
    for i, d in enumerate(specs):
        kind = d["type"]
        try:
            cls = layer_class(kind)
        except ValueError as exc:
            raise ValueError(f"{where}: layer {i + 1}: {exc}") from None
        settings = {k: v for k, v in d.items() if k != "type"}
        if "from_config" not in vars(cls):
            settings = fill_settings(cls, settings, n_outputs, f"{where}: layer {i + 1} ({kind})")
        try:
            out.append(cls.from_config(settings) if callable(getattr(cls, "from_config", None))
                       else cls(**settings))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: layer {i + 1} ({kind}): {exc}") from None
    return out


def fill_settings(cls: type, settings: dict, n_outputs: int | None, who: str) -> dict:
    """``settings`` checked against ``cls``'s constructor, with inferable sizes filled."""
    params = inspect.signature(cls).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
        if unknown := [k for k in settings if k not in params]:
            takes = ", ".join(k for k, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
            raise ValueError(f"{who}: unknown setting {unknown[0]!r} (it takes {takes or 'no settings'})")
    filled = dict(settings)
    for name, p in params.items():
        if name in filled or p.default is not p.empty or p.kind in (p.VAR_POSITIONAL,
                                                                      p.VAR_KEYWORD):
            continue
        if name in ("n_in", "in_channels"):
            filled[name] = None
        elif name == "n_out" and n_outputs is not None:
            filled[name] = int(n_outputs)
        else:
            raise ValueError(f"{who}: missing setting {name!r}")
    return filled
