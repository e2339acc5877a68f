"""A check of a trace document the tests make: its tracks' spans nest, never overlap."""

from __future__ import annotations


def overlaps(trace: dict, nested_ok: bool = True) -> list[str]:
    """Problems in ``trace``: spans on one (pid, tid) track that overlap without one
    containing the other (any overlap if not ``nested_ok``). Empty when the tracks are
    clean."""
    tracks: dict[tuple, list] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"], e))
    problems = []
    for key, spans in tracks.items():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_ends: list[float] = []
        for t0, t1, e in spans:
            while open_ends and open_ends[-1] <= t0 + 1e-3:
                open_ends.pop()
            if open_ends and (not nested_ok or t1 > open_ends[-1] + 1e-3):
                problems.append(f"pid {key[0]} tid {key[1]}: {e['name']} at {t0:.3f} us "
                                f"overlaps a span ending at {open_ends[-1]:.3f} us")
            open_ends.append(t1)
    return problems
