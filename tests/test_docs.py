"""The README and docs/ tell the truth: their commands run as written, their links stay
inside the repository and resolve, and they speak to users, not about how mpidp was made.

Convention (stated in docs/index.md): commands in ```bash blocks run as written from the
repository root once ``.venv`` is built; ```sh blocks are for other machines and ```text
blocks show output. Every ```bash command is run here, unless :data:`NOT_RUN` lists it
with the reason; a training command here runs at most :data:`EPOCHS` epochs, or one more
than its warmup (each epoch runs the same code; a shown run's length is for its reader).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

# Commands shown in ```bash blocks that this test does not run, and why.
NOT_RUN = {
    "make demo": "tests/cli/test_train.py runs its arguments; the README shows the same command",
    "make test": "the whole test suite, this file included",
    "make bench": "benchmark: minutes of exclusive machine time",
    "make bench-sync": "benchmark: about 17 minutes",
    "make bench-partition": "benchmark: minutes",
    "make bench-parallel": "benchmark: minutes",
    "make bench-multihost": "benchmark: needs root",
    "make bench-network": "benchmark: needs root",
    "make bench-large": "benchmark: needs about 10 GB of RAM",
}

# Words about how the project was made, and places outside the repository.
FORBIDDEN = [r"\bissues?\b", r"\bsessions?\b", r"\bprevious(ly)?\b", r"\bearlier versions?\b",
             r"\bused to\b", r"\bTODO\b", r"\bFIXME\b", r"\bdevelopment\b", r"\.\./shared",
             r"(?-i:\bDESIGN\.md|\bSTYLE\.md)", r"/work/", r"https?://", r"\bwww\."]

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```\s*$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _blocks(path: Path) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block of ``path``, in order."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def _commands(body: str) -> list[str]:
    """The shell commands of a block: continuation lines joined, comments and blanks dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    out = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append(" ".join(shlex.quote(w) for w in words))
    return out


def _bash_blocks() -> list[tuple[Path, int, list[str]]]:
    found = []
    for path in PAGES:
        for i, (lang, body) in enumerate(_blocks(path)):
            if lang == "bash":
                found.append((path, i, _commands(body)))
    return found


