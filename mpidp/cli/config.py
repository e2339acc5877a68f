"""Configuration files for ``mpidp train``: ``--config FILE`` (TOML) and ``DIR/config.toml``.

A configuration is the table of ``train`` options by name (``batch-size = 64`` or
``batch_size = 64``), turned into command-line tokens (:func:`tokens`) so every value is
parsed and checked as its flag. Which source wins is :mod:`~.settings`. No MPI here.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.9/3.10: the tomli package, a dependency there
    import tomli as tomllib

#: Keys never taken from a stored configuration: what to do now, and how to show it, not how to train.
NOT_STORED = frozenset({"command", "config", "resume", "restart", "world_size",
                        "data_fingerprint", "resume_changes", "quiet", "verbose", "no_progress",
                        "progress", "trace", "trace_steps", "tensorboard", "log_every"})
#: Of those, what a run records about itself (not options): a file that holds them (the
#: ``config`` of a metrics.json) is read without them. The others, options of this one
#: invocation, apply when a hand-written ``--config`` file sets them.
RECORDS = frozenset({"command", "world_size", "data_fingerprint", "resume_changes"})


def load(path: str, what: str = "--config") -> dict:
    """The table in TOML file ``path``; ValueError naming the option ``what`` and the file on any problem."""
    from ..atomic import read_text
    try:
        data = read_text(path, what)
    except OSError as exc:
        raise ValueError(f"{what} {path}: cannot read it ({exc.strerror})") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{what} {path}: not UTF-8 text (byte 0x{data[exc.start]:02x} on "
                         f"line {line}); save it as UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{what} {path}: not valid TOML ({exc})") from None


def _value(v) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(_value(x) for x in v)
    if isinstance(v, dict):  # --slowdown RANK:FACTOR,...
        return ",".join(f"{k}:{x}" for k, x in v.items())
    return str(v)


def tokens(table: dict, parser: argparse.ArgumentParser, skip: Iterable[str] = (),
           source: str = "the configuration", literal: bool = False) -> list[str]:
    """Command-line tokens for ``table`` (option name -> value), without the options in
    ``skip`` (typed) and :data:`RECORDS` (``literal``, a run's record: :data:`NOT_STORED`).
    ValueError naming ``source`` and the key for a key that is no option of ``parser`` or
    names one twice, a value its flag would refuse, or (unless ``literal``) a string that
    starts with ``-``. A value starting with ``-`` goes as ``--flag=value``."""
    actions = {a.dest: a for a in parser._actions}  # noqa: SLF001 - argparse offers no map
    skip, out, seen = set(skip) | (NOT_STORED if literal else RECORDS), [], {}
    for key, value in table.items():
        dest = key.replace("-", "_")
        if dest in seen:
            raise ValueError(f"{source}: {seen[dest]} and {key} are the same option")
        seen[dest] = key
        if dest == "config" and not literal and value is not None:  # before the typed --config
            raise ValueError(f"{source}: a configuration file cannot name another (config = "
                             f"{_toml(value)}): put its settings in this one")
        if dest in skip or value is None or value == {}:
            continue
        action = actions.get(dest)
        if action is None or not action.option_strings or dest == "help":
            raise ValueError(f"{source}: {key!r} is not an option of mpidp train")
        flag = action.option_strings[-1]
        if action.nargs == 0:  # store_true
            if not isinstance(value, bool):
                raise ValueError(f"{source}: {key} must be true or false, got {_toml(value)}")
            out += [flag] if value else []
        else:  # a repeatable option (--import): the flag once per value
            for item in (value if isinstance(action, argparse._AppendAction)  # noqa: SLF001
                         and isinstance(value, list) else [value]):
                if isinstance(item, str) and item.startswith("-") and not literal:
                    raise ValueError(f"{source}: {key} = {_toml(value)} looks like an option, "
                                     f"not a value: give the value (a path that starts with "
                                     f"'-' as ./{item})")
                text = _checked(action, key, item, source)
                out += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
    return out


def _checked(action: argparse.Action, key: str, value, source: str) -> str:
    """``value`` as its flag's text; ValueError naming ``source`` and ``key`` if ``action`` refuses it."""
    text = _value(value)
    try:
        if isinstance(value, bool):
            raise ValueError("takes a value, not true or false")
        parsed = action.type(text) if callable(action.type) else text
    except (argparse.ArgumentTypeError, TypeError, ValueError) as exc:
        raise ValueError(f"{source}: {key} = {_toml(value)}: {exc}") from None
    if action.choices is not None and parsed not in action.choices:
        raise ValueError(f"{source}: {key} = {_toml(value)}: choose from "
                         + ", ".join(map(str, action.choices)))
    return text


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v) if isinstance(v, int) or math.isfinite(v) else (
            "nan" if v != v else ("inf" if v > 0 else "-inf"))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):  # --slowdown: write it as the flag's text
        return _toml(_value(v))
    return '"' + "".join(_ESCAPES.get(c) or (f"\\u{ord(c):04x}" if c < " " or c == "\x7f" else c)
                         for c in str(v)) + '"'


#: The characters a TOML basic string writes escaped (other control characters: ``\\uXXXX``).
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def check_recordable(config: dict, name: str = "config.toml") -> None:
    """ValueError naming the option, its value and the fix when :func:`dumps` of ``config``
    could not be written as UTF-8 TOML (text that holds bytes that are not UTF-8, as a
    path may on Linux): checked before a run, so it does not fail at its end."""
    for key, value in _recorded(config):
        try:
            _toml(value).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"--{key.replace('_', '-')} {value!r} is not UTF-8 text, "
                             f"which {name} cannot record: give a name in UTF-8 (a symbolic "
                             f"link with such a name will do)") from None


def dumps(config: dict) -> str:
    """``config`` (option dest -> value) as TOML that :func:`load` and ``--config`` read back;
    None values and :data:`NOT_STORED` keys are left out."""
    return "\n".join(["# mpidp train configuration: mpidp train --config THIS_FILE reproduces "
                      "the run", *(f"{k.replace('_', '-')} = {_toml(v)}" for k, v in
                                   _recorded(config))]) + "\n"


def _recorded(config: dict) -> list[tuple]:
    """The items of ``config`` that a file records, by key: not None, {} or :data:`NOT_STORED`."""
    return [(k, v) for k, v in sorted(config.items())
            if k not in NOT_STORED and v is not None and v != {}]
