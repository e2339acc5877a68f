"""Data parallel vs pipeline (GPipe, 1F1B) vs hybrid, measured: ``make bench-parallel``.

The driver launches one ``mpiexec -n P`` job per (mode, model, P), so each job's peak RSS
is its own, and writes JSON, Markdown and a PNG. Models: uniform MLPs of width ``w`` and
depth ``d`` (``d`` Dense ``w x w`` layers, ReLU between, ``w`` classes), float32, plain
SGD, synthetic data, global batch ``--batch``. One BLAS thread per rank.

Per job and rank: parameter bytes (params + grads + optimizer state) and activation bytes
the process holds (peak of arrays cached for backward, plus pipeline outputs in flight),
peak RSS (VmHWM) and the RSS before the model was built; payload bytes handed to MPI per
step; step time between barriers (slowest rank, median of repeats) and process CPU time;
idle (bubble) fraction per rank, two ways:

* ``wall``: 1 - (seconds inside this rank's forward/backward ops) / (the step's makespan,
  first start to last end over all ranks, after a barrier). Faithful when every rank has a
  core; inflated when ranks are oversubscribed (P=4 on 2 cores: a ready rank waits for a CPU).
* ``replay``: each op's *process CPU time* (unaffected by waiting for a core) is replayed
  through the schedule's real dependencies (:func:`mpidp.parallel.stages.replay`), giving
  each rank's idle share as if every rank had its own core; communication time excluded.

Run: ``python benchmarks/bench_parallel.py --out benchmarks/results/parallel``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_parallel_report import layers as model_layers_of
from benchmarks.harness import command, git_commit, quick_defaults

HERE = Path(__file__).resolve().parent
MODES = ("data", "gpipe", "1f1b", "hybrid")


# --- worker: one job under mpiexec ------------------------------------------------------

def rss_kib(field: str = "VmHWM") -> int:
    """This process's ``VmHWM`` (peak RSS) or ``VmRSS`` from /proc, in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return -1


def _timed(comm, step, steps: int, warmup: int, repeats: int) -> tuple[float, float]:
    """Median (over repeats) of the slowest rank's seconds per step, and this rank's CPU s/step."""
    import time as _t
    for _ in range(warmup):
        step()
    walls, cpus = [], []
    for _ in range(repeats):
        comm.Barrier()
        t, c = _t.perf_counter(), _t.process_time()
        for _ in range(steps):
            step()
        comm.Barrier()
        walls.append(comm.allreduce(_t.perf_counter() - t, op=__import__("mpi4py").MPI.MAX) / steps)
        cpus.append((_t.process_time() - c) / steps)
    return statistics.median(walls), statistics.median(cpus)


def run_data(comm, a, X, y, rss0) -> dict:
    import mpidp
    from mpidp import nn
    from mpidp.data.partition import block_range
    from mpidp.parallel.stages import held_bytes
    layers, loss = model_layers_of(a.width, a.depth)
    model = nn.Sequential(layers, a.width, np.float32).init_(0)
    dp = mpidp.DataParallel(model, nn.SGD(0.05), loss, comm)
    lo, hi = block_range(len(X), comm.size, comm.rank)
    Xl, yl = X[lo:hi], y[lo:hi]
    wall, cpu = _timed(comm, lambda: dp.step(Xl, yl), a.steps, a.warmup, a.repeats)
    idle = dp.timer.comm_s / (dp.timer.comm_s + dp.timer.compute_s)
    return {"param_bytes": model.params.nbytes + dp.buf.nbytes, "activation_bytes":
            held_bytes(model.layers, Xl) + len(Xl) * a.width * 4,  # + the loss gradient (n, w)
            "comm_bytes": dp.buf.nbytes,
            "step_s": wall, "cpu_s": cpu, "idle_wall": idle, "rss0_kib": rss0}


