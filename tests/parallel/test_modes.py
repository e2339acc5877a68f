"""Every guarantee in every mode: a mode x guarantee matrix of real ``mpidp train`` jobs.

Modes: each ``--sync`` strategy, ``async-ps``, pipelines (both schedules), the hybrid, and
the node-aware allreduce (two nodes of two ranks simulated on this host; the faulty rank 1
is not its node's leader, which waits for it in shared memory).
Guarantees: an exception on one rank ends the job; a stalled rank is named by the
watchdog; a NaN with the default policy fails the run without writing a model (and the
last checkpoint stays good); the faulty jobs run six at a time. Which option each
mode refuses is checked without MPI, for every option in every mode
(tests/cli/test_options.py); one job here shows that a refusal ends a job on every rank, said
once.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import ROOT, kill_job, mpiexec, start_job

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


def _start(mode, out, *extra, fault=None, logs=None):
    """``mode``'s job under ``mpiexec``; its stdout and stderr go to pipes, or to files
    ``logs.out``/``logs.err`` (jobs started side by side: nobody drains their pipes)."""
    n, flags = MODES[mode]
    env = {**ENV.get(mode, {}), **({"MPIDP_FAULT": fault} if fault else {})}
    outs = ([open(logs.with_suffix(s), "w") for s in (".out", ".err")] if logs else
            [subprocess.PIPE] * 2)
    job = start_job([mpiexec(), "-n", str(n), sys.executable, "-m", "mpidp", *ARGS, *flags,
                     "--out", str(out), *extra], env, mode, cwd=ROOT, stdout=outs[0],
                    stderr=outs[1])
    for f in outs if logs else ():
        f.close()
    job.t0 = time.monotonic()
    return job


def _end(job, timeout):
    """The job's stdout, stderr and seconds from its start to its end (killed past
    ``timeout``: a failure)."""
    try:
        out, err = job.communicate(timeout=max(1.0, job.t0 + timeout - time.monotonic()))
    except subprocess.TimeoutExpired:
        kill_job(job)
        out, err = job.communicate()
        raise AssertionError(f"the job outlived {timeout}s: {err[-2000:]}") from None
    return out, err, time.monotonic() - job.t0


W = 3.0  # the watchdog's timeout in the hang jobs


AT_ONCE = 6  # jobs running side by side: their waits overlap, the cores stay busy
FAULTS = {"hang": ("hang@1:3", ["--watchdog", str(W)], 120), "raise": ("raise@1:3", [], 90),
          "nan": ("nan@1:5", ["--checkpoint-every", "2"], 90)}  # kind -> fault, flags, timeout


@pytest.fixture(scope="module")
def every_mode_ended(tmp_path_factory):
    """Each mode's three faulty jobs, :data:`AT_ONCE` jobs at a time: ``{mode: {kind: (job,
    stdout, stderr, seconds, out folder)}}`` for ``raise``, ``hang`` and ``nan``; a job
    killed past its timeout has ``seconds`` above it (its test fails)."""
    tmp = tmp_path_factory.mktemp("modes")
    todo = [(mode, kind) for mode in MODES for kind in FAULTS]
    running, done = {}, {mode: {} for mode in MODES}
    try:
        while todo or running:
            while todo and len(running) < AT_ONCE:
                mode, kind = todo.pop(0)
                fault, flags, _ = FAULTS[kind]
                if kind == "nan":
                    flags = [*flags, "--checkpoint-dir", str(tmp / mode / "ck")]
                running[mode, kind] = _start(mode, tmp / mode / kind, *flags, fault=fault,
                                             logs=tmp / f"{mode}-{kind}")
            time.sleep(0.05)
            for (mode, kind), job in list(running.items()):
                late = time.monotonic() - job.t0 > FAULTS[kind][2]
                if job.poll() is None and not late:
                    continue
                if late:
                    job.kill()
                job.wait()
                logs = tmp / f"{mode}-{kind}"
                done[mode][kind] = (job, logs.with_suffix(".out").read_text(),
                                    logs.with_suffix(".err").read_text(),
                                    time.monotonic() - job.t0, tmp / mode / kind)
                del running[mode, kind]
        yield done
    finally:
        for job in running.values():
            job.kill()
            job.wait()


@pytest.fixture(params=list(MODES))
def ended(request, every_mode_ended):
    """A mode and its three faulty jobs (see :func:`every_mode_ended`)."""
    return request.param, every_mode_ended[request.param]


def test_an_exception_on_one_rank_ends_the_job(ended):
    job, _, err, elapsed, out = ended[1]["raise"]
    assert job.returncode != 0 and elapsed < 30, (job.returncode, elapsed)
    assert "injected fault on rank 1 at step 3" in err
    assert not (out / "model.npz").exists()


def test_a_stalled_rank_is_named_by_the_watchdog(ended):
    job, _, err, elapsed, _ = ended[1]["hang"]
    assert job.returncode == 3, (job.returncode, err[-2000:])
    assert "stalled rank(s) [1]" in err, err[-2000:]
    assert elapsed < 20 + 2 * W  # start-up of the job plus about two timeouts


def test_a_nan_stops_the_run_and_keeps_the_last_checkpoint(ended):
    mode, (job, stdout, err, _, out) = ended[0], ended[1]["nan"]
    assert job.returncode == 2, (job.returncode, err[-2000:])
    assert "non-finite loss or gradient" in err
    assert not (out / "model.npz").exists()
    from mpidp.run.checkpoint import list_checkpoints, read
    files = list_checkpoints(str(out.parent / "ck"))
    assert files, "a checkpoint was due before the NaN"
    meta, arrays = read(files[-1])  # verifies the checksum
    assert np.isfinite(arrays["params"]).all()
    if mode == "async-ps":  # steps are pushes served; rank 1's step 5 was the NaN
        assert meta["partition"]["async"]["workers"]["1"][2] <= 5
    else:
        assert meta["global_step"] <= 5
    if mode == "node-aware":  # the row runs what it names: two nodes, leaders exchange
        assert "node-aware reduction: 2 node(s), up to 2 ranks each" in stdout + err


def test_an_option_that_does_not_apply_ends_the_job_on_every_rank(tmp_path):
    """async-ps: a server and two workers, each of which checks the options and stops."""
    job = _start("async-ps", tmp_path / "out", "--check-every", "2")
    out, err, _ = _end(job, 90)
    assert job.returncode == 2, (job.returncode, err[-2000:])
    assert "--check-every does not apply to --sync async-ps" in err, err
    assert err.count("mpidp: error:") == 1  # said once (rank 0), raised on every rank
    assert not (tmp_path / "out").exists()
