"""The fault row of ``bench_compare.py``: ``mpidp train`` with one rank SIGKILLed from
outside after a chosen step, then resumed on the survivors and compared with an
uninterrupted run (float64, so "the same result" can be checked to rounding)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_compare_report import LR, MOMENTUM
from benchmarks.harness import HERE, bench_env

# --- the fault row: mpidp train under a step counter, killed from outside ---------------

HOLD_S = 30.0  # the longest a rank to be killed waits for it (then it goes on)


def hold_env(env: dict, rank: int, step: int) -> dict:
    """``env`` for a job whose ``rank`` is killed after ``step`` (see :func:`cli_with_step_file`)."""
    return {**env, "MPIDP_BENCH_HOLD": f"{rank}:{step}"}

def cli_with_step_file(argv: list[str], folder: str) -> int:
    """Run ``mpidp <argv>`` on this rank, writing its pid and the number of training steps
    it finished (worker pushes for the asynchronous server) to ``folder/rank-R``, so that
    the driver can SIGKILL it after a chosen step; and the wall-clock time (``time.time()``)
    of each finished step to ``folder/rank-R.t``, of each checkpoint write's seconds to
    ``folder/ckpt-R.t``. The rank named by ``MPIDP_BENCH_HOLD=R:K`` (set by a driver that
    kills it) waits after its step K to be killed, so the kill lands after that step however
    fast steps are."""
    from mpidp.cli import main as cli
    from mpidp.observe.metrics import StepTimer
    from mpidp.parallel import Pipeline
    from mpidp.run import checkpoint
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    fd = os.open(os.path.join(folder, f"rank-{rank}"), os.O_WRONLY | os.O_CREAT, 0o644)
    times = os.open(os.path.join(folder, f"rank-{rank}.t"), flags, 0o644)
    done = {"n": 0}
    hold = os.environ.get("MPIDP_BENCH_HOLD", ":").split(":")

    def note(n: int) -> None:
        done["n"] = n
        os.pwrite(fd, f"{os.getpid()} {n:12d}\n".encode(), 0)
        if n:
            os.write(times, f"{time.time():.6f} {n}\n".encode())
        if [rank, str(n)] == hold:
            time.sleep(HOLD_S)  # the driver, polling the step file, kills this rank now

    write = checkpoint._write

    def timed_write(*args, **kw):
        t = time.perf_counter()
        out = write(*args, **kw)
        with open(os.path.join(folder, f"ckpt-{rank}.t"), "a") as f:
            f.write(f"{time.perf_counter() - t:.6f}\n")
        return out
    checkpoint._write = timed_write

    end_step, pipe_step = StepTimer.end_step, Pipeline.step

    def counted_end(self, n_samples):
        end_step(self, n_samples)
        note(done["n"] + 1)

    def counted_pipe(self, *args, **kw):
        out = pipe_step(self, *args, **kw)
        note(self.global_step)
        return out
    StepTimer.end_step, Pipeline.step = counted_end, counted_pipe
    note(0)
    return cli(argv)


def mode_flags(column: str, P: int) -> tuple[list[str], str]:
    """``mpidp train`` flags of ``column`` on ``P`` ranks, and how it runs there (a server
    needs a worker beside it, a 2-stage hybrid an even number of ranks)."""
    if column in ("ps", "async") and P < 2:
        return ["--sync", "allreduce"], "data parallel (a server needs a worker)"
    if column == "ps":
        return ["--sync", "ps", "--ps-placement", "dedicated", "--ps-transport", "mpi"], "ps"
    if column == "async":
        return ["--sync", "async-ps"], "async-ps"
    if column == "dp":
        return ["--sync", "allreduce"], "data parallel"
    parallel = "hybrid" if column == "hybrid" and P % 2 == 0 else "pipeline"
    return (["--parallel", parallel, "--micro-batches", "8", "--schedule", "1f1b"],
            f"{parallel} ({P if parallel == 'pipeline' else 2} stages)")


def _train_cmd(a, P: int, column: str, out: Path, ckpt: Path | None, resume: bool,
               step_dir: Path | None) -> list[str]:
    flags, _ = mode_flags(column, P)
    train = ["train", "--dataset", "synthetic", "--n-samples", str(a.n_fault), "--model", "mlp",
             "--hidden", a.fault_hidden, "--epochs", "1", "--batch-size",
             str(a.fault_batch), "--lr", str(LR), "--optimizer", "momentum", "--momentum",
             str(MOMENTUM), "--dtype", "float64", "--seed", "0", "--test-fraction", "0",
             "--no-progress", "--out", str(out), *flags]
    if ckpt is not None:
        train += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", str(a.ckpt_every),
                  "--keep-checkpoints", "1000"] + (["--resume"] if resume else [])
    head = [a.mpiexec, "-n", str(P), sys.executable]
    if step_dir is None:
        return head + ["-m", "mpidp", *train]
    return head + ["-m", "benchmarks.bench_compare", "--task", "cli", "--step-dir",
                   str(step_dir), "--", *train]


def _run_train(a, cmd: list[str]) -> tuple[int, float, str]:
    t = time.perf_counter()
    p = subprocess.run(cmd, env=bench_env()[0], capture_output=True, text=True, timeout=a.timeout,
                       cwd=HERE.parent)
    return p.returncode, time.perf_counter() - t, p.stdout + p.stderr


def _kill_after(a, cmd: list[str], step_file: Path, rank: int) -> dict:
    """Start the job, SIGKILL ``rank`` (its ``step_file``) once it has finished
    ``a.kill_step`` steps; returns the steps it finished and how long the job took to end."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=hold_env(bench_env()[0], rank, a.kill_step),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=HERE.parent)
    pid = done = 0
    while proc.poll() is None and time.perf_counter() - t0 < a.timeout:
        text = step_file.read_text() if step_file.exists() else ""
        if text.strip():
            pid, done = map(int, text.split())
            if done >= a.kill_step:
                os.kill(pid, signal.SIGKILL)
                break
        time.sleep(0.002)
    t_kill = time.perf_counter()
    output = proc.communicate(timeout=a.timeout)[0]
    t_end = time.perf_counter()
    done = int(step_file.read_text().split()[1])  # the killed rank writes no more
    return {"killed": done >= a.kill_step, "steps_done_at_kill": done, "rc": proc.returncode,
            "seconds_to_kill": t_kill - t0, "seconds_kill_to_end": t_end - t_kill,
            "output_tail": output[-600:]}


