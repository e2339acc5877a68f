"""Shared fixtures for tests run as ``mpiexec -n N python -m pytest --with-mpi tests/mpi``.

A test that fails on one rank only is dangerous: that rank moves on and its next
collective pairs with a different one on the other ranks. Every assertion that might
differ between ranks goes through :func:`all_ranks` first, so all ranks pass or all fail.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import numpy as np
import pytest
from mpi4py import MPI


@pytest.hookimpl(trylast=True)  # after the terminal plugin has set up its reporter
def pytest_configure(config):
    """One readable report per job: rank 0's. The other ranks print nothing unless they
    fail (their exit status still counts; MPIDP_TEST_EVERY_RANK=1 shows every rank)."""
    if MPI.COMM_WORLD.rank == 0 or os.environ.get("MPIDP_TEST_EVERY_RANK") == "1":
        return
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        config.pluginmanager.unregister(reporter)


def pytest_sessionfinish(session, exitstatus):
    rank = MPI.COMM_WORLD.rank
    if rank > 0 and exitstatus not in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        sys.stderr.write(f"[rank {rank}] pytest failed (exit status {int(exitstatus)}, "
                         f"{session.testsfailed} failed); MPIDP_TEST_EVERY_RANK=1 shows "
                         f"every rank's report\n")


@pytest.fixture
def comm():
    return MPI.COMM_WORLD


@pytest.fixture
def shared_tmp(comm):
    """A folder made by rank 0 and known to every rank (all ranks share this filesystem)."""
    path = tempfile.mkdtemp(prefix="mpidp-test-") if comm.rank == 0 else None
    path = comm.bcast(path, root=0)
    yield path
    comm.Barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def max_abs_diff():
    def diff(a, b):
        return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))
    return diff