def _bubble(comm, pipe, step, reps: int) -> dict:
    """Per-rank idle share of traced steps (each after a barrier): by wall clock (median over
    steps), and by replaying each op's median CPU time over the steps."""
    from mpidp.parallel import stages as St
    walls, cpu = [], []
    for _ in range(reps):
        pipe.counters.trace.clear()
        pipe.tracing = True
        comm.Barrier()
        step()
        pipe.tracing = False
        ops = [e for e in pipe.counters.trace if e[0] != "step"]
        start = pipe.counters.trace[-1][2]
        row = (start, ops[-1][3], sum(e[3] - e[2] for e in ops), [e[4] for e in ops])
        rows = pipe.pipe.allgather(row)
        span = max(r[1] for r in rows) - min(r[0] for r in rows)
        walls.append(1 - row[2] / span)
        cpu.append([r[3] for r in rows])
    scheds = [St.schedule(pipe.schedule, pipe.n_stages, s, pipe.micro_batches)
              for s in range(pipe.n_stages)]
    durations = [np.median([c[s] for c in cpu], axis=0) for s in range(pipe.n_stages)]
    busy, makespan = St.replay(scheds, durations)
    return {"idle_wall": statistics.median(walls), "idle_replay": 1 - busy[pipe.stage] / makespan,
            "stage_busy_s": busy.tolist(), "makespan_s": makespan}


def run_pipeline(comm, a, X, y, rss0, m: int | None = None, sweep: bool = False) -> dict:
    from mpidp import nn
    from mpidp.data.partition import block_range
    from mpidp.parallel import Pipeline
    layers, loss = model_layers_of(a.width, a.depth, a.n_in)
    n_stages = 2 if a.mode == "hybrid" else comm.size
    schedule = "1f1b" if a.mode == "hybrid" else a.mode
    m = m or a.micro_batches
    pipe = Pipeline(layers, a.n_in or a.width, nn.SGD(0.05), loss, comm, n_stages=n_stages,
                    micro_batches=m, schedule=schedule, dtype=np.float32).init_(0)
    lo, hi = block_range(len(X), pipe.n_replicas, pipe.replica)
    Xl, yl = (X[lo:hi] if pipe.first else None), (y[lo:hi] if pipe.last else None)
    step = lambda: pipe.step(Xl, yl, hi - lo)
    step()
    pipe.counters.reset()
    if sweep:  # only the bubble and the activation peak: no throughput runs
        wall = cpu = n_steps = 1
    else:
        wall, cpu = _timed(comm, step, a.steps, a.warmup, a.repeats)
        n_steps = a.steps * a.repeats + a.warmup
    c = pipe.counters
    comm_bytes = (c.p2p_bytes + c.allreduce_bytes) / n_steps
    bubble = _bubble(comm, pipe, step, a.bubble_reps)  # traced steps also set the memory peaks
    out = {"param_bytes": pipe.model.params.nbytes + pipe._buf.nbytes,
           "activation_bytes": c.peak_activation_bytes, "cached_bytes": c.peak_cached_bytes,
           "comm_bytes": comm_bytes, "step_s": wall,
           "cpu_s": cpu, "rss0_kib": rss0, "stage": pipe.stage, "bounds": pipe.plan.bounds,
           "m": m, "stages": n_stages}
    out.update(bubble)
    return out


def worker(a) -> None:
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rng = np.random.default_rng(0)
    X = rng.standard_normal((a.batch, a.n_in or a.width)).astype(np.float32)
    y = rng.integers(0, a.width, a.batch)
    rss0 = rss_kib("VmRSS")
    if a.sweep:
        rows = [comm.gather(run_pipeline(comm, a, X, y, rss0, m, True)) for m in a.sweep]
    else:
        run = run_data if a.mode == "data" else run_pipeline
        result = run(comm, a, X, y, rss0)
        result["rss_peak_kib"] = rss_kib()
        rows = comm.gather(result)
    if comm.rank == 0:
        Path(a.json).write_text(json.dumps(rows))


# --- driver -----------------------------------------------------------------------------

