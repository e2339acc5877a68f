"""The layering the design promises: MPI only in mpidp.comm, no import cycles, and no MPI
started by importing mpidp, its models, or asking the command line for help."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

PKG = ROOT / "mpidp"


def _module(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
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


#: The packages, top to bottom (README, "Layout"): each imports only itself and those below
#: it. The top-level modules (errors.py, atomic.py, digest.py, _lazy.py, _threads.py) lie
#: below them all; mpidp/__init__.py and __main__.py, the face of the package, above them.
LAYERS = ("cli", "parallel", "run", "data", "observe", "scale", "comm", "nn")
_TOP, _BOTTOM = -1, len(LAYERS)


def _lazy_names(init: Path) -> dict[str, str]:
    """``name -> module`` (relative) of the names a package's ``__init__.py`` exports lazily
    (its ``_LAZY`` table; None there: the submodule of that name)."""
    for node in ast.walk(ast.parse(init.read_text())) if init.exists() else ():
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)):
            return {k.value: v.value or f".{k.value}" for k, v in zip(node.value.keys,
                                                                     node.value.values)}
    return {}


def _import_targets(path: Path, root: Path, modules: set[str]):
    """``(line, module)`` for every import in ``path`` (at the top or inside a function),
    resolved to the module of ``modules`` it loads: the deepest one named, and for a name
    the package ``__init__`` exports lazily, the module that defines it."""
    mod = _module(path, root)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    top = mod.split(".")[0]
    lazy = _lazy_names(root / top / "__init__.py")

    def deepest(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, deepest(a.name)) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            full = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            for a in node.names:
                if full == top and a.name in lazy:  # from mpidp import DataParallel
                    yield node.lineno, deepest(top + lazy[a.name])
                else:
                    yield node.lineno, deepest(f"{full}.{a.name}")


def _layer(module: str) -> int:
    """Where ``module`` lies: the index of its package in :data:`LAYERS` (0: the top),
    :data:`_TOP` for ``__main__``, :data:`_BOTTOM` for a top-level module. The package
    itself (``from .. import __version__``) counts as the bottom: Python runs its
    ``__init__`` before any of its modules, so its own names add no dependency (a name it
    exports lazily is resolved to its module by :func:`_import_targets`)."""
    parts = module.split(".")
    if len(parts) > 1 and parts[1] == "__main__":
        return _TOP
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else _BOTTOM


def _layer_violations(pkg: Path) -> list[str]:
    """``path:line: importer -> imported`` for each import of a package above the importer's
    (or a package not in :data:`LAYERS`) in the package at ``pkg``."""
    root, found = pkg.parent, []
    files = {_module(p, root): p for p in sorted(pkg.rglob("*.py"))}
    unknown = sorted(m for m in files if m.count(".") and (pkg / m.split(".")[1]).is_dir()
                     and m.split(".")[1] not in LAYERS)
    found += [f"{m}: package not in LAYERS" for m in unknown]
    for mod, path in files.items():
        here = _layer(mod) if mod.count(".") else _TOP  # __init__.py, the package's face
        for line, target in _import_targets(path, root, set(files)):
            if target.split(".")[0] == pkg.name and _layer(target) < here:
                found.append(f"{path.relative_to(root).as_posix()}:{line}: {mod} -> {target}")
    return found


def test_each_package_imports_only_those_below_it():
    """The layers of the README's layout, at module level and inside functions alike: a
    lazy import is still a dependency of the layer that makes it."""
    offenders = _layer_violations(PKG)
    assert offenders == [], "imports of a higher layer:\n" + "\n".join(offenders)


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


#: Run in a fresh interpreter: ``argv[1]`` the package's folder, ``argv[2]`` code to run.
#: Prints, one per line, each function of the package outside its cli/ that was called with
#: an ``argparse.Namespace`` among its arguments (or in a list, dict or object it was
#: given). A namespace that a function only hands on in its ``*args``/``**kwargs`` to a
#: function of cli/ (``C.run_agreed(comm, _layers, args)``) does not count: cli reads it.
NAMESPACE_RECORDER = r"""
import argparse, os, sys, threading
PKG = os.path.abspath(sys.argv[1]) + os.sep
CLI = PKG + "cli" + os.sep
found = set()

def holds(v):
    if isinstance(v, argparse.Namespace):
        return True
    inner = (v if isinstance(v, (list, tuple, set, frozenset)) else
             v.values() if isinstance(v, dict) else vars(v).values()
             if isinstance(getattr(v, "__dict__", None), dict) else ())
    return any(isinstance(x, argparse.Namespace) for x in inner)