def _slug(heading: str) -> str:
    """The anchor a Markdown renderer gives a heading: lower case, punctuation dropped,
    spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


# ---------------------------------------------------------------------------- static checks

def test_readme_first_commands_are_make_demo_and_make_test():
    lang, body = _blocks(README)[0]
    assert _commands(body) == ["make demo", "make test"], body


def test_readme_stays_a_guide():
    n = len(README.read_text().splitlines())
    assert n < 350, f"README.md has {n} lines; move detail into docs/"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_words_about_how_it_was_made_nor_places_outside(path):
    text = path.read_text()
    hits = [(pat, text.count("\n", 0, m.start()) + 1, m.group(0))
            for pat in FORBIDDEN for m in re.finditer(pat, text, re.I)]
    assert hits == [], f"{path.name}: (pattern, line, text) {hits}"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repository(path):
    bad = []
    for target in LINK.findall(path.read_text()):
        file_part, _, anchor = target.partition("#")
        if re.match(r"^[a-z][a-z0-9+.-]*:", file_part, re.I) or target.startswith(("/", "//")):
            bad.append(f"{target}: not a relative link")
            continue
        dest = (path.parent / file_part).resolve() if file_part else path
        if ROOT not in dest.parents and dest != ROOT:
            bad.append(f"{target}: outside the repository")
        elif not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert bad == [], f"{path.name}: {bad}"


def _section(path: Path, heading: str) -> str:
    text = path.read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


@pytest.mark.parametrize("path", [README, ROOT / "docs" / "design.md"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_layout_names_every_module_and_only_modules_that_exist(path):
    """The Layout section lists each top-level module of mpidp/ and each subpackage (the
    design's table: every module, in its package's row), and every ``name.py`` it
    mentions exists in the repository."""
    layout = _section(path, "Layout")
    pkg = ROOT / "mpidp"
    wanted = [f"{p.name}" for p in pkg.glob("*.py") if not p.name.startswith("__")]
    wanted += [f"{p.name}/" for p in pkg.iterdir() if (p / "__init__.py").exists()]
    missing = [w for w in wanted if w not in layout]
    if path != README:  # every module named in its package's row
        rows = {m.group(1): line for line in layout.splitlines()
                for m in [re.match(r"^\| `mpidp/(\w+)/`", line)] if m}
        missing += [f"{p.parent.name}/{p.name}" for p in sorted(pkg.glob("*/*.py"))
                    if p.name != "__init__.py"
                    and f"`{p.name}`" not in rows.get(p.parent.name, "")
                    and f"`{p.stem}`" not in rows.get(p.parent.name, "")]
    existing = {p.name for d in ("mpidp", "tests", "benchmarks", "examples")
                for p in (ROOT / d).rglob("*.py")}
    stale = sorted({n for n in re.findall(r"\b(\w+\.py)\b", layout)} - existing)
    assert (missing, stale) == ([], []), f"{path.name} Layout: not listed {missing}, gone {stale}"


def test_docs_index_links_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    linked = {t.partition("#")[0] for t in LINK.findall(index)}
    missing = [p.name for p in PAGES[1:] if p.name != "index.md" and p.name not in linked]
    assert missing == [], f"docs/index.md does not link {missing}"


def test_not_run_list_names_only_commands_shown():
    shown = {c for _, _, cmds in _bash_blocks() for c in cmds}
    assert set(NOT_RUN) <= shown, f"NOT_RUN lists commands no page shows: {set(NOT_RUN) - shown}"


def test_training_commands_are_cut_to_a_few_epochs():
    assert _short("mpidp train --out o") == f"mpidp train --out o --epochs {EPOCHS}"
    assert _short("mpidp train --epochs 30 --out 'a b'") == f"mpidp train --epochs {EPOCHS} --out 'a b'"
    assert _short("mpidp train --epochs 1") == "mpidp train --epochs 1"
    assert _short("mpidp train --epochs 9 --warmup-epochs 2") == (
        "mpidp train --epochs 3 --warmup-epochs 2")
    assert _short("mpidp train --epochs 9 --resume") == "mpidp train --epochs 9 --resume"
    assert _short("mpidp predict --out x") == "mpidp predict --out x"


def test_command_parser_joins_continuations_and_drops_comments():
    body = "make demo    # builds .venv\n\nrun --a 1 \\\n    --b 'x y'  # note\n"
    assert _commands(body) == ["make demo", "run --a 1 --b 'x y'"]


# ---------------------------------------------------------------------------- running them

def _claims(command: str) -> list[str]:
    """Files a command says it writes (relative to where it runs)."""
    words = shlex.split(command)

    def value(opt: str) -> str | None:
        return words[words.index(opt) + 1] if opt in words[:-1] else None

    if "mpidp" in words and "train" in words:
        out = value("--out") or "out"
        files = [f"{out}/metrics.json", f"{out}/model.npz"]
        files += [f for f in [value("--trace")] if f]
        return files
    if "mpidp" in words and "predict" in words:
        return [value("--out")]
    if "mpidp" in words and "model" in words and value("--out"):
        return [f"{value('--out')}/model.json"]
    return []


EPOCHS = 2


def _short(command: str) -> str:
    """``command`` with a training run cut to :data:`EPOCHS` epochs (the default is 10; two
    show that it learns), or one more than its warmup; a resumed run keeps its epochs."""
    words = shlex.split(command)
    if not ("mpidp" in words and "train" in words) or "--resume" in words:
        return command
    value = lambda flag: float(words[words.index(flag) + 1]) if flag in words[:-1] else 0
    epochs = max(EPOCHS, int(value("--warmup-epochs")) + 1)
    if "--epochs" not in words:
        return f"{command} --epochs {epochs}"
    at = words.index("--epochs") + 1
    words[at] = str(min(int(words[at]), epochs))
    return shlex.join(words)


def _ranks(command: str) -> int | None:
    words = shlex.split(command)
    return int(words[words.index("-n") + 1]) if "-n" in words[:-1] and "mpidp" in words else None


def _workdir(tmp_path: Path) -> Path:
    """A folder that looks like the repository root (its entries linked), so that commands
    can write ``out/`` and ``params.npy`` without touching the checkout."""
    for entry in ROOT.iterdir():
        if entry.name not in {"out", ".git", ".pytest_cache", ".hypothesis", "params.npy"}:
            (tmp_path / entry.name).symlink_to(entry)
    return tmp_path


RUNNABLE = [(p, i, cmds) for p, i, cmds in _bash_blocks()
            if any(c not in NOT_RUN for c in cmds)]


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run one shell command in ``cwd``; on a hang, kill it with every process it started."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MPIDP_FAULT")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.Popen(["bash", "-c", "set -euo pipefail\n" + command], cwd=cwd, env=env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # bash, mpiexec and the ranks
        output, _ = proc.communicate()
        pytest.fail(f"{command!r} still running after 600 s:\n{output[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, output)


@pytest.mark.slow
@pytest.mark.parametrize("path,index,commands", RUNNABLE,
                         ids=[f"{p.relative_to(ROOT)}:block{i}" for p, i, _ in RUNNABLE])
def test_shown_commands_run_and_write_what_they_claim(tmp_path, path, index, commands):
    """The commands of one block, in order, in one folder (a later one may read what an
    earlier one wrote); each must exit 0 and write the files it claims."""
    if not (ROOT / ".venv" / "bin" / "python").exists():
        pytest.skip("the commands use .venv: build it with `make install`")
    work = _workdir(tmp_path)
    for command in (c for c in commands if c not in NOT_RUN):
        claims = _claims(command)
        for name in claims:
            (work / name).unlink(missing_ok=True)
        r = _run(_short(command), work)
        assert r.returncode == 0, f"{path.name} block {index}: {command!r} failed:\n{r.stdout[-3000:]}"
        for name in claims:
            assert (work / name).is_file(), f"{command!r} did not write {name}"
        if claims and claims[0].endswith("metrics.json"):
            metrics = json.loads((work / claims[0]).read_text())
            assert metrics["world_size"] == _ranks(command), command
            _assert_it_learned(command, metrics["history"])


def _assert_it_learned(command: str, history: list[dict]) -> None:
    """A shown training command trains visibly well: over two or more epochs the loss
    falls and the test accuracy does not (it rises, or it is already at its best)."""
    if len(history) < 2:
        return
    first, last = history[0], history[-1]
    assert last["loss"] < first["loss"], f"{command!r}: loss {first['loss']} -> {last['loss']}"
    if first.get("test_accuracy") is not None and last.get("test_accuracy") is not None:
        assert last["test_accuracy"] >= first["test_accuracy"], (
            f"{command!r}: test accuracy {first['test_accuracy']} -> {last['test_accuracy']}")

