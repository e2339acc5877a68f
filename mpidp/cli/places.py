"""Options whose values are paths, declared by their type (:class:`Place`), and the check
every such value passes before any work or MPI (:func:`refusal`): no FIFO, device or socket,
and no folder where a file is read (:func:`mpidp.atomic.check_place`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from ..atomic import TEXT_LIMIT, check_place


@dataclass(frozen=True)
class Place:
    """The ``type`` of an option naming a place: ``writes`` (an output) or read, a ``file``
    and/or a ``folder`` expected, ``text``: a file read whole (at most
    :data:`~mpidp.atomic.TEXT_LIMIT` bytes); ``is_name(value)``: the value is a word, not a
    path (a preset, a built-in data set); ``parse``: a further check of the text."""

    writes: bool = False
    file: bool = True
    folder: bool = False
    text: bool = False
    is_name: Callable[[str], bool] | None = None
    parse: Callable[[str], str] | None = None

    def __call__(self, text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError("is empty: give a path")
        return self.parse(text) if self.parse else text


def places(parser: argparse.ArgumentParser) -> list[tuple[argparse.Action, Place]]:
    """The actions of ``parser`` whose values are paths, with their declaration."""
    return [(a, a.type) for a in parser._actions  # noqa: SLF001 - argparse offers no list
            if isinstance(a.type, Place)]


def refusal(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str | None:
    """One line naming the option, the path and what it is, when a path in ``args`` (parsed
    by subcommand ``parser``) is a FIFO, a device or a socket, a folder where a file is read
    (an output's folder is left to its own check, which names a file to give), or a text
    file too large to read."""
    for action, place in places(parser):
        value = getattr(args, action.dest, None)
        for path in value if isinstance(value, list) else [value]:
            if path is None or place.is_name and place.is_name(path):
                continue
            what = action.option_strings[0] if action.option_strings else action.metavar
            try:
                check_place(path, what, place.file, place.folder, folder_later=place.writes,
                            limit=TEXT_LIMIT if place.text else None)
            except ValueError as exc:
                return str(exc)
    return None
