"""The command line: ``mpidp train`` / ``predict`` / ``model`` / ``plot`` / ``info``
(:mod:`~.main`), which option applies to which mode (:mod:`~.options`), ``--config`` files
(:mod:`~.config`), the user's modules of ``--import`` (:mod:`~.imports`), the run a
command line asks for (:mod:`~.train`), predictions (:mod:`~.predict`). The only package
whose functions see an ``argparse.Namespace``."""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