def of_cli(v):
    return getattr(getattr(v, "__code__", None), "co_filename", "").startswith(CLI)

def spread(v):
    return v.values() if isinstance(v, dict) else v if isinstance(v, tuple) else (v,)

def profile(frame, event, arg):
    code = frame.f_code
    if event != "call" or not code.co_filename.startswith(PKG) or code.co_filename.startswith(CLI):
        return
    n = code.co_argcount + code.co_kwonlyargcount
    named = code.co_varnames[:n]
    star = code.co_varnames[n:n + bool(code.co_flags & 4) + bool(code.co_flags & 8)]
    given = frame.f_locals
    if not any(holds(given.get(k)) for k in named):
        if not any(holds(given.get(k)) for k in star):
            return
        if any(of_cli(v) for k in named + star for v in spread(given.get(k))):
            return  # handed on to a function of cli/
    where = os.path.relpath(code.co_filename, os.path.dirname(PKG[:-1]))
    found.add(f"{where}:{code.co_firstlineno}: {getattr(code, 'co_qualname', code.co_name)}")

threading.setprofile(profile)
sys.setprofile(profile)
try:
    exec(sys.argv[2])
finally:
    sys.setprofile(None)
    threading.setprofile(None)
print("--- called with a namespace:", *sorted(found), sep="\n")
"""


def _namespace_receivers(pkg: Path, code: str, cwd: Path) -> list[str]:
    r = subprocess.run([sys.executable, "-c", NAMESPACE_RECORDER, str(pkg), code],
                       capture_output=True, text=True, cwd=str(cwd), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.split("--- called with a namespace:\n")[-1].splitlines()


def test_no_function_outside_the_command_line_is_called_with_its_namespace(tmp_path):
    """The same rule, watched as ``mpidp train`` and ``mpidp predict`` run (in-process, one
    rank, tiny data): no function outside mpidp/cli is handed the parsed options."""
    pytest.importorskip("mpi4py")
    out = str(tmp_path)
    tiny = ["--dataset", "synthetic", "--n-samples", "256", "--n-features", "8"]
    code = ("from mpidp.cli.main import main\n"
            f"assert main(['train', *{tiny}, '--hidden', '8', '--epochs', '1', '--no-progress', "
            f"'--out', {out + '/t'!r}, '--checkpoint-dir', {out + '/c'!r}, "
            "'--checkpoint-every', '4']) == 0\n"
            f"assert main(['predict', '--model', {out + '/t'!r}, *{tiny}, "
            f"'--out', {out + '/p.npy'!r}]) == 0\n")
    offenders = _namespace_receivers(PKG, code, ROOT)
    assert offenders == [], "called with the command line's namespace:\n" + "\n".join(
        offenders)


def _mpi_methods() -> set[str]:
    """The capitalised methods of mpi4py's MPI objects (``Allreduce``, ``Split``, ``Wait``,
    ``Get_rank`` ...; not constants such as ``PROTOCOL``)."""
    MPI = pytest.importorskip("mpi4py.MPI")
    classes = (MPI.Comm, MPI.Intracomm, MPI.Intercomm, MPI.Topocomm, MPI.Cartcomm,
               MPI.Graphcomm, MPI.Distgraphcomm, MPI.Request, MPI.Prequest, MPI.Grequest,
               MPI.Message, MPI.Status, MPI.Win, MPI.File, MPI.Group, MPI.Datatype, MPI.Op,
               MPI.Info, MPI.Errhandler, MPI.Session)
    return {n for cls in classes for n in dir(cls) if n[:1].isupper() and not n.isupper()}


#: mpi4py's pickled (lower-case) communication methods: an MPI call on whatever receiver.
PICKLED = {"allgather", "allreduce", "alltoall", "bcast", "gather", "scatter", "reduce",
           "send", "recv", "isend", "irecv", "sendrecv", "barrier", "scan", "exscan", "ssend",
           "issend", "bsend", "ibsend", "probe", "iprobe", "mprobe", "improbe"}

#: mpidp's own methods that share a name with a pickled MPI call, by (module, the class the
#: call is made in, receiver, method). Each must still be called there (no stale entry).
OWN_METHODS = {
    # the strategy's exchange, Sync.reduce (mpidp.comm inside), and Compressed's override
    ("mpidp/parallel/sync.py", "Sync", "self", "reduce"),
    ("mpidp/parallel/compress.py", "Compressed", "self", "reduce"),
    # self.hierarchy: a mpidp.comm.NodeAllreduce; self.gather: a mpidp.comm.SharedReduce
    ("mpidp/parallel/sync.py", "Sync", "self.hierarchy", "allreduce"),
    ("mpidp/parallel/ps.py", "ParameterServer", "self.gather", "reduce"),
}


def _module_names(tree: ast.Module, rel: str) -> set[str]:
    """Names ``tree`` (the module at ``rel``) binds to modules: ``import x`` / ``import x as
    y``, and ``from P import m`` of a module ``m`` of mpidp (``from .. import comm as C``)."""
    names = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
             if isinstance(n, ast.Import) for a in n.names}
    package = Path(rel).parent
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            base = package.parents[n.level - 2] if n.level > 1 else package
            base = base / (n.module or "").replace(".", "/") if n.level else Path(
                (n.module or "").replace(".", "/"))
            names |= {a.asname or a.name for a in n.names
                      if (ROOT / base / f"{a.name}.py").exists() or (ROOT / base / a.name).is_dir()}
    return names


def _classes_around(tree: ast.Module) -> dict[int, str]:
    """``id(node) -> name`` of the innermost class each node of ``tree`` lies in."""
    out: dict[int, str] = {}

    def visit(node: ast.AST, cls: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, ast.ClassDef) else cls
            out[id(child)] = inner
            visit(child, inner)

    visit(tree, "")
    return out


def _mpi_calls(tree: ast.Module, text: str, methods: set[str], rel: str = "?"
               ) -> list[tuple[int, str]]:
    """``(line, what)`` for each MPI method ``tree`` (the module at ``rel``) reaches on an
    object: any use of a capitalised one (``x.Bcast(...)``, ``f = w.Allreduce``,
    ``before=comm.Barrier``), a call of a pickled one on any receiver (``self.dp.bcast(1)``)
    but mpidp's own (:data:`OWN_METHODS`), and ``getattr(x, "Split")``. A module's
    function (``threading.Lock()``, ``C.barrier(comm)``) is not a method."""
    modules, called, found = _module_names(tree, rel), set(), []
    classes = _classes_around(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            called.add(id(node.func))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value in methods | PICKLED):
            found.append((node.lineno, ast.get_source_segment(text, node)))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in modules:
            continue
        if node.attr not in methods and not (node.attr in PICKLED and id(node) in called):
            continue  # (cheap test first: a source segment costs a pass over the text)
        receiver = ast.get_source_segment(text, node.value) or ""
        own = (rel, classes.get(id(node), ""), receiver, node.attr) in OWN_METHODS
        if node.attr in methods or not own:
            found.append((node.lineno, f"{receiver}.{node.attr}"))
    return found


def _own_methods_unused(sources) -> list[tuple]:
    """The entries of :data:`OWN_METHODS` whose call is not in ``sources`` any more."""
    seen, attrs = set(), {entry[3] for entry in OWN_METHODS}
    for rel, tree, text in sources:
        classes = _classes_around(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in attrs):
                receiver = ast.get_source_segment(text, node.func.value) or ""
                seen.add((rel, classes.get(id(node.func), ""), receiver, node.func.attr))
    return sorted(OWN_METHODS - seen)


def test_no_module_outside_mpidp_comm_calls_mpi():
    """Every MPI call goes through a function of mpidp.comm (which watches for stalls and
    takes care of large counts)."""
    methods, sources = _mpi_methods(), _sources("comm")
    offenders = [f"{rel}:{line}: {call}" for rel, tree, text in sources
                 for line, call in _mpi_calls(tree, text, methods, rel)]
    assert offenders == [], "MPI called outside mpidp/comm:\n" + "\n".join(offenders)
    assert _own_methods_unused(sources) == [], "OWN_METHODS names calls that are gone"


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
    """The run layer (``mpidp/run/``) and the fit entry points take a few values and
    settings objects, not a long list of loose options: what a run does beyond its trainer
    and data travels in one ``RunSpec``. Constructors of trainers, strategies and
    ``mpidp.load`` keep their keyword arguments (each a property of that one object or
    read, as NumPy's or h5py's do); they are not threaded through other layers."""
    offenders = []
    for path in sorted((PKG / "run").glob("*.py")) + sorted((PKG / "parallel").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for line, name, n in _too_many_params(tree, only_fit=path.parent.name == "parallel"):
            offenders.append(f"{path.relative_to(ROOT)}:{line}: {name} takes {n}")
    assert offenders == [], f"more than {MAX_PARAMS} parameters:\n" + "\n".join(offenders)


def _measured_code_missing(bench: Path) -> list[str]:
    """The paths of ``bench``'s ``MEASURED_CODE`` (the code its figures depend on) that do
    not exist in the repository."""
    for node in ast.parse(bench.read_text()).body:
        if (isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "MEASURED_CODE" for t in node.targets)):
            return [p for p in ast.literal_eval(node.value) if not (ROOT / p).exists()]
    return []


# --- the command line's vocabulary stays in the command line ------------------------------

DECLARATIONS = "mpidp/parallel/modes.py"  # the modes' declarations: their --help notes


def _flags() -> set[str]:
    from mpidp.cli.parser import build_parser
    parser = build_parser()
    parsers = [parser, *parser._subparsers._group_actions[0].choices.values()]  # noqa: SLF001
    return {o for p in parsers for a in p._actions for o in a.option_strings  # noqa: SLF001
            if o.startswith("--") and o not in ("--help", "--version")}


def _library_modules() -> list[tuple[str, ast.Module]]:
    return [(rel, tree) for rel, tree, _ in _sources("cli") if rel != DECLARATIONS]


def _flag_spellings(tree: ast.Module, flags: set[str]) -> list[tuple[int, str]]:
    """``(line, flag)`` for each string in ``tree`` (docstrings too) that spells a flag."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for word in re.findall(r"--[a-z][a-z0-9-]*", node.value):
                if word in flags:
                    found.append((node.lineno, word))
    return found


