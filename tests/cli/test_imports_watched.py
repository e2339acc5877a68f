"""``--import MODULE`` runs under the watchdog: a module that blocks in MPI, loops or sleeps
on one rank ends the job with the watchdog's exit status within about the timeout, the
stalled rank and the module named; one that calls
``MPI.Finalize()`` or exits on one rank is named in a one-line error."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import run_here, run_mpi

from mpidp.comm.watchdog import EXIT_CODE

ON_RANK_1 = "from mpi4py import MPI\nimport sys\nif MPI.COMM_WORLD.rank == 1:\n    {}\n"
STALLS = {"blocks": "MPI.COMM_WORLD.Barrier()", "loops": "while True: pass",
          "sleeps": "import time; time.sleep(1000)"}
LEAVES = {"finalizes": ("MPI.Finalize()", "RuntimeError: it calls MPI.Finalize(), which "
                        "would leave the other ranks waiting"),
          "exits": ("sys.exit(4)", "SystemExit: 4")}
TRAIN = ["train", "--dataset", "synthetic", "--n-samples", "64", "--epochs", "1",
         "--no-progress", "-q"]


def _stalled(tmp_path, how: str) -> tuple:
    """A job whose --import stalls rank 1 ``how``: the module's path and the job's result."""
    (tmp_path / "stall.py").write_text(ON_RANK_1.format(STALLS[how]))
    return tmp_path / "stall.py", run_mpi(2, *TRAIN, "--watchdog", "3", "--import",
                                          str(tmp_path / "stall.py"), "--out",
                                          str(tmp_path / "o"), timeout=60)


@pytest.fixture(scope="module")
def stalled(tmp_path_factory) -> dict:
    """The jobs of every way to stall, run side by side (their waits for the watchdog overlap):
    how -> the future of :func:`_stalled`'s result."""
    with ThreadPoolExecutor(len(STALLS)) as pool:
        yield {how: pool.submit(_stalled, tmp_path_factory.mktemp(how), how) for how in STALLS}


@pytest.mark.parametrize("how", sorted(STALLS))
def test_a_module_that_stalls_one_rank_is_named_by_the_watchdog(stalled, how):
    module, r = stalled[how].result()
    assert r.returncode == EXIT_CODE, r.stderr[-2000:]
    assert "stalled rank(s) [1]" in r.stderr, r.stderr[-2000:]
    said = re.search(rf"rank 1: running user code \(importing --import "
                     rf"{re.escape(str(module))}\) for ([0-9.]+)s", r.stderr)
    assert said and float(said[1]) < 10, r.stderr[-2000:]  # one timeout, not ten


@pytest.mark.parametrize("how", sorted(LEAVES))
def test_a_module_that_leaves_mpi_on_one_rank_is_named(tmp_path, how):
    """By a job of 2 ranks for Finalize; the exit, caught alike by the import of every rank
    and told by the same one line, in this process (rank 0 of one, the module exiting there)."""
    code, why = LEAVES[how]
    if how == "exits":
        from mpidp.cli.imports import import_modules
        (tmp_path / "leave.py").write_text("import sys\n" + code + "\n")
        with pytest.raises(ValueError) as err:
            import_modules([str(tmp_path / "leave.py")])
        assert str(err.value) == f"--import {tmp_path / 'leave.py'}: cannot import it ({why})"
        return
    (tmp_path / "leave.py").write_text(ON_RANK_1.format(code))
    r = run_mpi(2, *TRAIN, "--import", str(tmp_path / "leave.py"),
                "--out", str(tmp_path / "o"), timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert lines == [f"mpidp: error: --import {tmp_path / 'leave.py'}: cannot import it "
                     f"({why}) (on rank 1)"], r.stderr[-2000:]


def test_finalize_is_refused_only_while_a_users_module_runs():
    from mpi4py import MPI

    from mpidp import comm as C
    real = MPI.Finalize
    with C.user_code("importing x"), pytest.raises(RuntimeError, match="MPI.Finalize"):
        MPI.Finalize()
    assert MPI.Finalize is real


def test_a_module_that_stalls_one_rank_under_predict_is_named_by_the_watchdog(tmp_path, capsys):
    """The model to predict with is trained in this process (one rank): no job for it."""
    (tmp_path / "stall.py").write_text(ON_RANK_1.format(STALLS["blocks"]))
    r = run_here(capsys, *TRAIN, "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_mpi(2, "predict", "--model", str(tmp_path / "o"), "--dataset", "synthetic",
                "--n-samples", "64", "--out", str(tmp_path / "p.npy"), "--watchdog", "0.25",
                "--import", str(tmp_path / "stall.py"), timeout=60)
    assert r.returncode == EXIT_CODE, r.stderr[-2000:]
    assert f"rank 1: running user code (importing --import {tmp_path / 'stall.py'})" in r.stderr
