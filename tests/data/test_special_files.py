"""A data set that is no regular file (a FIFO, a device such as /dev/zero) is refused at
once, naming it, in every way of reading it: never a job that waits or reads without end."""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers import run_mpi


def _fifo(path):
    os.mkfifo(path)
    return str(path)


JOBS = {("fifo", "scatter"), ("fifo in a folder", "local"), ("device", "pipeline"),
        ("fifo in a folder", "fingerprint")}  # (kind, how) refused by a job of 2 ranks


def _here(capsys, *argv: str) -> subprocess.CompletedProcess:
    """``mpidp ARGV`` run in this process, a job of one rank, reported as run_mpi reports a
    job: for refusals that do not hang on the number of ranks. mpidp's log handler is made
    afresh (on this test's captured stdout) and the logger restored after."""
    from mpidp.cli.main import main
    from mpidp.observe.watch import log
    kept = log.handlers[:], log.propagate, log.level
    log.handlers.clear()
    capsys.readouterr()
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    finally:
        log.handlers[:], log.propagate = kept[:2]
        log.setLevel(kept[2])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)


@pytest.mark.parametrize("how", [["--distribute", "scatter"], ["--distribute", "local"],
                                 ["--parallel", "pipeline"],
                                 ["--checkpoint-dir", "{tmp}/ck"]],
                         ids=["scatter", "local", "pipeline", "fingerprint"])
@pytest.mark.parametrize("kind", ["fifo", "fifo in a folder", "device"])
def test_a_dataset_that_is_no_regular_file_is_refused_at_once(tmp_path, capsys, kind, how):
    """Each way of reading by a job of 2 ranks for one kind of file; the other pairs as a job
    of one rank in this process."""
    if kind == "fifo":
        dataset, named, what = _fifo(tmp_path / "d.npz"), str(tmp_path / "d.npz"), "a FIFO"
    elif kind == "device":
        dataset, named, what = "/dev/zero", "/dev/zero", "a character device"
    else:
        (tmp_path / "d").mkdir()
        _fifo(tmp_path / "d" / "X.npy")
        dataset, named, what = str(tmp_path / "d"), str(tmp_path / "d" / "X.npy"), "a FIFO"
    way = "fingerprint" if how[0] == "--checkpoint-dir" else how[1]
    how = [a.replace("{tmp}", str(tmp_path)) for a in how]
    args = ["train", "--dataset", dataset, *how, "--out", str(tmp_path / "o")]
    r = run_mpi(2, *args, timeout=60) if (kind, way) in JOBS else _here(capsys, *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{named} is {what}" in r.stderr and r.stderr.count("mpidp: error:") == 1


def test_predict_refuses_a_device_too(tmp_path):
    r = run_mpi(1, "train", "--epochs", "1", "--out", str(tmp_path / "m"), "-q")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_mpi(2, "predict", "--model", str(tmp_path / "m"), "--dataset", "/dev/zero",
                "--out", str(tmp_path / "p.npy"), timeout=60)
    assert r.returncode == 2 and "/dev/zero is a character device" in r.stderr, r.stderr
