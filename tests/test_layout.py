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


def test_pure_names_do_not_start_mpi():
    code = ("import sys, mpidp; mpidp.MpidpError; mpidp.checksum; mpidp.Partition; "
            "mpidp.partition; mpidp.nn; import mpidp.data as D; D.Partition; D.RowReader; "
            "mpidp.RunSpec; mpidp.Checkpointing; assert 'mpi4py.MPI' not in sys.modules, 'MPI started'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=str(ROOT))
    assert r.returncode == 0, r.stderr


# --- what each layer may receive, call and take ------------------------------------------


def _sources(outside: str) -> list[tuple[str, ast.Module, str]]:
    """``(path relative to the root, tree, text)`` of every module not under ``mpidp/outside``."""
    out = []
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if not rel.startswith(f"mpidp/{outside}/"):
            text = p.read_text()
            out.append((rel, ast.parse(text, rel), text))
    return out


def _functions(tree: ast.AST):
    return (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                        ast.Lambda)))


def _namespace_uses(tree: ast.Module) -> list[tuple[int, str]]:
    """``(line, what)`` where ``tree`` imports argparse or a function takes a parameter
    annotated ``Namespace``, or one named ``args`` without an annotation (``*args``,
    ``**args`` and an ``args: dict`` are not a namespace)."""
    found = []
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        found += [(node.lineno, f"imports {n}") for n in names if n.split(".")[0] == "argparse"]
    for fn in _functions(tree):
        a = fn.args
        for arg in a.posonlyargs + a.args + a.kwonlyargs + [x for x in (a.vararg, a.kwarg) if x]:
            note = ast.unparse(arg.annotation) if arg.annotation is not None else ""
            named = arg.arg == "args" and arg not in (a.vararg, a.kwarg) and not note
            if named or note.split(".")[-1].strip("'\"") == "Namespace":
                found.append((arg.lineno, f"parameter {arg.arg}: {note or '?'}"))
    return found


def test_no_module_outside_the_command_line_receives_its_namespace():
    """Options are read in mpidp/cli and passed on as named values: nothing else imports
    argparse or takes an ``args`` namespace."""
    offenders = [f"{rel}:{line}: {what}" for rel, tree, _ in _sources("cli")
                 for line, what in _namespace_uses(tree)]
    assert offenders == [], "the command line's namespace outside mpidp/cli:\n" + "\n".join(
        offenders)


def _mpi_methods() -> set[str]:
    MPI = pytest.importorskip("mpi4py.MPI")
    classes = (MPI.Comm, MPI.Intracomm, MPI.Cartcomm, MPI.Request, MPI.Win, MPI.Status)
    return {n for cls in classes for n in dir(cls) if n[:1].isupper()}


#: mpi4py's pickled (lower-case) methods: MPI calls when made on a communicator.
PICKLED = {"allgather", "allreduce", "alltoall", "bcast", "gather", "scatter", "reduce",
           "send", "recv", "isend", "irecv", "sendrecv", "barrier", "scan", "exscan"}


def _module_names(tree: ast.Module) -> set[str]:
    """Names ``tree`` binds by ``import x`` / ``import x as y`` (modules, not MPI objects)."""
    return {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
            if isinstance(n, ast.Import) for a in n.names}


def _mpi_calls(tree: ast.Module, text: str, methods: set[str]) -> list[tuple[int, str]]:
    """``(line, call)`` for each MPI method ``tree`` calls on an object (``X.Bcast(...)``,
    ``comm.gather(...)``) or hands over bound (``before=comm.Barrier``)."""
    modules, called, found = _module_names(tree), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            called.add(id(node.func))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
            continue
        receiver = ast.get_source_segment(text, node.value) or ""
        if isinstance(node.value, ast.Name) and node.value.id in modules:
            continue  # threading.Lock(): a module's function, not a method of an MPI object
        on_comm = "comm" in receiver.lower()
        if id(node) in called:
            hit = node.attr in methods or (node.attr in PICKLED and on_comm)
        else:
            hit = node.attr in methods and on_comm
        if hit:
            found.append((node.lineno, f"{receiver}.{node.attr}"))
    return found