def _params(folder: Path) -> np.ndarray:
    with np.load(folder / "model.npz") as f:
        return f["params"]


def fault(a, column: str, P: int, tmp: Path) -> dict:
    """Row 3 for one column: uninterrupted run, run with the last rank killed, resumed run."""
    base = tmp / f"fault-{column}-{P}"
    ref_ck, kill_ck, steps = base / "ref-ck", base / "kill-ck", base / "steps"
    steps.mkdir(parents=True)
    rc, ref_wall, text = _run_train(a, _train_cmd(a, P, column, base / "ref", ref_ck, False, None))
    if rc != 0:
        raise RuntimeError(f"fault reference run failed ({column}, P={P}):\n{text[-2000:]}")
    checkpoints = True
    before = _shm_files()
    kill = _kill_after(a, _train_cmd(a, P, column, base / "kill", kill_ck if checkpoints else None,
                                     False, steps), steps / f"rank-{P - 1}", P - 1)
    _remove_shm_left(before)
    saved = sorted(kill_ck.glob("ckpt-*.npz")) if checkpoints else []
    last_ckpt = int(saved[-1].stem.split("-")[1]) if saved else 0
    resumed_from = f"step {last_ckpt}"
    if saved and column == "async" and P > 1:  # steps: the killed worker's own pushes
        from mpidp.run.checkpoint import read
        meta = read(str(saved[-1]))[0]
        last_ckpt = meta["partition"]["async"]["workers"][str(P - 1)][2]
        resumed_from = (f"the slowest worker's step {meta['step']} ({meta['global_step']} "
                        "pushes served)")
    survivors = P - 1
    resume_ck = kill_ck if checkpoints else None
    rc, res_wall, text = _run_train(a, _train_cmd(a, survivors, column, base / "resumed",
                                                  resume_ck, checkpoints, None))
    if rc != 0:
        raise RuntimeError(f"resumed run failed ({column}, P={P}):\n{text[-2000:]}")
    ref_m = json.loads((base / "ref" / "metrics.json").read_text())
    res_m = json.loads((base / "resumed" / "metrics.json").read_text())
    return {"column": column, "P": P, "checkpoints": checkpoints, **kill,
            "last_checkpoint_step": last_ckpt, "resumed_from": resumed_from,
            "steps_lost": kill["steps_done_at_kill"] - last_ckpt,
            "survivors": survivors, "resumed_as": mode_flags(column, survivors)[1],
            "uninterrupted_s": ref_wall, "resumed_s": res_wall,
            "recovery_overhead_s": kill["seconds_to_kill"] + kill["seconds_kill_to_end"]
            + res_wall - ref_wall,
            "final_loss_uninterrupted": ref_m["history"][-1]["loss"],
            "final_loss_resumed": res_m["history"][-1]["loss"],
            "max_param_diff": float(np.max(np.abs(_params(base / "ref") - _params(base / "resumed")))),
            "steps_total": -(-a.n_fault // a.fault_batch)}


def _shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("mpich_shm_*")}


def _remove_shm_left(before: set[str]) -> None:
    """A SIGKILLed job leaves MPICH's shared-memory files in /dev/shm (RAM): remove the
    ones it created that no live process uses (with the tests' helper)."""
    new = _shm_files() - before
    if not new:
        return
    from benchmarks.harness import shm_in_use as _shm_in_use
    in_use = _shm_in_use()
    for name in new - in_use:
        (Path("/dev/shm") / name).unlink(missing_ok=True)
