"""Faults planned on the asynchronous parameter server itself (rank 0, whose steps are the
pushes it has served) fire, and end the job the way they do on a worker."""

from __future__ import annotations

import time

import pytest
from helpers import run_mpi

ARGS = ["train", "--dataset", "synthetic", "--n-samples", "480", "--n-features", "8",
        "--epochs", "2", "--batch-size", "32", "--hidden", "12,8", "--no-progress",
        "--sync", "async-ps", "--watchdog", "2"]


@pytest.mark.parametrize("fault,code,said", [
    ("kill@0:0", None, ""),
    ("raise@0:3", None, "injected fault on rank 0 at step 3"),
    ("hang@0:5", 3, "stalled rank(s) [0]"),
    ("nan@0:4", 2, "non-finite loss or gradient at step 4"),
])
def test_a_fault_on_the_async_server_ends_the_job(tmp_path, fault, code, said):
    t = time.monotonic()
    r = run_mpi(3, *ARGS, "--out", str(tmp_path / "out"), env={"MPIDP_FAULT": fault},
                timeout=120)
    assert r.returncode != 0 and (code is None or r.returncode == code), (r.returncode,
                                                                          r.stderr[-2000:])
    assert said in r.stderr, r.stderr[-2000:]
    assert time.monotonic() - t < 40
    assert not (tmp_path / "out" / "model.npz").exists()