def test_no_module_outside_mpidp_comm_calls_mpi():
    """Every MPI call goes through a function of mpidp.comm (which watches for stalls and
    takes care of large counts)."""
    methods = _mpi_methods()
    offenders = [f"{rel}:{line}: {call}" for rel, tree, text in _sources("comm")
                 for line, call in _mpi_calls(tree, text, methods)]
    assert offenders == [], "MPI called outside mpidp/comm:\n" + "\n".join(offenders)


#: The most named parameters a public function of the run layer (or a fit entry point) takes.
MAX_PARAMS = 6


def _n_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Named parameters of ``fn`` (positional, keyword-only; ``*args`` one), ``self``/``cls``
    not counted. ``**settings`` is not counted either: in the run layer it only fills a
    settings object (:class:`mpidp.RunSpec`), which names each one."""
    a = fn.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    if names and names[0] in ("self", "cls") and a.posonlyargs + a.args:
        names = names[1:]
    return len(names) + (a.vararg is not None)


def _public_callables(tree: ast.Module):
    """``(qualified name, node)`` of the public functions of ``tree`` and the public methods
    (and constructors) of its public classes."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name[0] != "_":
            yield node.name, node
        elif isinstance(node, ast.ClassDef) and node.name[0] != "_":
            for m in node.body:
                if (isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                        and (m.name[0] != "_" or m.name == "__init__")):
                    yield f"{node.name}.{m.name}", m


def _too_many_params(tree: ast.Module, only_fit: bool) -> list[tuple[int, str, int]]:
    return [(fn.lineno, name, _n_params(fn)) for name, fn in _public_callables(tree)
            if (not only_fit or name.split(".")[-1].startswith("fit"))
            and _n_params(fn) > MAX_PARAMS]


def test_run_layer_functions_take_few_parameters():
    """The run layer and the fit entry points take a few values and settings objects, not
    a long list of loose options."""
    offenders = []
    for path in sorted((PKG / "run").glob("*.py")) + sorted((PKG / "parallel").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for line, name, n in _too_many_params(tree, only_fit=path.parent.name == "parallel"):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {name} takes {n}")
    assert offenders == [], f"more than {MAX_PARAMS} parameters:\n" + "\n".join(offenders)


PLANTED = '''
import argparse
import threading
from argparse import Namespace


def reads(args, n): ...
def typed(opts: "argparse.Namespace"): ...
def fine(*args, **kwargs): threading.Lock()
def also_fine(name, args: dict, **args2): ...
class Node:
    def go(self, comm):
        self.comm.bcast(1)
        comm.Ibcast(b)
        self.leaders.Split(0)
        wait(before=comm.Barrier)
        C.barrier(comm)
def fit_many(a, b, c, d, e, f, *rest): ...
class Public:
    def __init__(self, a, b, c, d, e, f, g): ...
    def small(self, a, b, c, d, e, f): ...
    def _private(self, a, b, c, d, e, f, g): ...
'''


def test_layout_checks_find_planted_violations():
    """The three checks above are not vacuous: each finds what is planted here."""
    tree = ast.parse(PLANTED)
    uses = [what for _, what in _namespace_uses(tree)]
    assert uses == ["imports argparse", "imports argparse", "parameter args: ?",
                    "parameter opts: 'argparse.Namespace'"], uses
    calls = sorted(call for _, call in _mpi_calls(tree, PLANTED, _mpi_methods()))
    assert calls == ["comm.Barrier", "comm.Ibcast", "self.comm.bcast", "self.leaders.Split"]
    many = [name for _, name, _ in _too_many_params(tree, only_fit=False)]
    assert many == ["fit_many", "Public.__init__"], many
    assert [n for _, n, _ in _too_many_params(tree, only_fit=True)] == ["fit_many"]
