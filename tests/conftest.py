"""Shared test fixtures for the tests that launch their own ``mpiexec`` jobs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHM = Path("/dev/shm")


def _shm_in_use() -> set[str]:
    """Names of the files in /dev/shm that some live process has mapped or open."""
    names: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    names.add(line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    names.add(target[len("/dev/shm/"):])
        except OSError:  # the process ended, or is not ours to read
            continue
    return names


@pytest.fixture(autouse=True)
def _remove_shm_left_by_killed_jobs():
    """Jobs that a test kills or aborts on purpose leave the MPI library's shared-memory files in
    /dev/shm (RAM), about 13 per run of the suite. After each test, remove the ones it
    created that no live process still uses. Not inside MPI ranks (tests/mpi)."""
    if not SHM.is_dir() or "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        yield
        return
    segments = lambda: [p for pattern in ("mpich_shm_*", "sm_segment.*", "vader_segment.*")
                        for p in SHM.glob(pattern)]  # MPICH's and Open MPI's
    before = {p.name for p in segments()}
    yield
    new = [p for p in segments() if p.name not in before]
    if new:
        in_use = _shm_in_use()
        for p in new:
            if p.name not in in_use:
                p.unlink(missing_ok=True)


#: The files whose tests take longest (mpiexec jobs, watchdog and signal waits; measured on
#: 2 cores), longest first. pytest-xdist hands whole files to its workers in collection
#: order (``--dist loadfile --no-loadscope-reorder``): these go first, and the many short
#: files keep both workers busy to the end instead of one waiting on a long file.
#: The two files that start many jobs at once (the mode matrix and the clean ends' waiting
#: jobs) do not start together: at once, the load stretched a watchdog job past its limit.
LONGEST_FIRST = ("parallel/test_modes.py", "bench/test_bench_compare.py", "cli/test_clean_ends.py",
                 "test_docs.py", "cli/test_train.py", "test_multihost.py",
                 "bench/test_bench_network.py", "cli/test_defaults.py", "run/test_faults.py",
                 "cli/test_sweep.py", "parallel/test_compress.py", "bench/test_bench_smoke.py",
                 "cli/test_train_partition.py", "cli/test_train_pipeline.py",
                 "cli/test_validation.py", "cli/test_imports_watched.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    here = Path(__file__).parent
    name = lambda item: item.path.relative_to(here).as_posix() if item.path.is_relative_to(
        here) else ""  # an item from elsewhere (a doctest in mpidp/) keeps its place
    items.sort(key=lambda item: first.get(name(item), len(first)))


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="skip every test that starts a process (mpiexec jobs, the command "
                     "line in a subprocess): the loop to run after each edit (make test-fast)")


def pytest_configure(config):
    if config.getoption("--fast", default=False):
        import subprocess

        def refuse(*args, **kwargs):
            pytest.skip("starts a process (not with --fast)", allow_module_level=True)

        subprocess.Popen.__init__ = refuse
