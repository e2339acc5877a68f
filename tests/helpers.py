"""Helpers shared by the tests: the repository's root, ``mpiexec`` jobs in a subprocess (always
with a timeout: a hang = a failure, and every process of the job is killed), a one-rank run
of the command line in this process (a one-process reference run, or a refusal), the command
line's parse errors, central finite differences, TensorBoard scalars."""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def mpiexec() -> str:
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    assert found, "mpiexec not found: install the 'mpi' extra (the mpich wheel) or a system MPI"
    return found


_JOBS = itertools.count()


def start_job(cmd: list[str], env: dict | None = None, token: str = "job",
              **popen) -> subprocess.Popen:
    """``cmd`` (an ``mpiexec`` job) in the background, with ``env`` over this environment;
    ``token``, made unique to this job, marks every process of it (``job.token``)."""
    token = f"{token}-{os.getpid()}-{next(_JOBS)}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {}), "MPIDP_TEST_TOKEN": token}
    job = subprocess.Popen(cmd, env=env, text=True, stdin=subprocess.DEVNULL, **popen)
    job.token = token
    return job


def job_processes(token: str):
    """The pid, environment and command line of every process whose environment holds
    ``token`` (a job's launcher, its helpers and its ranks)."""
    mark = f"MPIDP_TEST_TOKEN={token}".encode()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if mark in env:
            yield int(pid), env, cmd


def kill_job(job: subprocess.Popen) -> None:
    """SIGKILL every process of ``job``: its launcher and its ranks, which under Open MPI
    outlive a killed launcher (a hung one would spin on a core for the rest of the tests)."""
    for pid, _, _ in job_processes(job.token):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if job.poll() is None:
        job.kill()


def run_mpi(n: int, *args: str, cwd: Path | str | None = None, timeout: float = 120,
            module: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    """``mpiexec -n n python [-m mpidp] args...``; raises ``subprocess.TimeoutExpired`` (with
    the output so far) if it outlives ``timeout`` seconds, every process of it killed."""
    cmd = [mpiexec(), "-n", str(n), sys.executable, *(["-m", "mpidp"] if module else []), *args]
    with start_job(cmd, env, cwd=cwd or ROOT, stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE) as job:
        try:
            out, err = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_job(job)
            out, err = job.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, job.returncode, out, err)


def parser_refusal(capsys, *argv: str) -> str | None:
    """What ``mpidp ARGV`` prints when its parser refuses the arguments (exit 2), or None if
    it takes them; in this process: the parser refuses before MPI starts, alike on every rank
    (tests/cli/test_messages.py shows rank 0 alone speaking in a job)."""
    from mpidp.cli import build_parser
    try:
        build_parser().parse_args(list(argv))
    except SystemExit as exc:
        assert exc.code == 2
        return capsys.readouterr().err
    return None


def numgrad(f, x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    """Central-difference gradient (float64) of the scalar ``f()`` w.r.t. ``x``, which is
    perturbed in place, one element at a time, and restored."""
    g = np.zeros(x.shape)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    assert x.size == 0 or np.shares_memory(flat, x)  # perturbing flat perturbs x
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        gflat[i] = (fp - fm) / (2 * eps)
    return g


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the TensorBoard event files under ``folder`` (TFRecord framing read
    by hand, events parsed with tensorboardX's own protobuf classes)."""
    from tensorboardX.proto.event_pb2 import Event
    out: dict[str, list] = {}
    for root, _, files in os.walk(folder):
        for name in files:
            data = open(os.path.join(root, name), "rb").read()
            i = 0
            while i < len(data):
                (n,) = struct.unpack("<Q", data[i:i + 8])
                ev = Event.FromString(data[i + 12:i + 12 + n])
                i += 12 + n + 4
                for v in ev.summary.value:
                    out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def main_here(*argv: str) -> int | str | None:
    """``mpidp ARGV`` run in this process, a job of one rank; its exit status. For a run whose
    outputs are a one-process reference, and for refusals. mpidp's log handler is made afresh
    (on the stdout of the moment); the logger and the registered layers are restored after."""
    from mpidp.cli.main import main
    from mpidp.nn import layers
    from mpidp.observe.watch import log
    kept = log.handlers[:], log.propagate, log.level
    registered = dict(layers._CLASSES), dict(layers._NAMES)  # an --import's layers are its own
    log.handlers.clear()
    try:
        return main(list(argv))
    except SystemExit as exc:
        return exc.code
    finally:
        log.handlers[:], log.propagate = kept[:2]
        log.setLevel(kept[2])
        for registry, before in zip((layers._CLASSES, layers._NAMES), registered):
            registry.clear()
            registry.update(before)


def run_here(capsys, *argv: str) -> subprocess.CompletedProcess:
    """``mpidp ARGV`` run in this process, a job of one rank, reported as run_mpi reports a
    job: for refusals that do not hang on the number of ranks. mpidp's log handler is made
    afresh (on this test's captured stdout) and the logger restored after."""
    capsys.readouterr()
    code = main_here(*argv)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out, err)
