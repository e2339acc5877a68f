"""The tests' own guard against a hang: a job past its timeout ends, every process of it."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from helpers import run_mpi

SLEEPER = """\
import sys, time
from mpi4py import MPI
sys.stdout.write(f"rank{MPI.COMM_WORLD.rank}-started\\n")  # one write: lines do not mix
sys.stdout.flush()
time.sleep(300)
"""


def _running(script: Path) -> list[int]:
    """Pids of the processes whose command line names ``script`` (found without the token)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if str(script).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_job_past_its_timeout_is_killed_with_every_rank(tmp_path):
    """``run_mpi`` past its timeout raises with the output so far and leaves no rank behind
    (Open MPI's ranks outlive a killed launcher, and a hung one would spin on a core)."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        run_mpi(2, str(script), module=False, timeout=6)
    out = timed_out.value.stdout
    assert "rank0-started" in out and "rank1-started" in out, out
    deadline = time.monotonic() + 10
    while (left := _running(script)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes of the job left running: {left}"