def _mode_names_compared(tree: ast.Module, names: set[str]) -> list[tuple[int, str]]:
    """``(line, name)`` for each comparison in ``tree`` with a mode's name as a literal."""
    return [(node.lineno, c.value) for node in ast.walk(tree) if isinstance(node, ast.Compare)
            for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in names]


@pytest.mark.parametrize("rel,tree", _library_modules(), ids=lambda v: v if isinstance(v, str)
                         else "")
def test_no_flag_spelling_or_mode_name_below_the_command_line(rel, tree):
    """Library messages name a setting by its field (:func:`mpidp.errors.setting`); which
    mode code runs is asked of :mod:`mpidp.parallel.modes`, never of a name's spelling."""
    from mpidp.parallel.modes import MODES
    assert _flag_spellings(tree, _flags()) == []
    assert _mode_names_compared(tree, set(MODES)) == []


def test_the_vocabulary_checks_find_planted_spellings():
    tree = ast.parse('"""Use --bucket-mb."""\nif sync == "overlapped":\n    x = "--no-such"\n')
    assert _flag_spellings(tree, _flags()) == [(1, "--bucket-mb")]
    assert _mode_names_compared(tree, {"overlapped"}) == [(2, "overlapped")]


def test_benchmarks_name_code_that_exists():
    """A benchmark marks its figures "+dirty" by the state of the code it names: every
    path it names must exist, or a change there goes unnoticed."""
    missing = {b.name: m for b in sorted((ROOT / "benchmarks").glob("*.py"))
               if (m := _measured_code_missing(b))}
    assert missing == {}, missing


