"""The command line (``mpidp train`` / ``predict`` / ``model`` / ``plot`` / ``info``): the
only package whose functions see an ``argparse.Namespace``; its modules: docs/design.md."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
