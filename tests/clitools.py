"""Run mpidp jobs under mpiexec in a subprocess, always with a timeout (a hang = a failure)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    assert found, "mpiexec not found: install the 'mpi' extra (the mpich wheel) or a system MPI"
    return found


def run_mpi(n: int, *args: str, cwd: Path | str | None = None, timeout: float = 120,
            module: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """``mpiexec -n n python [-m mpidp] args...``; raises if it outlives ``timeout`` seconds."""
    cmd = [mpiexec(), "-n", str(n), sys.executable, *(["-m", "mpidp"] if module else []), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(cmd, cwd=cwd or ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)
