"""Clean ends and honest outputs of ``mpidp train``: signals, one rank leaving, the watchdog
naming a stopped rank, replicas that differ, and what a run leaves behind (config.toml,
history.jsonl, a per-rank trace)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    ROOT,
    job_processes,
    kill_job,
    mpiexec,
    parser_refusal,
    run_mpi,
    start_job,
    tensorboard_scalars,
)

ARGS = ["train", "--dataset", "synthetic", "--n-samples", "600", "--n-features", "10",
        "--dtype", "float64", "--epochs", "3", "--batch-size", "32", "--optimizer", "adam",
        "--lr", "0.01", "--hidden", "16", "--no-progress"]


def _params(out) -> np.ndarray:
    return np.load(Path(out) / "model.npz")["params"]


def _ranks(job: subprocess.Popen, n: int, timeout: float = 30) -> list[int]:
    """Pids of the ``n`` ranks of ``job``, found by its token and ordered by their rank."""
    deadline, found = time.monotonic() + timeout, {}
    while time.monotonic() < deadline and len(found) < n:
        for pid, env, cmd in job_processes(job.token):
            if b"mpidp" in cmd:
                rank = next((int(e.split(b"=")[1]) for e in env  # MPICH, Open MPI, PMIx
                             if e.startswith((b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK=",
                                              b"PMIX_RANK="))), None)
                if rank is not None:
                    found[rank] = pid
        time.sleep(0.05)
    assert len(found) == n, f"found ranks {found}"
    return [found[r] for r in range(n)]


def _start(n: int, *args: str, token: str, log: Path | None = None,
           module: bool = True) -> subprocess.Popen:
    """The job in the background (``mpidp`` with ``args``, or the script ``args[0]`` where
    not ``module``); its stdout goes to ``log`` when given (to be polled).
    ``token`` names its processes (:func:`helpers.start_job`)."""
    out = open(log, "w") if log is not None else subprocess.PIPE  # noqa: SIM115
    return start_job([mpiexec(), "-n", str(n), sys.executable,
                      *(["-m", "mpidp"] if module else []), *args], {"PYTHONUNBUFFERED": "1"},
                     token, cwd=ROOT, stdout=out, stderr=subprocess.PIPE)


def _finished(job: subprocess.Popen, timeout: float = 120) -> None:
    """Wait for a job that must succeed (an uninterrupted reference run, started alongside
    the run under test)."""
    out, err = job.communicate(timeout=timeout)
    assert job.returncode == 0, err[-2000:]


def _end(job: subprocess.Popen, since: float | None = None,
         timeout: float = 60) -> subprocess.CompletedProcess:
    """How ``job`` ended (within ``timeout`` seconds), with ``elapsed``: the seconds from
    ``since`` (a ``time.monotonic()``) to its end."""
    out, err = job.communicate(timeout=timeout)
    r = subprocess.CompletedProcess(job.args, job.returncode, out, err)
    r.elapsed = None if since is None else time.monotonic() - since
    return r


@contextlib.contextmanager
def _ending(*jobs: subprocess.Popen):
    """However the block ends, no process of ``jobs`` outlives it (a stopped rank included)."""
    try:
        yield
    finally:
        for job in jobs:
            kill_job(job)
            job.communicate()


def _wait_for(path: Path, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        time.sleep(0.02)
    raise AssertionError(f"{text!r} never appeared in {path}")


def _history_lines(out) -> list[dict]:
    return [json.loads(line) for line in (Path(out) / "history.jsonl").read_text().splitlines()]


def _wait_for_epoch(out, timeout: float = 60, job: subprocess.Popen | None = None) -> None:
    """Until the run in ``out`` has finished its first epoch (its history says so); fails at
    once if ``job`` ends first."""
    path, deadline = Path(out) / "history.jsonl", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and '"kind":"epoch"' in path.read_text():
            return
        if job is not None and job.poll() is not None:
            raise AssertionError(f"the job ended ({job.returncode}) before an epoch finished: "
                                 f"{job.stderr.read()[-1500:]}")
        time.sleep(0.02)
    raise AssertionError(f"no epoch finished in {out} within {timeout}s")


#: The tests whose jobs mostly wait (for a line, for a signal to be acted on, for the
#: watchdog's verdict): test name -> its scenario, which runs the job(s) in a folder of its own
#: and returns what the test checks. :func:`every_wait` runs them side by side.
WAITS: dict = {}


def _waits(*params):
    """Register ``_x`` as the scenario of ``test_x`` (of ``test_x[p]`` for each of ``params``,
    called with ``n=p``). It is called with a folder of its own, then the fixtures it names."""
    def register(fn):
        name = "test" + fn.__name__
        if not params:
            WAITS[name] = fn
        WAITS.update({f"{name}[{p}]": functools.partial(fn, n=p) for p in params})
        return fn
    return register


def _in(scenario, folder: Path, fixtures: dict) -> tuple[Path, object]:
    """The folder a scenario ran in, and its result."""
    return folder, scenario(folder, **fixtures)


def _fixtures(request, scenario) -> dict:
    """The fixtures ``scenario`` names after its folder (its parameters without a default)."""
    params = list(inspect.signature(scenario).parameters.values())[1:]
    return {p.name: request.getfixturevalue(p.name) for p in params if p.default is p.empty}


@pytest.fixture(scope="module")
def every_wait(request, tmp_path_factory) -> dict:
    """The scenarios of the chosen tests of :data:`WAITS`, each in a thread of its own so that
    their waits overlap, all ended before any test looks at one: test name -> the future of
    (its folder, its result); what a scenario raised, its test alone raises again."""
    chosen = [item.name for item in request.session.items
              if item.path == request.path and item.name in WAITS]
    fixtures = {name: _fixtures(request, WAITS[name]) for name in chosen}  # set up first
    with ThreadPoolExecutor(len(chosen)) as pool:
        return {name: pool.submit(_in, WAITS[name], tmp_path_factory.mktemp(name[5:35]),
                                  fixtures[name]) for name in chosen}


@pytest.fixture
def waited(request, every_wait):
    """The future of this test's scenario: ``.result()`` is its folder and its result."""
    return every_wait[request.node.name]