def test_the_longest_test_files_named_to_go_first_exist():
    """A renamed file would silently lose its place at the head of the queue."""
    from conftest import LONGEST_FIRST
    assert [name for name in LONGEST_FIRST if not (ROOT / "tests" / name).is_file()] == []


PLANTED = '''
import argparse
import threading
from argparse import Namespace

from .. import comm as C


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
        self.pipe.bcast(1)
        self.dp.allreduce(x)
        world.gather(3)
        f = self.world.Allreduce
        getattr(comm, "Split")(0, 0)
        self.reduce()
        self.reduce = "sum"
def fit_many(a, b, c, d, e, f, *rest): ...
class Public:
    def __init__(self, a, b, c, d, e, f, g): ...
    def small(self, a, b, c, d, e, f): ...
    def _private(self, a, b, c, d, e, f, g): ...
'''

#: Calls of mpidp's own methods (:data:`OWN_METHODS`) where they are allowed, and beside them
#: the same names on other receivers or in another class.
PLANTED_OWN = '''
class Sync:
    def exchange(self):
        self.reduce()
        self.hierarchy.allreduce()
        self.dp.reduce()
class Other:
    def exchange(self):
        self.reduce()
'''

#: A package in the layers' order with what it may and may not import (``path: code``).
PLANTED_TREE = {
    "__init__.py": "from ._lazy import exports\n__version__ = '1'\n"
                   "_LAZY = {'fit': '.parallel.fitting', 'nn': None}\n",
    "__main__.py": "from .cli import main\n",
    "_lazy.py": "def exports(): ...\n",
    "errors.py": "from .data import rows\n",  # the bottom importing a package
    "cli/__init__.py": "from .. import __version__, fit\nimport mpidp.nn\n",
    "parallel/__init__.py": "",
    "parallel/fitting.py": "from ..run import loop\nfrom ..comm import send\n",
    "run/__init__.py": "",
    "run/loop.py": "from .. import errors\nfrom ..data.rows import read\n",
    "data/__init__.py": "",
    "data/rows.py": "def read():\n    from ..run.loop import run\n",  # lazy: still a dependency
    "data/other.py": "from .. import fit\nfrom . import rows\n",  # fit is parallel's
    "comm/__init__.py": "def send(): ...\n",
    "nn/__init__.py": "import mpidp.comm\n",
    "extra/__init__.py": "",  # a package the order does not name
}

