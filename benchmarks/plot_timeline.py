"""Render one training step of a trace (``mpidp train --trace FILE``) as a per-rank timeline
PNG: a row per rank and track, compute / wait / communication / update as coloured bars,
so the reader sees at a glance which rank was late and what the others did meanwhile.

Run: python benchmarks/plot_timeline.py TRACE.json --out timeline.png [--step K | --slowest]

Reads Chrome trace-event JSON in either layout mpidp writes: one process per rank with a
thread per track (:mod:`mpidp.observe.trace`; spans carry ``args.step``), or one process with a
thread per rank (the partition planner's trace; there a step starts at each ``compute``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

COLORS = {"compute": "#4c72b0", "forward": "#4c72b0", "backward": "#8172b2",
          "comm": "#55a868", "wait": "#c44e52", "update": "#dd8452", "eval": "#ccb974",
          "io": "#8c8c8c", "checkpoint": "#8c8c8c"}


def _names(events: list[dict]) -> tuple[dict, dict]:
    """``({pid: process name}, {(pid, tid): thread name})`` from the metadata events."""
    procs, threads = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    return procs, threads


def spans_by_step(doc: dict) -> dict[int, list[dict]]:
    """The ``X`` spans of ``doc`` grouped by step: ``args.step`` where recorded, else the
    count of ``compute`` spans so far on the span's track (the planner's layout)."""
    out: dict[int, list[dict]] = {}
    counters: dict[tuple, int] = {}
    for e in sorted((e for e in doc["traceEvents"] if e.get("ph") == "X"),
                    key=lambda e: e["ts"]):
        step = (e.get("args") or {}).get("step")
        if step is None:
            key = (e["pid"], e["tid"])
            counters[key] = counters.get(key, -1) + (e["name"] == "compute")
            step = max(counters[key], 0)
        out.setdefault(int(step), []).append(e)
    return out


def pick_step(steps: dict[int, list[dict]], step: int | None, slowest: bool) -> int:
    """``step`` if given; else the slowest step (``slowest``) or the step of median length
    (a typical one), lengths measured from its first span's start to its last span's end."""
    if step is not None:
        if step not in steps:
            raise SystemExit(f"step {step} is not in the trace (it holds steps "
                             f"{min(steps)} to {max(steps)}); pick one of those")
        return step
    length = {k: max(e["ts"] + e["dur"] for e in v) - min(e["ts"] for e in v)
              for k, v in steps.items() if k >= 0}
    order = sorted(length, key=length.get)
    return order[-1] if slowest else order[len(order) // 2]


def _rows(spans: list[dict], procs: dict, threads: dict) -> list[tuple]:
    """Sorted ``(pid, tid)`` rows that have spans, with their labels."""
    keys = sorted({(e["pid"], e["tid"]) for e in spans})
    label = lambda k: " / ".join(x for x in (procs.get(k[0]) if len(procs) > 1 else None,
                                             threads.get(k, f"tid {k[1]}")) if x)  # noqa: E731
    return [(k, label(k)) for k in keys]


def draw(doc: dict, step: int, out: str) -> int:
    """Draw ``step`` of ``doc`` into ``out``; returns the number of spans drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    spans = spans_by_step(doc)[step]
    procs, threads = _names(doc["traceEvents"])
    rows = _rows(spans, procs, threads)
    t0 = min(e["ts"] for e in spans)
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 1.6))
    used = {}
    for y, (key, _) in enumerate(rows):
        for e in (e for e in spans if (e["pid"], e["tid"]) == key):
            kind = e["name"] if e["name"] in COLORS else e.get("cat", e["name"])
            color = COLORS.get(kind, f"C{len(used) % 10}")
            used.setdefault(kind, color)
            ax.broken_barh([((e["ts"] - t0) / 1e3, max(e["dur"], 1.0) / 1e3)], (y - 0.38, 0.76),
                           facecolors=used[kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(rows)), [label for _, label in rows], fontsize=8)
    ax.invert_yaxis()
    epoch = (spans[0].get("args") or {}).get("epoch")
    ax.set(xlabel="milliseconds since the step's first span",
           title=f"step {step}" + (f" (epoch {epoch})" if epoch is not None else "")
           + ": what each rank did")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in used.items()], fontsize=8,
              loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return len(spans)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a Chrome trace-event JSON file written by mpidp")
    p.add_argument("--out", required=True, help="the PNG to write")
    p.add_argument("--step", type=int, default=None, help="the global step to draw")
    p.add_argument("--slowest", action="store_true",
                   help="draw the slowest step (default: the step of median length)")
    a = p.parse_args(argv)
    doc = json.loads(Path(a.trace).read_text())
    steps = spans_by_step(doc)
    if not steps:
        raise SystemExit(f"{a.trace} holds no spans; was it written with --trace?")
    step = pick_step(steps, a.step, a.slowest)
    n = draw(doc, step, a.out)
    print(f"wrote {a.out} (step {step}, {n} spans)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
