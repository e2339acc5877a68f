"""``mpidp check-layer MODULE:CLASS``: a layer class of the user's own run through the layer
contract (:func:`mpidp.nn.check_layer`) in one process, before any training. No MPI here.
Exit 0 when every rule holds, 1 with one line per broken rule, 2 for bad input (a module
that cannot be imported, a class that is not there, settings it does not take)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from contextlib import contextmanager
from functools import partial

from . import values
from .imports import import_modules, imports_of, near

BROKEN_EXIT = 1
TIMEOUT_EXIT = 3  # as the watchdog's


def add_parser(sub, formatter_class) -> argparse.ArgumentParser:
    """The ``check-layer`` subcommand of ``sub`` with its own options (``--import`` apart)."""
    p = sub.add_parser(
        "check-layer", help="check a layer class of your own against the layer contract (no "
        "MPI needed)", formatter_class=formatter_class,
        description="Run a layer class through the layer contract in float64, P ranks "
        "simulated in one process: gradients against finite differences, sums not means, "
        "the same reduce_sum calls whatever the rows (0 included), state from global figures "
        "only, P ranks equal to one process, rebuilt from its config. Exit 0 when every rule "
        "holds, 1 with one line per broken rule, 2 for bad input.")
    a = p.add_argument
    a("layer", metavar="LAYER", help="MODULE:CLASS (a dotted module name or a .py file, and "
      "a layer class or a function that makes one), or the registered name of a layer class "
      "(a built-in one, or one a module given with --import registers)")
    a("--set", nargs="+", action="extend", metavar="NAME=VALUE", dest="settings",
      help="the layer's settings, as in a model file (each VALUE read as JSON, else as text)")
    a("--n-in", type=_shape, default=(8,), metavar="SIZES",
      help="the per-sample input shape: a width or sizes like 3,8,8 (default: 8)")
    a("--ranks", type=values.number(int, 2), default=3, help="simulated ranks (>= 2)")
    a("--rows", type=values.positive(int), default=7, help="rows of the batch (>= --ranks)")
    a("--seed", type=values.non_negative(int), default=0, help="seed of the inputs and parameters")
    a("--timeout", type=values.number(float, 0, 1e6, low_open=True, high_open=False),
      default=600, metavar="SECONDS",
      help=f"end the check with exit {TIMEOUT_EXIT} if it has not finished after this long "
      "(a layer that never returns; default: 600)")
    return p


class _TimedOut(BaseException):  # not caught as a failure of the layer's code
    pass


@contextmanager
def _bounded(seconds: float):
    """Raise :class:`_TimedOut` in this (the main) thread after ``seconds``."""
    def alarm(signum, frame):
        raise _TimedOut
    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _shape(text: str) -> tuple[int, ...]:
    sizes = values.listed(text, int, f"expected a width or sizes like 3,8,8, got {text!r}")
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be >= 1, got {text!r}")
    return sizes


def _settings(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        name, eq, text = pair.partition("=")
        if not eq or not name.isidentifier():
            raise ValueError(f"--set {pair}: give NAME=VALUE")
        if name in out:
            raise ValueError(f"--set {pair}: {name} is already set (to {out[name]!r}): give "
                             f"each setting once")
        try:
            out[name] = json.loads(text)
        except ValueError:
            out[name] = text
    return out


def _target(text: str):
    """The class (or factory) ``text`` names: ``MODULE:NAME`` or a registered name."""
    from ..nn import Layer, registered_layers
    module, colon, name = text.rpartition(":")
    if not colon:
        known = registered_layers()
        if text not in known:
            raise ValueError(f"no layer class is registered as {text!r}: give MODULE:CLASS, "
                             f"or the module that registers it with --import MODULE{near(text)}")
        return known[text]
    if not module or not name:
        raise ValueError(f"{text!r}: give MODULE:CLASS")
    try:
        found = import_modules([module])[0]
    except ValueError as exc:  # named as the layer was given, not as an --import
        raise ValueError(str(exc).replace("--import ", f"{text}: module ", 1)) from None
    for part in name.split("."):
        if not hasattr(found, part):
            raise ValueError(f"{module} has no {name!r}")
        found = getattr(found, part)
    if not (callable(found) or isinstance(found, Layer)):
        raise ValueError(f"{text} is a {type(found).__name__}, not a layer class")
    if isinstance(found, type) and not issubclass(found, Layer):
        raise ValueError(f"{text} is a class that is not an mpidp.nn.Layer: subclass it")
    return found


def _maker(text: str, target, settings: dict, n_in: tuple[int, ...]):
    """A function making a fresh layer of ``target`` (a class: with ``settings``, the sizes
    that follow from the input left to it, as in a model file), tried once, on inputs of
    per-sample shape ``n_in``."""
    from ..nn import Layer, Sequential
    from ..nn.modelfile import fill_settings

    def unmade(why) -> ValueError:
        return ValueError(f"{text} cannot be made from the settings {settings} ({why}): give "
                          f"them with --set NAME=VALUE")
    if not isinstance(target, type):
        if settings:
            raise ValueError(f"{text} is not a class: --set needs a class")
        make = target
    else:
        try:
            make = partial(target, **(settings if "from_config" in vars(target) else
                                      fill_settings(target, settings, None, target.__name__)))
        except ValueError as exc:
            raise unmade(exc) from None
    try:
        made = make()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the user's code: bad input
        raise unmade(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(made, Layer):
        raise ValueError(f"{text} made a {type(made).__name__}, not an mpidp.nn.Layer")
    try:
        Sequential([made], n_in)
    except ValueError as exc:  # the shape given does not suit the layer
        raise ValueError(f"--n-in {','.join(map(str, n_in))} does not suit {made!r}: "
                         f"{str(exc).rpartition('before it: ')[2]}") from None
    return make


def main(args: argparse.Namespace) -> int:
    """Run ``mpidp check-layer`` with the parsed ``args``; returns the exit status."""
    from ..nn import check_layer
    try:
        if args.rows < args.ranks:
            raise ValueError(f"--rows {args.rows} is fewer than --ranks {args.ranks}")
        import_modules(imports_of(args))
        make = _maker(args.layer, _target(args.layer), _settings(args.settings or []),
                      args.n_in)
        with _bounded(args.timeout):
            report = check_layer(make, args.n_in, ranks=args.ranks, rows=args.rows,
                                 seed=args.seed, strict=False)
    except (ImportError, ValueError, TypeError) as exc:
        print(f"mpidp: error: {exc}", file=sys.stderr)
        return 2
    except MemoryError as exc:
        print(f"mpidp: error: a check of {args.rows} rows of shape {args.n_in} on "
              f"{args.ranks} ranks does not fit in memory ({exc or 'MemoryError'}): give "
              f"smaller --rows, --ranks or --n-in", file=sys.stderr)
        return 2
    except _TimedOut:
        print(f"mpidp: error: the check of {args.layer} did not finish within --timeout "
              f"{args.timeout:g} s (a forward or backward that never returns, or a check too "
              "large: give a larger --timeout, or smaller --rows, --ranks or --n-in)",
              file=sys.stderr)
        return TIMEOUT_EXIT
    except KeyboardInterrupt:
        print("mpidp: interrupted (SIGINT); nothing was checked to the end", file=sys.stderr)
        return 130
    print(report, flush=True)
    return 0 if report.ok else BROKEN_EXIT