#: A package whose command line hands its namespace on: ``path: code``.
PLANTED_CLI = {
    "__init__.py": "",
    "run/__init__.py": "",
    "run/work.py": '''
def reads(ns, n):
    return ns.lr
def keeps(box):
    return box
def forwards(fn, *args):
    return fn(*args)
def hands_on(fn, *args, **kwargs):
    return fn(*args, **kwargs)
def plain(n):
    return n
''',
    "cli/__init__.py": '''
import argparse
from ..run.work import forwards, hands_on, keeps, plain, reads
class Box:
    def __init__(self, ns):
        self.ns = ns
def own(ns, scale=1):
    return ns.lr * scale
def go():
    ns = argparse.Namespace(lr=0.1)
    reads(ns, 1), keeps(Box(ns)), forwards(vars, ns), plain(ns.lr)
    hands_on(own, ns), hands_on(own, ns=ns, scale=2)
''',
}


def _plant(root: Path, files: dict[str, str]) -> Path:
    for rel, code in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(code)
    return root


def test_layout_checks_find_planted_violations(tmp_path):
    """The checks above are not vacuous: each finds what is planted here."""
    tree = ast.parse(PLANTED)
    uses = [what for _, what in _namespace_uses(tree)]
    assert uses == ["imports argparse", "imports argparse", "parameter args: ?",
                    "parameter opts: 'argparse.Namespace'"], uses
    calls = sorted(call for _, call in _mpi_calls(tree, PLANTED, _mpi_methods(),
                                                  "mpidp/parallel/planted.py"))
    assert calls == ["comm.Barrier", "comm.Ibcast", 'getattr(comm, "Split")', "self.comm.bcast",
                     "self.dp.allreduce", "self.leaders.Split", "self.pipe.bcast",
                     "self.reduce", "self.world.Allreduce", "world.gather"], calls
    own = ast.parse(PLANTED_OWN)
    calls = sorted(c for _, c in _mpi_calls(own, PLANTED_OWN, set(), "mpidp/parallel/sync.py"))
    assert calls == ["self.dp.reduce", "self.reduce"], calls  # the one in Other
    unused = _own_methods_unused([("mpidp/parallel/sync.py", own, PLANTED_OWN)])
    assert unused == sorted(OWN_METHODS - {("mpidp/parallel/sync.py", "Sync", "self", "reduce"),
                                           ("mpidp/parallel/sync.py", "Sync", "self.hierarchy",
                                            "allreduce")}), unused
    many = [name for _, name, _ in _too_many_params(tree, only_fit=False)]
    assert many == ["fit_many", "Public.__init__"], many
    assert [n for _, n, _ in _too_many_params(tree, only_fit=True)] == ["fit_many"]
    layers = _layer_violations(_plant(tmp_path / "layers" / "mpidp", PLANTED_TREE))
    assert sorted(layers) == [
        "mpidp.extra: package not in LAYERS",
        "mpidp/data/other.py:1: mpidp.data.other -> mpidp.parallel.fitting",
        "mpidp/data/rows.py:2: mpidp.data.rows -> mpidp.run.loop",
        "mpidp/errors.py:1: mpidp.errors -> mpidp.data.rows",
        "mpidp/nn/__init__.py:1: mpidp.nn -> mpidp.comm"], layers
    cli = _plant(tmp_path / "cli" / "planted", PLANTED_CLI)
    got = _namespace_receivers(cli, "from planted.cli import go\ngo()", cli.parent)
    assert [x.rpartition(": ")[2] for x in got] == ["reads", "keeps", "forwards"], got
    bench = tmp_path / "bench.py"
    bench.write_text('MEASURED_CODE = ("mpidp/data.py", "mpidp/comm", "mpidp/data")\n')
    assert _measured_code_missing(bench) == ["mpidp/data.py"]