def launch(a, P: int, extra: list[str], tmp: Path) -> list:
    """Run one worker job under ``mpiexec -n P``; returns rank 0's gathered rows."""
    out = tmp / f"job-{time.monotonic_ns()}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    cmd = [a.mpiexec, "-n", str(P), sys.executable, "-m", "benchmarks.bench_parallel", "--worker",
           "--json", str(out), "--batch", str(a.batch), "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--repeats", str(a.repeats),
           "--bubble-reps", str(a.bubble_reps), *extra]
    subprocess.run(cmd, env=env, check=True, timeout=a.timeout)
    return json.loads(out.read_text())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="benchmarks/results/parallel", help="path prefix for .json/.md/.png")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--models", default="256x4,512x4,1024x4,1024x8", help="WIDTHxDEPTH,...")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bubble-reps", type=int, default=15, help="traced steps per bubble figure")
    p.add_argument("--sweep-model", default="1024x16", help="model of the bubble-vs-m sweep")
    p.add_argument("--sweep-in", type=int, default=0,
                   help="input width of the sweep model (default 1.5 x width: the first layer, "
                        "whose backward skips dL/dx, then costs the FLOPs of the others, so "
                        "the stages can be balanced as (P-1)/(m+P-1) assumes)")
    p.add_argument("--sweep", default="1,2,4,8,16", help="micro-batch counts of the sweep")
    p.add_argument("--budget-mib", type=float, default=256, help="memory budget per rank")
    p.add_argument("--budget-depth", type=int, default=8)
    p.add_argument("--mpiexec", default=str(Path(sys.executable).parent / "mpiexec"))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--from-raw", action="store_true", help="only rebuild the reports from OUT.raw.json")
    # worker-only
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=MODES, default="data", help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=256, help=argparse.SUPPRESS)
    p.add_argument("--depth", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--n-in", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--micro-batches", type=int, default=4, help=argparse.SUPPRESS)
    p.add_argument("--sweep-ms", default="", help=argparse.SUPPRESS)
    quick_defaults(p, ranks="2", steps=1, warmup=0, repeats=1, bubble_reps=2, models="64x4",
                   sweep_model="32x4", sweep="1,2")
    a = p.parse_args(argv)
    if a.worker:
        a.sweep = [int(s) for s in a.sweep_ms.split(",") if s]
        worker(a)
        return 0
    from benchmarks.bench_parallel_report import write_reports
    raw = Path(a.out).with_suffix(".raw.json")
    if a.from_raw:
        results = json.loads(raw.read_text())
    else:
        results = drive(a)
        raw.write_text(json.dumps(results))
    write_reports(a, results)
    return 0


def drive(a) -> dict:
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-parallel-") as tmp:
        return _drive(a, Path(tmp))


def _drive(a, tmp: Path) -> dict:
    ranks = [int(r) for r in a.ranks.split(",")]
    runs, sweeps = [], []
    for P in ranks:
        for model in a.models.split(","):
            w, d = map(int, model.split("x"))
            for mode in MODES:
                if mode == "hybrid" and P < 4:
                    continue  # 2 stages x 1 replica is the pipeline itself
                rows = launch(a, P, ["--mode", mode, "--width", str(w), "--depth", str(d),
                                     "--micro-batches", str(2 * P)], tmp)
                runs.append({"P": P, "mode": mode, "width": w, "depth": d, "m": 2 * P, "batch": a.batch,
                             "ranks": rows})
                print(f"P={P} {mode:>6} {model:>8}: step {rows[0]['step_s'] * 1e3:.1f} ms", flush=True)
        w, d = map(int, a.sweep_model.split("x"))
        n_in = a.sweep_in or round(1.5 * w)
        for schedule in ("gpipe", "1f1b"):
            rows = launch(a, P, ["--mode", schedule, "--width", str(w), "--depth", str(d),
                                 "--n-in", str(n_in), "--sweep-ms", a.sweep], tmp)
            sweeps.append({"P": P, "schedule": schedule, "width": w, "depth": d, "n_in": n_in,
                           "by_m": rows})
            print(f"P={P} sweep {schedule} done", flush=True)
    env = {"python": platform.python_version(), "numpy": np.__version__, "cpus": os.cpu_count(),
           "machine": platform.machine(), "processor": platform.processor(),
           "command": command("bench_parallel"), "commit": git_commit(),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return {"runs": runs, "sweeps": sweeps, "env": env}


if __name__ == "__main__":
    sys.exit(main())
