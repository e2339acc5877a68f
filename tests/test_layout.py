"""The layering the design promises: MPI only in mpidp.comm, no import cycles, and no MPI
started by importing mpidp, its models, or asking the command line for help."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "mpidp"


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside functions, resolved."""
    mod, out = _module(path), set()
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            name = node.module or ""
            full = (f"{base}.{name}" if name else base) if node.level else name
            out.add(full)
            out.update(f"{full}.{a.name}" for a in node.names)
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PKG.rglob("*.py")}
    return {m: {i for i in _imports(p) if i in files and i != m} for m, p in files.items()}


def test_only_mpidp_comm_imports_mpi4py():
    offenders = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
                 if not _module(p).startswith("mpidp.comm")
                 and any(i.split(".")[0] == "mpi4py" for i in _imports(p))]
    assert offenders == [], f"modules outside mpidp/comm import mpi4py: {offenders}"


def test_no_import_cycles():
    graph, cycles = _graph(), []

    def visit(node, stack, on_stack, done):
        on_stack.add(node)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt in on_stack:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, stack, on_stack, done)
        stack.pop()
        on_stack.discard(node)
        done.add(node)

    done: set[str] = set()
    for node in sorted(graph):
        if node not in done:
            visit(node, [], set(), done)
    # a package importing its own submodules (re-exports) is not a cycle
    real = [c for c in cycles if not all(a.startswith(c[0]) or c[0].startswith(a) for a in c)]
    assert real == [], "import cycles: " + "; ".join(" -> ".join(c) for c in real)


@pytest.mark.parametrize("code", [
    "import mpidp",
    "import mpidp.nn; mpidp.nn.mlp(4, (8,), 2).init_(0)",
    "import mpidp.data.partition, mpidp.data.sources, mpidp.nn.sparse, mpidp.scale.costmodel",
    "import mpidp; mpidp.__version__",
])
def test_importing_does_not_start_mpi(code):
    r = subprocess.run([sys.executable, "-c", code + "; import sys; assert 'mpi4py' not in "
                        "sys.modules, 'mpi4py was imported'"], capture_output=True, text=True,
                       cwd=str(ROOT))
    assert r.returncode == 0, r.stderr


def _cli_without_mpi(*args: str) -> subprocess.CompletedProcess:
    """``python -m mpidp ARGS`` in a process where mpi4py cannot be imported at all."""
    code = ("import sys; sys.modules['mpi4py'] = None; sys.argv = ['mpidp', *sys.argv[1:]]; "
            "from mpidp.cli.main import main; sys.exit(main())")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          cwd=str(ROOT))


@pytest.mark.parametrize("args,expect", [
    (["--help"], "Data-parallel training"), (["--version"], "mpidp "),
    (["train", "--help"], "--checkpoint-dir"), (["info"], '"mpi": "not available'),
])
def test_help_version_and_info_work_without_mpi(args, expect):
    r = _cli_without_mpi(*args)
    assert r.returncode == 0, r.stderr
    assert expect in r.stdout


def test_train_without_mpi_says_how_to_get_it():
    r = _cli_without_mpi("train", "--epochs", "1")
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "pip install 'mpidp[mpi]'" in lines[0], r.stderr


def test_help_says_each_default_once():
    r = _cli_without_mpi("train", "--help")
    assert r.returncode == 0 and "bow" in r.stdout  # every dataset form is listed
    blocks, current = [], []
    for line in r.stdout.splitlines():  # one block per option: a line starting with "  -"
        if line.startswith("  -") and current:
            blocks.append(" ".join(current))
            current = []
        current.append(line.strip())
    blocks.append(" ".join(current))
    doubled = [b for b in blocks if b.count("default") > 1]
    assert doubled == [] and not any("(default: None)" in b for b in blocks), doubled
