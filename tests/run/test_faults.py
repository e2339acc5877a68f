"""Fault injection end to end: failures end the job, checkpoints bring the work back.

Each job runs under ``mpiexec`` in a subprocess with a timeout, with faults planned by
``MPIDP_FAULT=kind@rank:step`` (see mpidp/faults.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers import run_here, run_mpi

from mpidp.run.checkpoint import list_checkpoints, read

# 480 training samples / batch 32 = 15 steps per epoch; 3 epochs = 45 steps.
ARGS = ["train", "--dataset", "synthetic", "--n-samples", "600", "--n-features", "10",
        "--dtype", "float64", "--epochs", "3", "--batch-size", "32", "--optimizer", "adam",
        "--lr", "0.01", "--hidden", "16", "--no-progress"]


def _train(n, out, *extra, fault=None, timeout=120, env=None):
    env = {**({"MPIDP_FAULT": fault} if fault else {}), **(env or {})}
    t = time.monotonic()
    r = run_mpi(n, *ARGS, "--out", str(out), *extra, timeout=timeout, env=env)
    r.elapsed = time.monotonic() - t
    return r


SHM = Path("/dev/shm")


class JobShm:
    """The /dev/shm files that the processes of ONE job map or hold open, so that a test
    judges only its own job, whatever other MPI jobs on the machine create meanwhile.

    The job is launched with :attr:`env` (a variable holding a unique token; mpiexec passes
    the environment on to every rank); a thread looks every 20 ms at the processes whose
    environment holds that token and records their /dev/shm files in :attr:`seen`.
    A segment lives from ``MPI_Init`` to the end of the job, far longer than 20 ms.
    """

    def __init__(self) -> None:
        token = uuid.uuid4().hex
        self.env = {"MPIDP_TEST_JOB": token}
        self._marker = f"MPIDP_TEST_JOB={token}".encode()
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._others = {p.name for p in Path("/proc").iterdir() if p.name.isdigit()}  # older

    def _scan(self) -> None:
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or proc.name in self._others:
                continue
            try:
                if self._marker not in (proc / "environ").read_bytes().split(b"\0"):
                    continue  # not (yet) the job's: a forked child may exec into it later
                for line in (proc / "maps").read_text().splitlines():
                    if "/dev/shm/" in line:
                        self.seen.add(line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)"))
                for fd in (proc / "fd").iterdir():
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        self.seen.add(target[len("/dev/shm/"):].removesuffix(" (deleted)"))
            except OSError:  # ended meanwhile, or not ours to read
                continue

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self._scan()

    def left(self) -> set[str]:
        """The job's files still in /dev/shm."""
        return {name for name in self.seen if (SHM / name).exists()}

    def __enter__(self) -> JobShm:
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _params(out):
    return np.load(os.path.join(out, "model.npz"))["params"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted float64 training on 2 ranks."""
    out = tmp_path_factory.mktemp("ref")
    r = _train(2, out)
    assert r.returncode == 0, r.stderr
    return _params(out)


@pytest.fixture(scope="module")
def raised_job(tmp_path_factory):
    """A run on 2 ranks that rank 1 ended at step 12 (in epoch 1: nothing in --out yet),
    its /dev/shm files watched: the job, its --out, the watch and its checkpoints (steps 5
    and 10)."""
    base = tmp_path_factory.mktemp("raised")
    with JobShm() as shm:
        r = _train(2, base / "a", "--checkpoint-dir", str(base / "ck"), "--checkpoint-every",
                   "5", fault="raise@1:12", env=shm.env)
    return r, base / "a", shm, base / "ck"


@pytest.fixture(scope="module")
def raised(raised_job):
    """The checkpoints (steps 5, 10) of the run that rank 1 ended at step 12."""
    assert raised_job[0].returncode != 0
    return raised_job[3]


@pytest.mark.parametrize("n", [2, 3])
def test_exception_on_rank_1_at_step_k_ends_the_job(tmp_path, raised_job, n):
    """On 2 ranks: the run that writes the checkpoints below (rank 1 raises at step 12);
    on 3 ranks, a job of its own (rank 1 raises at step 5)."""
    if n == 2:
        r, out, shm, _ = raised_job
        step = 12
    else:
        out, step = tmp_path / "out", 5
        with JobShm() as shm:
            r = _train(n, out, fault="raise@1:5", env=shm.env)
    assert r.returncode != 0 and r.elapsed < 30
    assert f"rank 1/{n} failed" in r.stderr
    assert f"injected fault on rank 1 at step {step}" in r.stderr
    assert not out.exists()
    # the aborting rank removed MPICH's shared-memory files, which would outlive the job
    if SHM.is_dir():
        assert any(name.startswith(("mpich_shm_", "sm_segment.", "vader_segment."))
                   for name in shm.seen), "the watch saw no segment"
        assert shm.left() == set()


def test_sigkill_mid_epoch_then_resume_equals_uninterrupted(tmp_path, reference):
    ck = tmp_path / "ck"
    r = _train(2, tmp_path / "a", "--checkpoint-dir", str(ck), "--checkpoint-every", "4",
               fault="kill@1:22")
    assert r.returncode != 0 and r.elapsed < 30
    assert [os.path.basename(p) for p in list_checkpoints(ck)] == [
        "ckpt-0000000012.npz", "ckpt-0000000016.npz", "ckpt-0000000020.npz"]  # keeps 3
    r = _train(2, tmp_path / "b", "--checkpoint-dir", str(ck), "--checkpoint-every", "4", "--resume")
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout and "step 5, 20 steps done" in r.stdout
    assert np.array_equal(_params(tmp_path / "b"), reference)  # bit-identical, same world size


def test_stop_after_k_steps_and_resume_k_more_is_bit_identical(tmp_path, reference):
    ck = tmp_path / "ck"
    r = _train(2, tmp_path / "a", "--checkpoint-dir", str(ck), "--checkpoint-every", "1000",
               "--epochs", "1")  # ends after epoch 1: its final checkpoint is step 15
    assert r.returncode == 0, r.stderr
    r = _train(2, tmp_path / "b", "--checkpoint-dir", str(ck), "--resume", "--epochs", "3")
    assert r.returncode == 0, r.stderr
    assert np.array_equal(_params(tmp_path / "b"), reference)
    hist = json.loads((tmp_path / "b" / "metrics.json").read_text())["history"]
    assert [h["epoch"] for h in hist] == [1, 2, 3]


def test_parameter_server_resumes_bit_identical(tmp_path, reference):
    """--sync ps through shared memory (the server's parameters live in its window, and a
    restore writes them there): stop after epoch 1, resume, and at 2 ranks end on the very
    bits of allreduce training (each sum is one addition; the server's update is the one
    every replica would make)."""
    ck = tmp_path / "ck"
    r = _train(2, tmp_path / "a", "--sync", "ps", "--checkpoint-dir", str(ck),
               "--checkpoint-every", "1000", "--epochs", "1")
    assert r.returncode == 0, r.stderr
    r = _train(2, tmp_path / "b", "--sync", "ps", "--checkpoint-dir", str(ck), "--resume")
    assert r.returncode == 0, r.stderr
    assert "resumed from" in r.stdout
    assert np.array_equal(_params(tmp_path / "b"), reference)


@pytest.mark.parametrize("before,after", [(4, 2), (2, 4)])
def test_elastic_resume_on_another_world_size(tmp_path, reference, raised, before, after):
    """From 4 ranks: a run that rank 0 ended at step 27 (checkpoints every 5 steps); from 2:
    the checkpoints of the run rank 1 ended at step 12 (newest: step 10)."""
    ck = tmp_path / "ck"
    if before == 2:
        shutil.copytree(raised, ck)
    else:
        r = _train(before, tmp_path / "a", "--checkpoint-dir", str(ck), "--checkpoint-every",
                   "5", fault="raise@0:27")
        assert r.returncode != 0
    r = _train(after, tmp_path / "b", "--checkpoint-dir", str(ck), "--resume")
    assert r.returncode == 0, r.stderr
    assert f"written with {before} ranks, now {after}" in r.stdout
    # same global batches; only the summation order differs (see tests/mpi tolerance note)
    np.testing.assert_allclose(_params(tmp_path / "b"), reference, rtol=1e-9, atol=1e-11)


def _damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
        return
    # flip bytes inside the stored parameter values (not in zip padding or extra fields)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo("params.npy")
    local = info.header_offset
    start = local + 30 + int.from_bytes(data[local + 26:local + 28], "little") \
        + int.from_bytes(data[local + 28:local + 30], "little")
    at = start + info.file_size - 16  # the last values of the array
    for i in range(at, at + 8):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_damaged_checkpoint_is_refused_and_the_previous_one_used(tmp_path, reference, raised,
                                                                 how):
    ck = tmp_path / "ck"
    shutil.copytree(raised, ck)
    newest = ck / "ckpt-0000000010.npz"
    _damage(newest, how)
    with pytest.raises(ValueError, match="unreadable|checksum"):
        read(str(newest))
    r = _train(2, tmp_path / "b", "--checkpoint-dir", str(ck), "--checkpoint-every", "5", "--resume")
    assert r.returncode == 0, r.stderr
    assert "ckpt-0000000010.npz" in r.stderr and "previous good checkpoint" in r.stderr
    assert "resumed from" in r.stdout and "ckpt-0000000005.npz" in r.stdout
    assert np.array_equal(_params(tmp_path / "b"), reference)


def test_every_checkpoint_damaged_is_a_clear_error(tmp_path, raised):
    ck = tmp_path / "ck"
    shutil.copytree(raised, ck)
    for p in list_checkpoints(ck):
        _damage(type(tmp_path)(p), "flip")
    r = _train(2, tmp_path / "b", "--checkpoint-dir", str(ck), "--resume")
    assert r.returncode == 2 and "no usable checkpoint" in r.stderr
    assert not (tmp_path / "b").exists()


def test_resume_with_other_settings_is_refused(tmp_path, capsys, raised):
    """Resumed by one rank in this process (jobs above and below end on refusals)."""
    shutil.copytree(raised, tmp_path / "ck")
    r = run_here(capsys, *ARGS, "--out", str(tmp_path / "b"), "--checkpoint-dir",
              str(tmp_path / "ck"), "--resume", "--batch-size", "16")
    assert r.returncode == 2 and "--batch-size 32 (now 16)" in r.stderr
    assert not (tmp_path / "b").exists()


def test_nan_gradient_stops_and_never_overwrites_the_good_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    r = _train(2, tmp_path / "out", "--checkpoint-dir", str(ck), "--checkpoint-every", "3",
               fault="nan@1:7")
    assert r.returncode == 2 and "non-finite loss or gradient at step 7" in r.stderr
    assert os.path.basename(list_checkpoints(ck)[-1]) == "ckpt-0000000006.npz"
    meta, arrays = read(list_checkpoints(ck)[-1])
    assert np.isfinite(arrays["params"]).all() and meta["global_step"] == 6
    assert not (tmp_path / "out").exists()


def test_nan_gradient_skip_policy_drops_only_that_update(tmp_path):
    r = _train(2, tmp_path / "out", "--on-nonfinite", "skip", fault="nan@0:7")
    assert r.returncode == 0, r.stderr
    m = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert m["skipped_steps"] == 1 and m["steps"] == 45
    assert all(np.isfinite(h["loss"]) for h in m["history"])
    assert np.isfinite(_params(tmp_path / "out")).all()


def test_desync_is_detected_and_names_the_rank(tmp_path):
    r = _train(3, tmp_path / "out", "--check-every", "2", fault="desync@2:3")
    assert r.returncode == 2
    assert "parameters differ from rank 0's on ranks [2]" in r.stderr


def test_watchdog_names_the_rank_that_never_arrived(tmp_path):
    r = _train(3, tmp_path / "out", "--watchdog", "2", fault="hang@2:4", timeout=60)
    assert r.returncode != 0 and r.elapsed < 30
    assert "stalled rank(s) [2]" in r.stderr
    assert "rank 0: waiting in MPI in an Allreduce" in r.stderr and "at step 4" in r.stderr


def test_watchdog_ends_a_wait_in_any_collective_of_a_library_program(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(
        "import time\nimport mpidp\nfrom mpi4py import MPI\nfrom mpidp import nn\n"
        "comm = MPI.COMM_WORLD\n"
        "dp = mpidp.DataParallel(nn.mlp(4, (8,), 2).init_(0), nn.SGD(0.1), nn.SoftmaxCrossEntropy(),"
        " comm, watchdog=1.0)\n"
        "if comm.rank == 1:\n    time.sleep(120)  # a stuck rank\n"
        "mpidp.comm.barrier(comm)  # any collective of mpidp.comm is watched\n")
    t = time.monotonic()
    r = run_mpi(2, str(script), module=False, timeout=60)
    assert r.returncode != 0 and time.monotonic() - t < 30
    assert "stalled rank(s) [1]" in r.stderr and "Aborting the job" in r.stderr
    assert "rank 0: waiting in MPI in a Barrier" in r.stderr


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_check_flags_nan_and_inf_but_not_huge_finite_values(dtype):
    """The per-step NaN/Inf check: a dot product whose overflow (squares of finite values
    past the dtype's range) must not be mistaken for a non-finite gradient."""
    from mpidp.parallel.data_parallel import all_finite
    big = np.sqrt(np.finfo(dtype).max) * 4  # its square overflows; the value does not
    v = np.linspace(-1, 1, 1001).astype(dtype)
    assert all_finite(v)
    v[500] = big
    with np.errstate(over="ignore"):
        assert all_finite(v) and not np.isfinite(np.dot(v, v))
    for bad in (np.nan, np.inf, -np.inf):
        w = v.copy()
        w[-1] = bad
        assert not all_finite(w)


def test_shm_room_reads_the_free_space(tmp_path):
    """The parameter server's guard against shared windows bigger than /dev/shm."""
    from mpidp import comm as C
    assert C.shm_room(0, str(tmp_path)) and not C.shm_room(1 << 62, str(tmp_path))
    assert C.shm_room(1 << 62, str(tmp_path / "missing"))  # no such mount: not our call


OUT_HOLDER = """
import sys, time
from mpidp.run.folders import hold_folder
held = hold_folder(sys.argv[1], "out")
print("held" if held is not None else "no lock", flush=True)
time.sleep(120)
"""


def test_a_second_job_into_the_same_out_is_refused_and_writes_nothing(tmp_path, capsys):
    """Two jobs would truncate and interleave each other's history.jsonl: while one holds
    --out (a lock on its path), another is refused on every rank, exit 2. The holder gone,
    one rank in this process trains into it and lets the lock go at its end."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("kept")
    p = subprocess.Popen([sys.executable, "-c", OUT_HOLDER, str(out)], stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        r = _train(2, out)
        assert r.returncode == 2, r.stderr[-2000:]
        assert f"--out {out} is in use by another mpidp job" in r.stderr
        assert sorted(os.listdir(out)) == ["mine.txt"]
    finally:
        p.kill()
        p.wait()
    r = run_here(capsys, *ARGS, "--out", str(out))  # the holder gone, the folder is free
    assert r.returncode == 0, r.stderr[-2000:]
    assert "history.jsonl" in os.listdir(out) and not (out / ".lock").exists()
