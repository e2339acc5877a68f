"""``mpidp plot RUN_DIR [RUN_DIR ...] --out FILE.png``: loss and accuracy of one or several
runs against epochs and against seconds, each run labelled from its configuration.

The ``plot`` subcommand's options and the function that runs it; the reading and drawing
are :mod:`mpidp.observe.plot`. No MPI here.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..observe import plot as P


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plot`` subcommand to ``subparsers`` (from ``add_subparsers``)."""
    p = subparsers.add_parser(
        "plot", help="plot loss and accuracy of finished or killed runs (no MPI needed)",
        description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("runs", nargs="+", metavar="RUN_DIR",
                   help="a train --out folder (metrics.json, or history.jsonl if it was killed)")
    p.add_argument("--out", required=True, metavar="FILE.png",
                   help="the image to write (its extension says the format: .png, .svg, "
                   f".pdf ...; a folder gets {P.IN_A_FOLDER} in it, a name without one .png)")
    p.add_argument("--x", choices=("epochs", "seconds", "both"), default="both",
                   help="horizontal axis: epochs, seconds since the start, or both (default)")
    p.add_argument("--title", default=None, help="a title over the figure")
    return p


def main(args: argparse.Namespace) -> int:
    """Run ``mpidp plot`` with the parsed ``args``; returns the exit status (2 with a message
    on bad input, before anything is written, or when the image cannot be written: then
    nothing is left half-written)."""
    try:
        P.need_matplotlib()
        out = P.output_path(args.out)
        runs = P.load_runs(args.runs)
        P.draw(runs, out, args.x, args.title)
    except (ImportError, ValueError, OSError) as exc:
        print(f"mpidp: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} ({len(runs)} run{'s' if len(runs) > 1 else ''})")
    return 0
