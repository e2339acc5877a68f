"""``make test``'s MPI runs read like one report per rank count: rank 0's, and a line from
any other rank only when it fails."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from helpers import ROOT

MPIEXEC = Path(sys.executable).with_name("mpiexec")
PROBE = '''
from mpi4py import MPI

def test_passes():
    assert True

def test_fails_on_the_last_rank_only():
    assert MPI.COMM_WORLD.rank != MPI.COMM_WORLD.size - 1 or {fail}
'''


def _run(tmp_path: Path, fail: bool, n: int = 2) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "tests" / "mpi" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_probe.py").write_text(PROBE.format(fail=not fail))
    return subprocess.run([str(MPIEXEC), "-n", str(n), sys.executable, "-m", "pytest",
                           "--with-mpi", "-p", "no:cacheprovider", "-c", "/dev/null",
                           str(tmp_path)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)


def test_one_header_and_one_summary_per_job(tmp_path):
    r = _run(tmp_path, fail=False, n=3)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    assert out.count("test session starts") == 1 and out.count("MPI Information") == 1, out
    assert out.count("2 passed") == 1 and "[rank" not in out, out


def test_a_failure_on_another_rank_is_still_seen(tmp_path):
    r = _run(tmp_path, fail=True)
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "[rank 1] pytest failed (exit status 1, 1 failed)" in out, out
