"""The flags of the modes' settings: :data:`FLAGS`, one line per flag naming the settings
field it sets (:mod:`mpidp.parallel.modes`). From it and the fields' declarations the
parser gets its options (:func:`add_mode_options`), a mode its settings from parsed
arguments (:func:`settings_of`), and a message the flag of a setting (:func:`spelling`).
Pure: no MPI here."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..errors import keyword
from ..parallel.modes import MODES, Settings, declared, having

_MIB = 2**20


@dataclass(frozen=True)
class Flag:
    """``flag`` sets the settings ``field``; ``words``: the flag's values -> the field's;
    ``mib``: given in MiB, held in bytes; otherwise the flag's value is the field's."""

    flag: str
    field: str
    words: Mapping[str, Any] | None = None
    mib: bool = False

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    @property
    def modes(self) -> tuple[str, ...]:
        """The modes it applies to: those whose settings carry its field."""
        return having(self.field)

    @property
    def meta(self) -> Mapping[str, Any]:
        return declared(self.field).metadata

    @property
    def why(self) -> str:
        """Why it applies to no other mode: its field's declared reason, else who has it."""
        modes = self.modes
        return self.meta["why"] or (f"only --sync {' and '.join(modes)} "
                                    f"{'has' if len(modes) == 1 else 'have'} this setting")

    @property
    def default(self) -> Any:
        """Its field's default as the flag's value, where every mode that carries the
        field agrees on it (None otherwise: each mode keeps its own)."""
        found = {x.default for m in self.modes for x in fields(MODES[m].settings)
                 if x.name == self.field}
        return self.text(*found) if len(found) == 1 else None

    def value(self, given: Any) -> Any:
        """The field's value for the flag's ``given`` value."""
        if self.words is not None:
            return self.words[given]
        return int(given * _MIB) if self.mib else given

    def text(self, value: Any) -> Any:
        """The flag's value for the field's ``value``."""
        if self.words is not None:
            return next(w for w, v in self.words.items() if v == value)
        return value / _MIB if self.mib else value


FLAGS = (
    Flag("--max-staleness", "max_staleness"),
    Flag("--ps-placement", "dedicated", {"root": False, "dedicated": True}),
    Flag("--ps-transport", "shared_memory", {"shared": True, "mpi": False}),
    Flag("--ps-chunk-mb", "chunk_bytes", mib=True),
    Flag("--bucket-mb", "bucket_bytes", mib=True),
    Flag("--overlap-progress", "progress"),
    Flag("--overlap-finish", "finish"),
    Flag("--node-aware", "node_aware", {"auto": None, "on": True, "off": False}),
    Flag("--compress", "codec"),
    Flag("--sync-every", "k"),
    Flag("--micro-batches", "micro_batches"),
    Flag("--schedule", "schedule"),
    Flag("--error-feedback", "error_feedback", {"on": True, "off": False}),
)
_BY_FIELD = {f.field: f for f in FLAGS}


def add_mode_options(group, flag: str, kinds: tuple[str, ...], default: str, *,
                     number: Callable, mebibytes: Callable, **others: str) -> None:
    """``flag``, choosing one of ``others`` (name -> what it is) or of the modes of
    ``kinds``, each told by its note; then the flags of :data:`FLAGS` whose settings belong
    to modes of ``kinds``, parsed by ``mebibytes`` (MiB) or ``number(int, low)`` (>= low)."""
    notes = {**others, **{n: m.note for n, m in MODES.items() if m.kind in kinds}}
    group.add_argument(flag, choices=tuple(notes), default=default,
                       help="; ".join(f"{name}: {note}" for name, note in notes.items()))
    for f in (f for f in FLAGS if MODES[f.modes[0]].kind in kinds):
        meta = f.meta
        kind = mebibytes if f.mib else (None if meta.get("low") is None else number(int, meta["low"]))
        group.add_argument(f.flag, type=kind, default=f.default,
                           choices=tuple(f.words) if f.words else meta.get("choices"),
                           help=f"{', '.join(f.modes)}: {meta['help']}")


def settings_of(mode: str, args: argparse.Namespace) -> Settings:
    """The settings of ``mode`` that the parsed ``args`` give (a flag left at None keeps
    the mode's default), checked."""
    own = MODES[mode].fields
    return MODES[mode].settings(**{f.field: f.value(getattr(args, f.dest)) for f in FLAGS
                                   if f.field in own and getattr(args, f.dest) is not None})


def spelling(parser: argparse.ArgumentParser) -> Callable[..., str]:
    """How the command line names a setting in messages (:func:`mpidp.errors.spelled`): a
    mode setting by its flag and the value as typed (``--bucket-mb 1``), any other by the
    option whose destination it is (``checkpoint_dir``: ``--checkpoint-dir``)."""
    parsers = [parser, *parser._subparsers._group_actions[0].choices.values()]  # noqa: SLF001
    options = {a.dest: max(a.option_strings, key=len) for p in parsers for a in p._actions
               if a.option_strings and a.dest != "help"}  # noqa: SLF001

    def spell(name: str, *value: Any) -> str:
        if (flag := _BY_FIELD.get(name)) is not None:
            return flag.flag + "".join(f" {flag.text(v)}" for v in value)
        if name not in options:
            return keyword(name, *value)
        return options[name] + "".join(f" {v}" for v in value)
    return spell