PRELUDE = (
    "import sys, time\nimport numpy as np\nimport mpidp\nfrom mpi4py import MPI\n"
    "from mpidp import nn\nfrom mpidp.run.spec import Checkpointing\n"
    "comm = MPI.COMM_WORLD\n"
    "X = np.random.default_rng(0).standard_normal((400, 4))\n"
    "y = (X[:, 0] > 0).astype(np.int64)\n"
    "shard = mpidp.shard_from_arrays(comm, X[comm.rank::2], y[comm.rank::2])\n"
    "def replica(cls=mpidp.DataParallel, **kw):\n"
    "    return cls(nn.mlp(4, (8,), 2).init_(0), nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,"
    " **kw)\n")


def _library_job(tmp_path, body: str, timeout: float = 60):
    """Run a 2-rank library program: :data:`PRELUDE` (data, a ``replica`` factory) + ``body``."""
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + body)
    t = time.monotonic()
    r = run_mpi(2, str(script), module=False, timeout=timeout)
    r.elapsed = time.monotonic() - t
    return r


LONG = ["--epochs", "12", "--hidden", "64,64"]
SLOW = ["--slowdown", "0:200,1:200"]  # about 0.5 s an epoch: a signal lands mid-run
# A pipeline's local compute is longer per step (every micro-batch is timed), so the same
# stretch there is about 1 s an epoch with a far smaller factor.
SLOW_PIPELINE = ["--slowdown", "0:15,1:15"]
# A resume reads the stopped run's settings, its slowdown too: resumed at full speed.
FULL_SPEED = ["--slowdown", "0:1"]


def _async_ps_signalled(tmp_path, ranks: slice, *args: str) -> subprocess.CompletedProcess:
    """A slowed async-ps job of 3 ranks, SIGTERM to ``ranks`` of them mid-run."""
    log = tmp_path / "stdout.txt"
    job = _start(3, *ARGS, *LONG, "--epochs", "400", "--sync", "async-ps", "--slowdown",
                 "1:200,2:200", *args, "--out", str(tmp_path / "a"),
                 token=f"aterm-{tmp_path.name}", log=log)
    with _ending(job):
        pids = _ranks(job, 3)
        _wait_for(log, "model:")  # every rank has its handlers: the data are loaded together
        time.sleep(0.5)  # mid-run: 400 slowed epochs last minutes
        for pid in pids[ranks]:
            os.kill(pid, signal.SIGTERM)
        return _end(job)


@_waits()
def _sigterm_stops_async_ps_cleanly(tmp_path):
    return _async_ps_signalled(tmp_path, slice(None))


def test_sigterm_stops_async_ps_cleanly(waited):
    tmp_path, r = waited.result()
    assert r.returncode == 75, (r.returncode, r.stderr[-2000:])
    assert "stopped by a signal" in r.stderr and not (tmp_path / "a" / "model.npz").exists()


@_waits()
def _sigterm_to_one_async_ps_worker_stops_every_rank(tmp_path):
    return _async_ps_signalled(tmp_path, slice(1, 2),  # a worker, not the server
                               "--checkpoint-dir", str(tmp_path / "ck"))


def test_sigterm_to_one_async_ps_worker_stops_every_rank(waited):
    """The worker's request rides in its next push; the server stops everyone."""
    tmp_path, r = waited.result()
    ck = tmp_path / "ck"
    assert r.returncode == 75, (r.returncode, r.stderr[-2000:])
    assert f"checkpoint written to {ck}" in r.stderr
    assert not (tmp_path / "a" / "model.npz").exists()


def _folder(tmp_path) -> tuple[Path, list[str]]:
    """A float64 folder data set and the arguments that train on it with mapped rows."""
    rng, folder = np.random.default_rng(8), tmp_path / "d"
    folder.mkdir()
    np.save(folder / "X.npy", rng.standard_normal((600, 10)))
    np.save(folder / "y.npy", rng.integers(0, 3, 600))
    sized = {"--n-samples", "--n-features"}  # of generated data only: the file sets both
    own = [a for i, a in enumerate(ARGS) if a not in sized and ARGS[i - 1] not in sized]
    return folder, [*own, "--dataset", str(folder), "--distribute", "local",
                    "--test-fraction", "0"]


@_waits()
def _a_data_file_cut_short_under_mapped_rows_ends_the_job(tmp_path):
    folder, args = _folder(tmp_path)
    log = tmp_path / "stdout.txt"
    job = _start(2, *args, "--epochs", "400", *SLOW, "--out", str(tmp_path / "o"),
                 token=f"cut-{tmp_path.name}", log=log)
    with _ending(job):
        _wait_for(log, "model:")
        time.sleep(0.3)
        os.truncate(folder / "X.npy", 128)  # the header only: the mapped rows are gone
        return _end(job)


