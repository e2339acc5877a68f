"""The elastic fault column of ``bench_compare.py``: data parallelism that survives a lost
rank (``mpidp train --elastic``, Open MPI's ULFM) against today's checkpoint-and-requeue
path, on the same workload as row 3 and the same MPI.

Three jobs of P ranks and one of P-1, each with a wall-clock timeline of every rank's
completed steps (:func:`benchmarks.bench_compare_fault.cli_with_step_file`):

* ``whole``: ``--elastic``, nothing killed: the model to compare with;
* ``elastic``: ``--elastic``, the last rank SIGKILLed from outside once it has finished
  ``kill_step`` steps; the survivors go on;
* ``requeue``: no ``--elastic``, checkpoints every ``ckpt_every`` steps, the same kill (the
  job ends), then ``--resume`` on the P-1 survivors as a requeued job would (the time the
  job waits in a scheduler's queue is not in the figures).

Under an MPI without ULFM (MPICH) the column is skipped with its reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_compare_fault import _params, _train_cmd, hold_env
from benchmarks.harness import HERE, bench_env

ULFM = ["--with-ft", "ulfm", "--mca", "btl", "tcp,self"]
SKIPPED = "skipped: needs Open MPI ULFM (mpiexec --with-ft ulfm)"


def ulfm_problem(mpiexec: str | None) -> str | None:
    """Why ``mpiexec`` cannot run the elastic column (None: it can)."""
    if not mpiexec or not Path(mpiexec).exists():
        return f"{SKIPPED}; no such mpiexec: {mpiexec}"
    if not (Path(mpiexec).parent / "ompi_info").exists():
        return f"{SKIPPED}; {mpiexec} is not Open MPI's"
    return None


def _env() -> dict:
    """The ranks' environment under Open MPI: as root, and more ranks than cores."""
    return {**bench_env()[0], "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


def _cmd(a, P: int, out: Path, steps: Path, *, elastic: bool, ckpt: Path | None = None,
         resume: bool = False) -> list[str]:
    """``_train_cmd`` for data parallelism under Open MPI's mpiexec and python."""
    cmd = _train_cmd(a, P, "dp", out, ckpt, resume, steps)
    mpiexec = a.elastic_mpiexec
    cmd[:4] = [mpiexec, *(ULFM if elastic else []), "-n", str(P),
               str(Path(mpiexec).parent / "python")]
    return cmd + (["--elastic"] if elastic else [])


def _timeline(folder: Path, rank: int) -> np.ndarray:
    """Wall-clock times (``time.time()``) at which ``rank`` finished each step."""
    path = folder / f"rank-{rank}.t"
    text = path.read_text() if path.exists() else ""
    return np.array([float(line.split()[0]) for line in text.splitlines()], np.float64)


def _run(a, cmd: list[str], steps: Path, kill_rank: int | None = None) -> dict:
    """Run the job; with ``kill_rank``, SIGKILL that rank once it has finished
    ``a.kill_step`` steps. Wall times are ``time.time()`` (the timelines' clock)."""
    steps.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    env = _env() if kill_rank is None else hold_env(_env(), kill_rank, a.kill_step)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=HERE.parent, stdin=subprocess.DEVNULL)
    t_kill = None
    step_file = steps / f"rank-{kill_rank}"
    try:
        while kill_rank is not None and proc.poll() is None and time.time() - t_start < a.timeout:
            text = step_file.read_text() if step_file.exists() else ""
            if text.strip() and int(text.split()[1]) >= a.kill_step:
                t_kill = time.time()
                os.kill(int(text.split()[0]), signal.SIGKILL)
                break
            time.sleep(0.002)
        output = proc.communicate(timeout=a.timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()  # this job's launcher, by its pid
        output = proc.communicate()[0]
        raise RuntimeError(f"timed out after {a.timeout} s: {' '.join(cmd)}\n"
                           f"{output[-3000:]}") from None
    return {"rc": proc.returncode, "t_start": t_start, "t_kill": t_kill, "t_end": time.time(),
            "output": output}


def _rate(a, times: np.ndarray) -> float:
    """Samples per second over the steps finished at ``times`` (the first as the start)."""
    return a.fault_batch * (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0


def elastic(a, P: int, tmp: Path) -> dict:
    """The elastic column and its checkpoint-and-requeue comparison at ``P`` ranks."""
    problem = ulfm_problem(a.elastic_mpiexec)
    if problem is not None:
        return {"P": P, "skipped": problem}
    base, victim = tmp / f"elastic-{P}", P - 1
    whole = _run(a, _cmd(a, P, base / "whole", base / "whole-t", elastic=True), base / "whole-t")
    if whole["rc"] != 0:
        raise RuntimeError(f"uninterrupted elastic run failed (P={P}):\n{whole['output'][-3000:]}")
    run = _run(a, _cmd(a, P, base / "elastic", base / "elastic-t", elastic=True),
               base / "elastic-t", victim)
    if run["rc"] not in (0, 137, -9, 9) or not (base / "elastic" / "model.npz").exists():
        raise RuntimeError(f"elastic run failed (P={P}, rc {run['rc']}):\n{run['output'][-3000:]}")
    t_kill = run["t_kill"]
    lines = {r: _timeline(base / "elastic-t", r) for r in range(P)}
    done = min(int(np.sum(lines[r] <= t_kill)) for r in range(P - 1))  # every survivor's
    loss = json.loads((base / "elastic" / "metrics.json").read_text())["lost_ranks"][0]
    steps_total = -(-a.n_fault // a.fault_batch)
    # rank 0 finished steps 1..low (or low+1, recomputed), then low+1..steps_total again
    before = lines[0][lines[0] <= t_kill]
    after = lines[0][len(lines[0]) - (steps_total - loss["step"]):]
    out = {"P": P, "survivors": P - 1, "killed_rank": victim, "rc": run["rc"],
           "steps_total": steps_total, "steps_done_at_kill": done,
           "went_on_from_step": loss["step"], "updates_lost": max(done - loss["step"], 0),
           "steps_recomputed": loss["steps_recomputed"],
           "seconds_to_recover": loss["seconds_to_recover"],
           "kill_to_next_step_s": float(after[0] - t_kill),
           "kill_to_end_s": run["t_end"] - t_kill, "total_s": run["t_end"] - run["t_start"],
           "uninterrupted_s": whole["t_end"] - whole["t_start"],
           "samples_s_before": _rate(a, before[1:]), "samples_s_after": _rate(a, after),
           "samples_s_uninterrupted": _rate(a, _timeline(base / "whole-t", 0)[1:]),
           "steps_finished_rank0": len(lines[0]), "lost_record": loss,
           "max_param_diff": float(np.max(np.abs(_params(base / "whole")
                                                 - _params(base / "elastic"))))}
    out["requeue"] = requeue(a, P, base)
    out["pipeline_refused"] = pipeline_refused(a, P, base)
    return out


def pipeline_refused(a, P: int, base: Path) -> dict:
    """``--elastic`` asked of a pipeline: its exit status and the line that refuses it."""
    cmd = _cmd(a, P, base / "pipeline", base / "pipe-t", elastic=True)
    cmd[cmd.index("--sync"):cmd.index("--sync") + 2] = ["--parallel", "pipeline"]
    got = _run(a, cmd, base / "pipe-t")
    line = next((x for x in got["output"].splitlines() if "--elastic" in x), "")
    return {"rc": got["rc"], "line": line.strip()}


def requeue(a, P: int, base: Path) -> dict:
    """Today's path: checkpoints, the kill ends the job, ``--resume`` on the survivors."""
    ck = base / "ck"
    run = _run(a, _cmd(a, P, base / "kill", base / "kill-t", elastic=False, ckpt=ck),
               base / "kill-t", P - 1)
    saved = sorted(ck.glob("ckpt-*.npz"))
    if run["t_kill"] is None or not saved:
        raise RuntimeError(f"requeue run: no kill or no checkpoint (P={P}):\n"
                           f"{run['output'][-3000:]}")
    t_kill = run["t_kill"]
    before = _timeline(base / "kill-t", 0)
    before = before[before <= t_kill]
    last = int(saved[-1].stem.split("-")[1])
    done = len(before)
    writes = [float(x) for f in (base / "kill-t").glob("ckpt-*.t") for x in f.read_text().split()]
    res = _run(a, _cmd(a, P - 1, base / "resumed", base / "res-t", elastic=False, ckpt=ck,
                       resume=True), base / "res-t")
    if res["rc"] != 0:
        raise RuntimeError(f"resumed run failed (P={P - 1}):\n{res['output'][-3000:]}")
    line = _timeline(base / "res-t", 0)
    new = done - last  # the resumed job's first step beyond the killed job's last
    return {"steps_done_at_kill": done, "last_checkpoint_step": last, "updates_lost": done - last,
            "checkpoint_write_s": float(np.mean(writes)), "checkpoints_written": len(writes),
            "kill_to_job_end_s": run["t_end"] - t_kill,
            "restart_to_first_step_s": float(line[0] - res["t_start"]),
            "kill_to_next_step_s": float(run["t_end"] - t_kill + line[new] - res["t_start"]),
            "samples_s_before": _rate(a, before[1:]), "samples_s_after": _rate(a, line[1:]),
            "max_param_diff": float(np.max(np.abs(_params(base / "whole")
                                                  - _params(base / "resumed"))))}
