"""``mpidp export MODEL --format onnx|safetensors --out FILE``: a saved model written for
another runtime (:mod:`mpidp.nn.export`). No MPI here; exit 2 with one line, nothing
written, for a layer that cannot be exported, a missing package or a bad file."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .imports import HINT, import_modules, imports_of, saved_spec, unregistered
from .places import Place

FORMATS = {"onnx": ("onnx", "export_onnx"), "safetensors": ("safetensors", "export_safetensors")}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``export`` subcommand to ``subparsers`` (from ``add_subparsers``); the
    caller adds ``--import``."""
    p = subparsers.add_parser(
        "export", help="write a trained model as ONNX or safetensors (no MPI needed)",
        description="Write a model saved by 'mpidp train' (model.npz) as an ONNX graph "
        "(dynamic batch, scores out) or as its parameters and state by layer name "
        "(safetensors). Needs the export extra: pip install 'mpidp[export]'.")
    p.add_argument("model", metavar="MODEL", type=Place(folder=True),
                   help="model.npz written by mpidp train, or its folder")
    p.add_argument("--format", choices=sorted(FORMATS), default="onnx",
                   help="onnx (a graph any ONNX runtime runs) or safetensors (named tensors)")
    p.add_argument("--out", type=Place(writes=True), required=True, metavar="FILE",
                   help="the file to write (FILE.onnx, FILE.safetensors)")
    return p


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
    package, writer = FORMATS[args.format]
    try:
        export.need_extra(package)  # before any work: the extra may be missing
        import_modules(imports_of(args))
        model = _load(args.model)
        path = getattr(export, writer)(model, args.out)
    except (ImportError, ValueError, OSError) as exc:
        print(f"mpidp: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {path} ({args.format}, {model.dtype}, {len(model.layers)} layers)")
    return 0
