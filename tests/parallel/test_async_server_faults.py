"""Faults planned on the asynchronous parameter server itself (rank 0, whose steps are the
pushes it has served) fire, and end the job the way they do on a worker."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from helpers import ROOT, mpiexec

ARGS = ["train", "--dataset", "synthetic", "--n-samples", "480", "--n-features", "8",
        "--epochs", "2", "--batch-size", "32", "--hidden", "12,8", "--no-progress",
        "--sync", "async-ps", "--watchdog", "2"]

FAULTS = [  # fault, exit status (None: any but 0), what stderr says
    ("kill@0:0", None, ""),
    ("raise@0:3", None, "injected fault on rank 0 at step 3"),
    ("hang@0:5", 3, "stalled rank(s) [0]"),
    ("nan@0:4", 2, "non-finite loss or gradient at step 4"),
]


def test_a_fault_on_the_async_server_ends_the_job(tmp_path):
    """One job per fault, side by side (their waits overlap)."""
    jobs = []
    for i, (fault, _, _) in enumerate(FAULTS):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MPIDP_FAULT": fault}
        jobs.append((subprocess.Popen(
            [mpiexec(), "-n", "3", sys.executable, "-m", "mpidp", *ARGS, "--out",
             str(tmp_path / f"out{i}")], cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL), time.monotonic()))
    try:
        for i, ((fault, code, said), (job, t0)) in enumerate(zip(FAULTS, jobs)):
            _, err = job.communicate(timeout=max(1.0, t0 + 120 - time.monotonic()))
            assert job.returncode != 0 and (code is None or job.returncode == code), (
                fault, job.returncode, err[-2000:])
            assert said in err, (fault, err[-2000:])
            assert time.monotonic() - t0 < 40, fault
            assert not (tmp_path / f"out{i}" / "model.npz").exists()
    finally:
        for job, _ in jobs:
            if job.poll() is None:
                job.kill()
                job.communicate()