def test_a_data_file_cut_short_under_mapped_rows_ends_the_job(waited):
    tmp_path, r = waited.result()
    assert r.returncode != 0 and "Bus error" in r.stderr, (r.returncode, r.stderr[-2000:])
    assert not (tmp_path / "o" / "model.npz").exists()


@_waits()
def _a_data_file_replaced_by_rename_under_mapped_rows_changes_nothing(tmp_path) -> bool:
    """Whether the slowed run still ran when its file was replaced."""
    folder, args = _folder(tmp_path)
    log, ref_log = tmp_path / "stdout.txt", tmp_path / "ref.txt"
    ref = _start(2, *args, "--epochs", "2", "--out", str(tmp_path / "ref"),
                 token=f"ref-{tmp_path.name}", log=ref_log)  # uninterrupted, alongside
    job = _start(2, *args, "--epochs", "2", *SLOW, "--out", str(tmp_path / "o"),
                 token=f"ren-{tmp_path.name}", log=log)
    with _ending(ref, job):
        _wait_for(ref_log, "model:")  # the slowed run's line last: its epochs are still ahead
        _wait_for(log, "model:")  # both have mapped the rows of the old file
        np.save(tmp_path / "new.npy", np.zeros((600, 10)))
        os.replace(tmp_path / "new.npy", folder / "X.npy")  # the old file lives on while mapped
        running = job.poll() is None
        _finished(job)
        _finished(ref)
        return running


def test_a_data_file_replaced_by_rename_under_mapped_rows_changes_nothing(waited):
    tmp_path, running = waited.result()
    assert running, "the slowed run ended before its file was replaced"
    assert np.array_equal(_params(tmp_path / "o"), _params(tmp_path / "ref"))


