"""``mpidp export MODEL --format onnx|safetensors --out FILE``: a saved model written for
another runtime (:mod:`mpidp.nn.export`). No MPI here; exit 2 with one line, nothing
written, for a layer that cannot be exported, a missing package, a bad file or an output
that cannot be written (naming the option)."""

from __future__ import annotations

import argparse
import sys

from ..atomic import WriteError, check_file, write_error
from .imports import HINT, import_modules, imports_of, saved_spec, unregistered
from .parser import EXPORT_FORMATS


def _load(path: str):
    from .. import nn
    try:
        return nn.load(path)
    except ValueError as exc:
        missing = [name for name in unregistered(saved_spec(path)) if repr(name) in str(exc)]
        if missing:
            raise ValueError(f"{path}: uses layer class {missing[0]!r}, which is not "
                             f"registered: {HINT}") from None
        raise


def main(args: argparse.Namespace) -> int:
    """Run ``mpidp export`` with the parsed ``args``; returns the exit status."""
    from ..nn import export
    package, writer = EXPORT_FORMATS[args.format]
    try:
        export.need_extra(package)  # before any work: the extra may be missing
        check_file(args.out, "--out", f"model.{args.format}")
        import_modules(imports_of(args))
        model = _load(args.model)
        path = getattr(export, writer)(model, args.out)
    except (ImportError, ValueError, OSError) as exc:
        if isinstance(exc, WriteError):
            exc = write_error(exc, what="--out")
        print(f"mpidp: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({args.format}, {model.dtype}, {len(model.layers)} layers)")
    return 0
