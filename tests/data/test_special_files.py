"""A data set that is no regular file (a FIFO, a device such as /dev/zero) is refused at
once, naming it, in every way of reading it: never a job that waits or reads without end."""

from __future__ import annotations

import os

import pytest
from helpers import run_here, run_mpi


def _fifo(path):
    os.mkfifo(path)
    return str(path)


#: (kind, how) refused by a job of 2 ranks: a FIFO or a device named by --dataset is refused
#: before MPI, alike in every way of reading (one job shows it; tests/cli/test_places.py
#: checks it in this process for every path option); a FIFO in a folder is found where the
#: files are read: by every rank (local), by the checkpoint's fingerprint
JOBS = {("device", "pipeline"), ("fifo in a folder", "local"),
        ("fifo in a folder", "fingerprint")}


@pytest.mark.parametrize("how", [["--distribute", "scatter"], ["--distribute", "local"],
                                 ["--parallel", "pipeline"],
                                 ["--checkpoint-dir", "{tmp}/ck"]],
                         ids=["scatter", "local", "pipeline", "fingerprint"])
@pytest.mark.parametrize("kind", ["fifo", "fifo in a folder", "device"])
def test_a_dataset_that_is_no_regular_file_is_refused_at_once(tmp_path, capsys, kind, how):
    """The pairs of :data:`JOBS` by a job of 2 ranks; the other pairs as a job of one rank in
    this process."""
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
    r = run_mpi(2, *args, timeout=60) if (kind, way) in JOBS else run_here(capsys, *args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"{named} is {what}" in r.stderr and r.stderr.count("mpidp: error:") == 1


def test_predict_refuses_a_device_too(tmp_path, capsys):
    """Before MPI and before the model is read (its folder is empty): in this process."""
    (tmp_path / "m").mkdir()
    r = run_here(capsys, "predict", "--model", str(tmp_path / "m"), "--dataset", "/dev/zero",
                 "--out", str(tmp_path / "p.npy"))
    assert r.returncode == 2 and "/dev/zero is a character device" in r.stderr, r.stderr
    assert r.stderr.count("mpidp: error:") == 1 and not (tmp_path / "p.npy").exists()