def test_async_ps_checkpoints_on_sigterm_and_resume_pushes_every_batch_once(tmp_path):
    a = [*ARGS, "--n-samples", "1500", "--epochs", "4", "--sync", "async-ps",
         "--max-staleness", "1000"]  # nothing dropped: every batch's push is applied
    reference = _start(3, *a, "--out", str(tmp_path / "ref"), token=f"ref-{tmp_path.name}")
    log, ck = tmp_path / "stdout.txt", tmp_path / "ck"
    job = _start(3, *a, "--slowdown", "1:400,2:400", "--checkpoint-dir", str(ck),
                 "--checkpoint-every", "5", "--out", str(tmp_path / "a"),
                 token=f"ack-{tmp_path.name}", log=log)
    pids = _ranks(job, 3)
    from mpidp.run.checkpoint import list_checkpoints, read
    deadline = time.monotonic() + 120  # mid-run, once pushes were served: the slowed run
    while not list_checkpoints(str(ck)) and job.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # lasts minutes, and its first checkpoint comes after 5 pushes
    assert list_checkpoints(str(ck)) and job.poll() is None, "no checkpoint while it ran"
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 75, (job.returncode, err[-2000:])
    assert f"checkpoint written to {ck}" in err and not (tmp_path / "a" / "model.npz").exists()
    _finished(reference)
    ref = json.loads((tmp_path / "ref" / "metrics.json").read_text())["async"]
    shutil.copytree(ck, tmp_path / "ck4")
    at_stop = read(list_checkpoints(str(ck))[-1])[0]["partition"]["async"]
    r = run_mpi(3, *a, *FULL_SPEED, "--checkpoint-dir", str(ck), "--resume", "--out",
                str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    got = json.loads((tmp_path / "b" / "metrics.json").read_text())
    # each worker went on from the batch after its last served push: none twice, none lost
    assert got["async"]["applied"] == ref["applied"] and got["async"]["dropped"] == 0
    assert [h["epoch"] for h in got["history"]] == [1, 2, 3, 4]
    r = run_mpi(4, *a, *FULL_SPEED, "--checkpoint-dir", str(tmp_path / "ck4"), "--resume",
                "--out", str(tmp_path / "c"))  # another number of ranks: from the slowest on
    assert r.returncode == 0 and "written with 3 ranks, now 4" in r.stdout, r.stderr
    more = json.loads((tmp_path / "c" / "metrics.json").read_text())["async"]["applied"]
    assert len(at_stop["workers"]) == 2 and 0 < at_stop["applied"] < ref["applied"] < more


@pytest.mark.parametrize("mode", [[], ["--parallel", "pipeline", "--epochs", "6"]],
                         ids=["data", "pipeline"])  # a pipeline's slowed epoch is longer
def test_sigterm_to_every_rank_checkpoints_and_resume_is_bit_identical(tmp_path, mode):
    n = 2
    ref = tmp_path / "ref"
    reference = _start(n, *ARGS, *LONG, *mode, "--out", str(ref), token=f"ref-{tmp_path.name}")
    ck = tmp_path / "ck"
    slow = SLOW_PIPELINE if mode else SLOW
    job = _start(n, *ARGS, *LONG, *mode, *slow, "--checkpoint-dir", str(ck),
                 "--checkpoint-every", "1000", "--out", str(tmp_path / "a"),
                 token=f"term-{tmp_path.name}")
    pids = _ranks(job, n)
    _wait_for_epoch(tmp_path / "a", job=job)
    for pid in pids:  # what Slurm's --signal does: every rank gets it
        os.kill(pid, signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 75, (job.returncode, err[-2000:])
    assert "stopped by a signal after step" in err and "--resume" in err
    assert not (tmp_path / "a" / "model.npz").exists()
    assert any(ck.glob("ckpt-*.npz")), "a checkpoint was written on the way out"
    r = run_mpi(n, *ARGS, *LONG, *mode, *FULL_SPEED, "--checkpoint-dir", str(ck), "--resume",
                "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    _finished(reference)
    assert np.array_equal(_params(tmp_path / "b"), _params(ref))


def test_sigterm_with_compressed_buckets_in_flight_checkpoints_and_resumes(tmp_path):
    """A bucket per layer, each started during backward: the signal is acted on between
    steps, when none is in flight, so the checkpoint is written and the run resumes to the
    end (the residuals of error feedback start again at zero: close, not bit-identical)."""
    n, mode = 2, ["--sync", "compressed", "--bucket-mb", "0.0001", "--epochs", "6"]
    ck = tmp_path / "ck"
    job = _start(n, *ARGS, *LONG, *mode, *SLOW, "--checkpoint-dir", str(ck),
                 "--checkpoint-every", "1000", "--out", str(tmp_path / "a"),
                 token=f"term-z-{tmp_path.name}")
    pids = _ranks(job, n)
    _wait_for_epoch(tmp_path / "a", job=job)
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 75, (job.returncode, err[-2000:])
    assert any(ck.glob("ckpt-*.npz")), "a checkpoint was written on the way out"
    r = run_mpi(n, *ARGS, *LONG, *mode, *FULL_SPEED, "--checkpoint-dir", str(ck), "--resume",
                "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    history = json.loads((tmp_path / "b" / "metrics.json").read_text())["history"]
    assert history[-1]["epoch"] == 6 and np.isfinite(_params(tmp_path / "b")).all()


@_waits()
def _sigint_to_one_rank_ends_the_job_within_seconds(tmp_path):
    """The refused second job, whether the first still ran after it, and how the first ended."""
    ck = tmp_path / "ck"
    job = _start(2, *ARGS, *LONG, "--epochs", "400", *SLOW, "--checkpoint-dir", str(ck),
                 "--out", str(tmp_path / "o"), token=f"int-{tmp_path.name}")
    with _ending(job):
        pids = _ranks(job, 2)
        _wait_for_epoch(tmp_path / "o", job=job)  # still running below
        refused = run_mpi(2, *ARGS, "--checkpoint-dir", str(ck), "--resume", "--out",
                          str(tmp_path / "b"))
        running = job.poll() is None
        t = time.monotonic()
        if running:
            os.kill(pids[1], signal.SIGINT)
        return refused, running, _end(job, since=t)


def test_sigint_to_one_rank_ends_the_job_within_seconds(waited):
    """While the job runs, a second job on its checkpoint folder is refused; then SIGINT to
    one of its ranks ends it within seconds."""
    _, (r, running, end) = waited.result()
    assert r.returncode == 2 and "is in use by another mpidp job" in r.stderr, r.stderr
    assert "pid" in r.stderr and running
    assert end.returncode != 0 and end.elapsed < 15, (end.returncode, end.stderr[-1500:])
    assert "interrupted (SIGINT)" in end.stderr


@_waits()
def _sys_exit_in_a_callback_on_one_rank_ends_the_job(tmp_path):
    return _library_job(tmp_path, "dp = replica()\n"
                        "def leave(record):\n    if comm.rank == 1:\n        sys.exit(4)\n"
                        "mpidp.fit(dp, shard, 5, 32, on_epoch=leave)\n")


def test_sys_exit_in_a_callback_on_one_rank_ends_the_job(waited):
    _, r = waited.result()
    assert r.returncode != 0 and r.elapsed < 30, (r.returncode, r.stderr[-1500:])
    assert "SystemExit(4) during training; ending the job" in r.stderr


@_waits()
def _the_watchdog_names_a_stopped_rank_among_four(tmp_path):
    jobs = [_start(4, *ARGS, *LONG, "--epochs", "200", "--watchdog", "2", "--watchdog-grace",
                   "1", "--out", str(tmp_path / f"o{attempt}"),
                   token=f"stop-{tmp_path.name}-{attempt}")
            for attempt in range(3)]
    with _ending(*jobs):
        for attempt, job in enumerate(jobs):
            pids = _ranks(job, 4)
            _wait_for_epoch(tmp_path / f"o{attempt}", job=job)
            time.sleep(0.1 * attempt)
            os.kill(pids[2], signal.SIGSTOP)
        return [_end(job) for job in jobs]


def test_the_watchdog_names_a_stopped_rank_among_four(waited):
    """Three jobs side by side, rank 2 of each stopped at another moment of its steps: their
    waits for the verdict (the timeout, then the roll call's grace, 1 s here) overlap."""
    for r in waited.result()[1]:
        assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
        assert "stalled rank(s) [2]: [2] did not answer within 1s" in r.stderr, r.stderr[-2000:]


SLOW_TO_ANSWER = """\
import os, signal, time
import numpy as np
import mpidp
from mpi4py import MPI
from mpidp import nn
from mpidp.comm.watchdog import Watchdog
comm = MPI.COMM_WORLD
if comm.rank == 0:  # answers its first roll call 3 s late, as a rank starved of CPU would
    plain = Watchdog._answer
    def late(self, listen, call, replies):
        if not getattr(self, "slept", False) and listen.Get_status():
            self.slept = True
            time.sleep(3.0)
        return plain(self, listen, call, replies)
    Watchdog._answer = late
X = np.random.default_rng(0).standard_normal((300, 4))
y = (X[:, 0] > 0).astype(np.int64)
shard = mpidp.shard_from_arrays(comm, X[comm.rank::3], y[comm.rank::3])
dp = mpidp.DataParallel(nn.mlp(4, (8,), 2).init_(0), nn.SGD(0.1), nn.SoftmaxCrossEntropy(),
                        comm)
def stop(record):
    if comm.rank == 2:
        os.kill(os.getpid(), signal.SIGSTOP)
mpidp.fit(dp, shard, 50, 12, on_epoch=stop, watchdog=Watchdog(comm, 1.0))
"""


@_waits()
def _a_rank_slow_to_answer_the_roll_call_is_not_named(tmp_path):
    """:data:`SLOW_TO_ANSWER` on 3 ranks."""
    script = tmp_path / "mpidp_job.py"
    script.write_text(SLOW_TO_ANSWER)
    job = _start(3, str(script), module=False, token=f"late-{tmp_path.name}")
    with _ending(job):
        return _end(job)


@_waits()
def _a_long_checkpoint_write_does_not_trip_the_watchdog(tmp_path):
    return _library_job(tmp_path, (
        "import mpidp.run.checkpoint as written\n"
        "plain, slept = written.save, []\n"
        "def slow(*a, **k):  # a slow file system: the first write, on the rank that writes\n"
        "    if not slept:\n        slept.append(time.sleep(3.0))\n"
        "    return plain(*a, **k)\n"
        "written.save = slow\n"
        f"ck = Checkpointing({str(tmp_path / 'ck')!r}, every=4)\n"
        "mpidp.fit(replica(), shard, 1, 32, checkpoint=ck,"
        " watchdog=mpidp.comm.Watchdog(comm, 1.0))\n"
        "done = comm.gather(comm.rank)\n"
        "if comm.rank == 0:\n    print('done', done, flush=True)\n"), timeout=90)


def test_a_rank_slow_to_answer_the_roll_call_is_not_named(waited):
    """Rank 2 is stopped; rank 0 answers the roll call 3 s late (its cores busy elsewhere):
    only rank 2 is named."""
    _, r = waited.result()
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert "stalled rank(s) [2]: [2] did not answer within 6s" in r.stderr, r.stderr[-2000:]
    assert "stalled rank(s) [0" not in r.stderr, r.stderr[-2000:]


def test_replicas_that_differ_at_the_end_fail_the_run(tmp_path):
    env = {"MPIDP_FAULT": "desync@1:44"}  # the last step: nothing can round it away
    r = run_mpi(2, *ARGS, "--out", str(tmp_path / "o"), env=env)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "parameters differ from rank 0's on ranks [1]" in r.stderr
    assert not (tmp_path / "o" / "model.npz").exists()


def test_a_long_checkpoint_write_does_not_trip_the_watchdog(waited):
    _, r = waited.result()
    assert r.returncode == 0, r.stderr[-2000:]
    assert "done [0, 1]" in r.stdout


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """A finished run of ARGS that checkpointed every 5 steps, with a trace (t.json beside)
    and TensorBoard files (tb/, where the 'tensorboard' extra is installed): its output and
    checkpoint folders (tests that write to the checkpoint folder work on a copy: :func:`_copy`)."""
    where = tmp_path_factory.mktemp("finished")
    out, ck = where / "out", where / "ck"
    tb = ["--tensorboard", str(where / "tb")] if importlib.util.find_spec("tensorboardX") else []
    r = run_mpi(2, *ARGS, "--checkpoint-dir", str(ck), "--checkpoint-every", "5", "--out",
                str(out), "--trace", str(where / "t.json"), *tb)
    assert r.returncode == 0, r.stderr
    return out, ck


def _copy(ck: Path, tmp_path) -> Path:
    return Path(shutil.copytree(ck, tmp_path / "ck"))


def test_config_toml_reproduces_the_run_and_resume_reads_the_stored_settings(tmp_path,
                                                                           finished):
    a, ck = finished[0], _copy(finished[1], tmp_path)
    r = run_mpi(2, "train", "--config", str(a / "config.toml"), "--out", str(tmp_path / "b"),
                "--checkpoint-dir", str(tmp_path / "ck2"))  # the command line wins
    assert r.returncode == 0, r.stderr
    assert np.array_equal(_params(a), _params(tmp_path / "b"))
    # --resume with only the folder and a new epoch count: the other settings come back
    r = run_mpi(2, "train", "--checkpoint-dir", str(ck), "--resume", "--epochs",
                "4", "--out", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "c" / "metrics.json").read_text())
    assert m["config"]["hidden"] == [16] and m["config"]["optimizer"] == "adam"
    assert len(m["history"]) == 4 and "resumed from" in r.stdout


def test_a_killed_run_keeps_its_history(tmp_path):
    out = tmp_path / "o"
    r = run_mpi(2, *ARGS, "--out", str(out), "--log-every", "5",
                env={"MPIDP_FAULT": "kill@1:25"})  # 15 steps per epoch: dies in epoch 2
    assert r.returncode != 0
    lines = _history_lines(out)
    assert lines[0]["kind"] == "config" and lines[0]["hidden"] == [16]
    epochs = [x for x in lines if x["kind"] == "epoch"]
    steps = [x for x in lines if x["kind"] == "steps"]
    assert [x["epoch"] for x in epochs] == [1] and np.isfinite(epochs[0]["loss"])
    assert [x["step"] for x in steps] == [5, 10, 15, 20, 25][:len(steps)] and len(steps) >= 4
    assert [x["epoch"] for x in steps] == [1, 1, 1, 2, 2][:len(steps)]
    assert len(steps[0]["compute_s"]) == 2  # one figure per rank
    assert not (out / "metrics.json").exists() and not (out / "model.npz").exists()


@pytest.mark.parametrize("mode,n", [([], 2), (["--parallel", "pipeline", "--micro-batches", "3"], 3),
                                    (["--sync", "async-ps"], 3)], ids=["data", "pipeline", "async-ps"])
def test_the_trace_has_a_process_per_rank_in_every_mode(tmp_path, mode, n, finished):
    trace = tmp_path / "t.json" if mode else finished[0].parent / "t.json"  # data: 3 epochs
    if mode:
        r = run_mpi(n, *ARGS, *mode, "--epochs", "1", "--out", str(tmp_path / "o"), "--trace",
                    str(trace))
        assert r.returncode == 0, r.stderr
    doc = json.loads(trace.read_text())
    spans = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    assert sorted(names) == list(range(n)) and all(names[r].startswith(f"rank {r}") for r in names)
    assert all("step" in e["args"] and "epoch" in e["args"] for e in spans)
    from tracecheck import overlaps
    assert overlaps(doc) == []
    if "pipeline" in mode:  # each stage ran every micro-batch forward and backward
        steps = 15  # 480 training rows / 32 per batch
        for pid in range(n):
            fwd = [e for e in spans if e["pid"] == pid and e["name"] == "forward"]
            assert len(fwd) == 3 * steps
            assert {e["args"]["micro_batch"] for e in fwd} == {0, 1, 2}


def test_a_dedicated_server_holds_no_rows(tmp_path):
    r = run_mpi(3, "train", "--dataset", "digits", "--epochs", "1", "--sync", "ps",
                "--ps-placement", "dedicated", "--out", str(tmp_path / "o"), "--no-progress")
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "o" / "metrics.json").read_text())
    per_rank = m["balance"]["per_rank"]
    assert per_rank[0]["samples"] == 0 and per_rank[1]["samples"] + per_rank[2]["samples"] == 1438
    assert m["balance"]["moved_samples"] == 0


@pytest.mark.parametrize("caps,ok", [("1,3", True), ("1,3,1", False)])
def test_capacities_of_a_dedicated_server_are_one_per_worker(tmp_path, caps, ok):
    r = run_mpi(3, "train", "--dataset", "digits", "--epochs", "1", "--sync", "async-ps",
                "--partition", "weighted", "--capacities", caps, "--out", str(tmp_path / "o"))
    if ok:
        assert r.returncode == 0, r.stderr
        rows = json.loads((tmp_path / "o" / "metrics.json").read_text())["timings"]
        assert rows[0]["samples"] == 0 and rows[2]["samples"] > 2.5 * rows[1]["samples"]
    else:
        assert r.returncode == 2
        assert r.stderr.count("--capacities has 3 entries; give one per worker") == 1
        assert "(on ranks" not in r.stderr


@pytest.mark.parametrize("sync", ["compressed", "local-sgd", "allreduce"])
def test_a_skipped_nan_step_does_not_poison_the_next_ones(tmp_path, sync):
    r = run_mpi(2, *ARGS, "--sync", sync, "--on-nonfinite", "skip", "--out",
                str(tmp_path / "o"), env={"MPIDP_FAULT": "nan@1:3"})
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert m["skipped_steps"] == 1 and np.isfinite(_params(tmp_path / "o")).all()


def test_async_staleness_counts_only_applied_pushes(tmp_path):
    r = run_mpi(4, "train", "--dataset", "digits", "--epochs", "2", "--sync", "async-ps",
                "--max-staleness", "1", "--out", str(tmp_path / "o"), "--no-progress")
    assert r.returncode == 0, r.stderr
    a = json.loads((tmp_path / "o" / "metrics.json").read_text())["async"]
    assert a["staleness_max"] <= 1 and a["applied"] > 0


@pytest.mark.parametrize("flag,message", [
    (["--momentum", "nan"], "argument --momentum: must be a number >= 0 and < 1, got nan"),
    (["--weight-decay", "-100"], "argument --weight-decay: must be a finite number >= 0"),
    (["--bucket-mb", "inf"], "argument --bucket-mb: must be a finite number > 0, got inf"),
    (["--bucket-mb", "1e-300"], "argument --bucket-mb: must be at least one byte"),
    (["--bucket-mb", "1e308", "--sync", "compressed"], "argument --bucket-mb: must be under 2^42 MiB"),
    (["--ps-chunk-mb", "inf"], "argument --ps-chunk-mb: must be a finite number > 0"),
    (["--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
    (["--watchdog-grace", "-1"], "argument --watchdog-grace: must be a finite number > 0"),
    (["--hidden", ",,"], "an mlp needs at least one hidden layer"),
])
def test_bad_option_values_are_one_clear_error_from_the_parser(tmp_path, capsys, flag, message):
    """Refused by the parser, before MPI starts (every rank parses alike, rank 0 alone speaks:
    tests/cli/test_messages.py's job at 3 ranks)."""
    err = parser_refusal(capsys, *ARGS, "--out", str(tmp_path / "o"), *flag)
    assert err is not None and err.count(message) == 1 and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


def test_bad_options_are_one_clear_error(tmp_path):
    """A model too big for the node."""
    r = run_mpi(2, *ARGS, "--out", str(tmp_path / "o"), "--hidden", "200000,200000")
    assert r.returncode == 2 and r.stderr.count("GiB are available") == 1, r.stderr[-1500:]
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


def test_malformed_fault_spec_is_named(tmp_path):
    """With the options' problems: every one is found before any work and named once, in
    one refusal (tests/cli/test_options.py checks each option alone, without MPI)."""
    r = run_mpi(2, *ARGS, "--out", str(tmp_path / "o"), "--trace-steps", "3:5", "--copy-data",
                env={"MPIDP_FAULT": "boom@1"})
    assert r.returncode == 2, r.stderr[-1500:]
    for message in ("--trace-steps needs --trace",
                    "--copy-data does not apply to --distribute scatter",
                    "MPIDP_FAULT item 'boom@1' is not kind@rank:step"):
        assert r.stderr.count(message) == 1, (message, r.stderr[-1500:])
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


@pytest.mark.parametrize("flag,message", [
    (["--clip-norm", "1", "--on-nonfinite", "ignore"], "but --clip-norm scales by"),
    (["--optimizer", "lamb", "--on-nonfinite", "ignore"], "but LAMB scales each tensor"),
    (["--overlap-progress", "thread", "--on-nonfinite", "ignore"], "use --overlap-progress test"),
    ([], "so on_nonfinite 'stop' cannot hold"),
])
def test_overlap_finishing_in_forward_is_refused_from_the_options(flag, message):
    """What the command line refuses before any data, in the flags' spelling (the job that
    ends on such a refusal: the test below)."""
    from mpidp.cli import build_parser, flags
    from mpidp.cli.train import _strategy_problems
    from mpidp.errors import spelled
    args = build_parser().parse_args(["train", "--sync", "overlapped", "--overlap-finish",
                                      "forward", *flag])
    with spelled(flags.spelling(build_parser())):
        problems = _strategy_problems(args)
    assert len(problems) == 1 and problems[0].count(message) == 1, problems


def test_overlap_finishing_in_forward_refuses_before_reading_data(tmp_path):
    """Refused from the options alone: the dataset named does not even exist."""
    r = run_mpi(2, "train", "--dataset", str(tmp_path / "absent.npz"), "--sync", "overlapped",
                "--overlap-finish", "forward", "--out", str(tmp_path / "o"))
    message = "so on_nonfinite 'stop' cannot hold"
    assert r.returncode == 2 and r.stderr.count(message) == 1, r.stderr[-1500:]
    assert "dataset not found" not in r.stderr and not (tmp_path / "o").exists()


@_waits(1, 2)
def _a_stop_signal_while_mpi_starts_waits_for_it_then_ends_the_job(tmp_path, n):
    script = tmp_path / "start.py"
    script.write_text(textwrap.dedent(f"""
        import importlib, os, signal, sys
        M = importlib.import_module("mpidp.cli.main")
        start = M._start_mpi
        def signalled():
            if os.environ.get("PMI_RANK", "0") == "0":
                os.kill(os.getpid(), signal.SIGTERM)  # before MPI_Init, as if it came during
            return start()
        M._start_mpi = signalled
        sys.exit(M.main({[*ARGS, "--out", str(tmp_path / "o")]!r}))
    """))
    return run_mpi(n, str(script), module=False)


@pytest.mark.parametrize("n", [1, 2])
def test_a_stop_signal_while_mpi_starts_waits_for_it_then_ends_the_job(waited, n):
    """SIGTERM to rank 0 inside the start of MPI (where being killed would leave the
    library's shared-memory segment behind) is obeyed once MPI has started: the job ends
    with the stop's exit status and message, nothing written."""
    tmp_path, r = waited.result()
    assert r.returncode == 75, (r.returncode, r.stderr[-1500:])
    assert f"rank 0/{n}: stopped by SIGTERM while MPI started" in r.stderr
    assert not (tmp_path / "o").exists()


@_waits()
def _a_library_loop_with_one_step_too_few_on_a_rank_is_ended_by_the_watchdog(tmp_path):
    return _library_job(tmp_path, "dp = replica(watchdog=2.0)\n"
                        "for step in range(10 if comm.rank == 0 else 9):  # rank 1: one step less\n"
                        "    dp.step(X[:32], y[:32])\n")


def test_a_library_loop_with_one_step_too_few_on_a_rank_is_ended_by_the_watchdog(waited):
    _, r = waited.result()
    assert r.returncode == 3 and r.elapsed < 30, (r.returncode, r.stderr[-1500:])
    assert "stalled rank(s) [1]" in r.stderr and "at step 9" in r.stderr


def test_checkpoint_folders_belong_to_one_run(tmp_path, finished):
    ck = _copy(finished[1], tmp_path)
    a = ["--checkpoint-dir", str(ck), "--checkpoint-every", "5"]
    before = sorted(p.name for p in ck.glob("ckpt-*.npz"))
    r = run_mpi(2, *ARGS, *a, "--seed", "3", "--out", str(tmp_path / "two"))  # a fresh run
    assert r.returncode == 2 and "already holds checkpoints of another run" in r.stderr
    assert "--restart" in r.stderr and sorted(p.name for p in ck.glob("ckpt-*.npz")) == before
    r = run_mpi(2, *ARGS, *a, "--seed", "3", "--restart", "--out", str(tmp_path / "two"))
    assert r.returncode == 0, r.stderr


def test_resume_with_other_hyperparameters_is_announced_and_recorded(tmp_path, finished):
    ck = ["--checkpoint-dir", str(_copy(finished[1], tmp_path))]  # 3 epochs done
    r = run_mpi(2, *ARGS, *ck, "--lr", "0.005", "--epochs", "4", "--resume", "--out",
                str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    assert "resuming with changed hyperparameters: --lr 0.005 (the checkpoint used 0.01)" in r.stdout
    m = json.loads((tmp_path / "b" / "metrics.json").read_text())
    assert m["config"]["resume_changes"] == {"lr": {"checkpoint": 0.01, "now": 0.005}}
    r = run_mpi(2, *ARGS, *ck, "--epochs", "1", "--resume", "--out", str(tmp_path / "c"))
    assert r.returncode == 2 and "--epochs 1 is below what checkpoint" in r.stderr


def test_resume_on_changed_data_is_refused(tmp_path):
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((300, 5)), rng.integers(0, 3, 300)
    np.savez(tmp_path / "d.npz", X=X, y=y)
    args = ["train", "--dataset", str(tmp_path / "d.npz"), "--epochs", "1", "--hidden", "8",
            "--checkpoint-dir", str(tmp_path / "ck"), "--no-progress"]
    r = run_mpi(2, *args, "--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    X[7, 2] += 1.0  # same size, other contents
    np.savez(tmp_path / "d.npz", X=X, y=y)
    r = run_mpi(2, *args, "--epochs", "2", "--resume", "--out", str(tmp_path / "b"))
    assert r.returncode == 2 and "changed since checkpoint" in r.stderr, r.stderr


def test_tensorboard_event_files_are_written(finished):
    pytest.importorskip("tensorboardX")  # the 'tensorboard' extra
    scalars = tensorboard_scalars(finished[0].parent / "tb")
    assert [step for step, _ in scalars["epoch/loss"]] == [1, 2, 3]
    m = json.loads((finished[0] / "metrics.json").read_text())
    assert np.allclose([v for _, v in scalars["epoch/loss"]], [h["loss"] for h in m["history"]])


@pytest.fixture(scope="module")
def big_npz(tmp_path_factory) -> Path:
    """~470 MB of zeros, compressed: rank 0 inflates it for seconds."""
    data = tmp_path_factory.mktemp("big") / "big.npz"
    np.savez_compressed(data, X=np.zeros((150_000, 784), np.float32),
                        y=np.zeros(150_000, np.int64))
    return data


def _loading_job(tmp_path, data: Path, *args: str) -> subprocess.Popen:
    """A job of 2 ranks on the file ``data``."""
    return _start(2, "train", "--dataset", str(data), "--epochs", "1", "--no-progress", *args,
                  "--out", str(tmp_path / "out"), token=f"load-{tmp_path.name}")


def _rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _loading(job: subprocess.Popen) -> list[int]:
    """The two ranks' pids once rank 0 is inflating the data file (its memory grows): the
    ranks are looked up again while waiting, as a launcher's short-lived helper processes
    may carry the same environment."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and job.poll() is None:
        pids = _ranks(job, 2)
        if _rss_mb(pids[0]) >= 150:
            return pids
        time.sleep(0.02)
    raise AssertionError(f"loading never got under way: {job.poll()}")


@_waits()
def _sigterm_while_loading_ends_the_job_at_once(tmp_path, big_npz):
    job = _loading_job(tmp_path, big_npz)
    with _ending(job):
        pids = _loading(job)
        assert job.poll() is None, job.communicate()[1][-2000:]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        return _end(job, since=time.monotonic())


def test_sigterm_while_loading_ends_the_job_at_once(waited):
    """Nothing to checkpoint yet: a stop signal during loading ends the job promptly, every
    rank saying why, with the preemption exit status, instead of training first."""
    tmp_path, r = waited.result()
    assert r.returncode == 75, (r.returncode, r.stderr[-2000:])
    assert r.elapsed < 10
    assert "stopped by SIGTERM while loading the data" in r.stderr
    assert not (tmp_path / "out" / "model.npz").exists()


@_waits()
def _a_rank_stopped_while_loading_is_named_by_the_watchdog(tmp_path, big_npz):
    job = _loading_job(tmp_path, big_npz, "--watchdog", "3", "--watchdog-grace", "1")
    with _ending(job):
        os.kill(_loading(job)[0], signal.SIGSTOP)
        return _end(job)


def test_a_rank_stopped_while_loading_is_named_by_the_watchdog(waited):
    """Loading is watched too: a rank that stops answering mid-load (a hung file system
    would do the same) ends the job, named, instead of leaving the others waiting."""
    r = waited.result()[1]
    assert r.returncode == 3 and "stalled rank(s) [0]" in r.stderr, (r.returncode, r.stderr[-2000:])
