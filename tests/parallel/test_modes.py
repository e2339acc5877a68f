"""Every guarantee in every mode: a mode x guarantee matrix of real ``mpidp train`` jobs.

Modes: each ``--sync`` strategy, ``async-ps``, pipelines (both schedules), the hybrid, and
the node-aware allreduce (two nodes of two ranks simulated on this host; the faulty rank 1
is not its node's leader, which waits for it in shared memory).
Guarantees: an exception on one rank ends the job; a stalled rank is named by the
watchdog; a NaN with the default policy fails the run without writing a model (and the
last checkpoint stays good). Which option each mode refuses is checked without MPI, for every
option in every mode (tests/cli/test_options.py); one job here shows that a refusal ends a job
on every rank, said once.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from helpers import run_mpi

ARGS = ["train", "--dataset", "synthetic", "--n-samples", "480", "--n-features", "8",
        "--dtype", "float64", "--epochs", "2", "--batch-size", "32", "--hidden", "12,8",
        "--no-progress"]

# mode -> (ranks, its flags)
MODES = {
    "allreduce": (2, ["--sync", "allreduce"]),
    "per-layer": (2, ["--sync", "per-layer"]),
    "overlapped": (2, ["--sync", "overlapped"]),
    "compressed": (2, ["--sync", "compressed"]),
    "ps": (2, ["--sync", "ps"]),
    "sharded-ps": (2, ["--sync", "sharded-ps"]),
    "accumulate": (2, ["--sync", "accumulate", "--sync-every", "2"]),
    "local-sgd": (2, ["--sync", "local-sgd", "--sync-every", "2"]),
    "auto": (2, ["--sync", "auto"]),
    "async-ps": (3, ["--sync", "async-ps"]),
    "pipeline-gpipe": (3, ["--parallel", "pipeline", "--schedule", "gpipe"]),
    "pipeline-1f1b": (3, ["--parallel", "pipeline", "--schedule", "1f1b"]),
    "hybrid": (4, ["--parallel", "hybrid"]),
    "node-aware": (4, ["--sync", "allreduce", "--node-aware", "on"]),
}
ENV = {"node-aware": {"MPIDP_RANKS_PER_NODE": "2"}}  # mode -> what its job needs besides


def _run(mode, tmp_path, *extra, fault=None, timeout=90):
    n, flags = MODES[mode]
    env = {**ENV.get(mode, {}), **({"MPIDP_FAULT": fault} if fault else {})}
    t = time.monotonic()
    r = run_mpi(n, *ARGS, *flags, "--out", str(tmp_path / "out"), *extra, env=env,
                timeout=timeout)
    r.elapsed = time.monotonic() - t
    return r


@pytest.mark.parametrize("mode", MODES)
def test_an_exception_on_one_rank_ends_the_job(mode, tmp_path):
    r = _run(mode, tmp_path, fault="raise@1:3")
    assert r.returncode != 0 and r.elapsed < 30, (r.returncode, r.elapsed)
    assert "injected fault on rank 1 at step 3" in r.stderr
    assert not (tmp_path / "out" / "model.npz").exists()


@pytest.mark.parametrize("mode", MODES)
def test_a_stalled_rank_is_named_by_the_watchdog(mode, tmp_path):
    w = 2.0
    r = _run(mode, tmp_path, "--watchdog", str(w), fault="hang@1:3", timeout=120)
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert "stalled rank(s) [1]" in r.stderr, r.stderr[-2000:]
    assert r.elapsed < 20 + 2 * w  # start-up of the job plus about two timeouts


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_stops_the_run_and_keeps_the_last_checkpoint(mode, tmp_path):
    r = _run(mode, tmp_path, "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every",
             "2", fault="nan@1:5")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "non-finite loss or gradient" in r.stderr
    assert not (tmp_path / "out" / "model.npz").exists()
    from mpidp.run.checkpoint import list_checkpoints, read
    files = list_checkpoints(str(tmp_path / "ck"))
    assert files, "a checkpoint was due before the NaN"
    meta, arrays = read(files[-1])  # verifies the checksum
    assert np.isfinite(arrays["params"]).all()
    if mode == "async-ps":  # steps are pushes served; rank 1's step 5 was the NaN
        assert meta["partition"]["async"]["workers"]["1"][2] <= 5
    else:
        assert meta["global_step"] <= 5


def test_an_option_that_does_not_apply_ends_the_job_on_every_rank(tmp_path):
    """async-ps: a server and two workers, each of which checks the options and stops."""
    r = _run("async-ps", tmp_path, "--check-every", "2")
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "--check-every does not apply to --sync async-ps" in r.stderr, r.stderr
    assert r.stderr.count("mpidp: error:") == 1  # said once (rank 0), raised on every rank
    assert not (tmp_path / "out").exists()


def test_the_node_aware_job_reduces_node_aware(tmp_path):
    """The node-aware row of the matrix runs what it names: two nodes, leaders exchange."""
    r = _run("node-aware", tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "node-aware reduction: 2 node(s), up to 2 ranks each" in r.stdout + r.stderr
