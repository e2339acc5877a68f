"""The value types of the command line's options: each parses one option's text and
refuses, in one phrase, what is not a valid value (argparse adds the option's name)."""

from __future__ import annotations

import argparse
import math


def number(kind, low: float, high: float = math.inf, low_open: bool = False,
            high_open: bool = True):
    """A parser of ``kind`` values in a range (finite always: NaN and Inf are refused)."""
    if kind is int:  # an open bound is the next integer in: > 0 is >= 1
        low, low_open = (math.floor(low) + 1 if low_open else math.ceil(low)), False
        if high != math.inf:
            high, high_open = (math.ceil(high) - 1 if high_open else math.floor(high)), False
    name = "an integer" if kind is int else "a number"
    what = "a finite number" if kind is float and high == math.inf else name
    bounds = f"{'>' if low_open else '>='} {low:g}" + (
        "" if high == math.inf else f" and {'<' if high_open else '<='} {high:g}")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        ok = math.isfinite(value) and (value > low if low_open else value >= low) and (
            value < high if high_open else value <= high)
        if not ok:
            raise argparse.ArgumentTypeError(f"must be {what} {bounds}, got {text}")
        return value
    return parse


def positive(kind):
    return number(kind, 0, low_open=True)


def non_negative(kind):
    return number(kind, 0)


def mebibytes(text: str) -> float:
    """A size in MiB: a finite number > 0 that is at least one byte and under 2^62 bytes."""
    value = positive(float)(text)
    if value * 2**20 < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte (2^-20 = 9.5e-07 MiB), "
                                         f"got {text}")
    if value * 2**20 >= 2**62:
        raise argparse.ArgumentTypeError(f"must be under 2^42 MiB (4.4e12), got {text}")
    return value


def model_name(text: str) -> str:
    """``--model``: a preset name, or a model file (read and checked on every rank later)."""
    from ..nn.modelfile import is_model_file
    from ..nn.presets import PRESETS
    if text in PRESETS or is_model_file(text):
        return text
    raise argparse.ArgumentTypeError(
        f"{text!r} is neither a preset ({', '.join(PRESETS)}) nor a model file (.toml or .json)")


def listed(text: str, kind, bad: str) -> tuple:
    """The ``kind`` values of comma-separated ``text`` (blank items skipped); ``bad``: the
    message when one is not a ``kind``."""
    try:
        return tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(bad) from None


def ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of increasing positive integers (``--lr-milestones``)."""
    values = listed(text, int, f"{text!r} is not a comma-separated list of integers (e.g. "
                     f"30,60,80)")
    if not values or min(values) < 1 or list(values) != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"{text!r}: give increasing epochs >= 1 (e.g. 30,60)")
    return values


def hidden(text: str) -> tuple[int, ...]:
    sizes = listed(text, int, f"expected comma-separated layer widths like 128,64, got "
                    f"{text!r}")
    if any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"layer widths must be >= 1, got {text!r}")
    if not sizes:
        raise argparse.ArgumentTypeError(
            f"no layer width in {text!r}: an mlp needs at least one hidden layer (e.g. "
            "--hidden 128,64); for none, use --model logreg or --model linear")
    return sizes


def floats(text: str) -> list[float]:
    return list(listed(text, float, f"expected comma-separated numbers like 1,2, got {text!r}"))


def slowdown(text: str) -> dict[int, float]:
    out = {}
    for part in text.split(","):
        try:
            rank, factor = part.split(":")
            out[int(rank)] = float(factor)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected RANK:FACTOR[,RANK:FACTOR...] like 1:2, got {text!r}") from None
        if not 1 <= out[int(rank)] <= 1e6 or int(rank) < 0:
            raise argparse.ArgumentTypeError(f"need RANK >= 0 and FACTOR from 1 to 1e6, got "
                                             f"{part!r}")
    return out
