"""The check every path-valued option (its type a :class:`~.parser.Place`) passes before any
work or MPI (:func:`refuse_special`): no FIFO, device or socket, and no folder where a file
is expected (:func:`mpidp.atomic.check_place`).
"""

from __future__ import annotations

import argparse
import sys
import time

from ..atomic import check_place
from .parser import EXIT_USAGE, Place, launcher_rank


def places(parser: argparse.ArgumentParser) -> list[tuple[argparse.Action, Place]]:
    """The actions of ``parser`` whose values are paths, with their declaration."""
    return [(a, a.type) for a in parser._actions  # noqa: SLF001 - argparse offers no list
            if isinstance(a.type, Place)]


def refuse_special(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Exit 2 on every rank, rank 0 printing one line naming the option, the path and what it
    is, when a path in ``args`` (parsed by subcommand ``parser``) is a FIFO, a device or a
    socket, or a folder where a file is expected."""
    for action, place in places(parser):
        value = getattr(args, action.dest, None)
        for path in value if isinstance(value, list) else [value]:
            if path is None or place.is_name(path):
                continue
            what = action.option_strings[0] if action.option_strings else action.metavar
            try:
                check_place(path, what, place.file, place.folder)
            except ValueError as exc:
                if launcher_rank() == 0:
                    print(f"mpidp: error: {exc}", file=sys.stderr, flush=True)
                else:  # Open MPI's launcher ends the job at the first non-zero exit
                    time.sleep(0.5)
                sys.exit(EXIT_USAGE)
