"""benchmarks/ is one package: its modules import each other as ``benchmarks.X``, with no
edits of ``sys.path``, nothing from tests/, and no import cycles."""

from __future__ import annotations

import ast
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _imports() -> dict[str, set[str]]:
    """Each module of benchmarks/ -> the benchmarks modules it imports (anywhere in it)."""
    graph = {}
    for path in sorted(BENCH.glob("*.py")):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found |= {n.split(".")[1] for n in names if n.startswith("benchmarks.")}
            if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
                found |= {a.name for a in node.names}
        graph[path.stem] = found
    return graph


def test_no_sys_path_edits_and_nothing_from_tests():
    offenders = [p.name for p in BENCH.glob("*.py")
                 if "sys.path" in p.read_text() or "conftest" in p.read_text()]
    assert offenders == []
    siblings = {p.stem for p in BENCH.glob("*.py")}
    for path in BENCH.glob("*.py"):  # a sibling is imported through the package only
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                assert node.module not in siblings, (path.name, node.module)
            if isinstance(node, ast.Import):
                assert not {a.name for a in node.names} & siblings, path.name


def test_no_import_cycles():
    graph = _imports()

    def reach(start: str) -> set[str]:
        seen, todo = set(), list(graph.get(start, ()))
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo += graph.get(m, ())
        return seen

    assert [m for m in graph if m in reach(m)] == []


def test_quick_defaults_apply_only_when_asked(monkeypatch):
    import argparse

    from benchmarks.harness import quick_defaults
    for env, want in (("", 3), ("1", 1)):
        monkeypatch.setenv("MPIDP_BENCH_QUICK", env)
        p = argparse.ArgumentParser()
        p.add_argument("--repeats", type=int, default=3)
        quick_defaults(p, repeats=1)
        assert p.parse_args([]).repeats == want
        assert p.parse_args(["--repeats", "5"]).repeats == 5
