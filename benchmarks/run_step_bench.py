"""Driver behind ``make bench``: run ``bench_step.py`` at P = 1 and 2 ranks, compare mpidp with
the hand-written loop, write ``benchmarks/results/step_bench.{json,md}``.

Each run is ``mpiexec -n P python benchmarks/bench_step.py`` in a subprocess with a timeout,
one BLAS thread per rank, and ``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE`` removed from that
command's environment (set on some of our machines, they slow numpy's OpenBLAS down).
Targets are checked and printed as PASS/FAIL; a miss does not fail the command (this is a
benchmark, not a test).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
IMPLS = ("mpidp", "handwritten")
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
DROP_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
BUSY_WARN = 0.10  # warn when the machine is this busy before a job
MAX_STEP_RATIO = 1.05  # target: mpidp's step time within 5% of the hand-written loop's


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", default="1,2", help="comma-separated world sizes to run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each implementation")
    p.add_argument("--steps", type=int, default=60, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each run")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per mpiexec job")
    p.add_argument("--mpiexec", default=str(REPO / ".venv" / "bin" / "mpiexec"))
    p.add_argument("--python", default=sys.executable, help="interpreter for the ranks")
    p.add_argument("--out-dir", default=str(HERE / "results"), help="where results are written")
    args = p.parse_args(argv)
    try:
        args.ranks = sorted({int(r) for r in args.ranks.split(",") if r.strip()})
    except ValueError:
        p.error(f"--ranks must be comma-separated integers like 1,2, got {args.ranks!r}")
    if not args.ranks or args.ranks[0] < 1:
        p.error("--ranks needs at least one world size >= 1")
    return args


def bench_env() -> tuple[dict[str, str], list[str]]:
    """The ranks' environment, and which OpenBLAS variables were removed from it."""
    env = {**os.environ, **THREAD_ENV}
    dropped = [v for v in DROP_ENV if env.pop(v, None) is not None]
    return env, dropped


def _cpu_ticks() -> tuple[int, int]:
    """``(total, busy)`` clock ticks of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        ticks = [int(t) for t in f.readline().split()[1:]]
    return sum(ticks), sum(ticks) - ticks[3] - ticks[4]  # idle and iowait are not busy


def cpu_busy(seconds: float = 1.0) -> float | None:
    """Share of all CPUs' time spent busy over the next ``seconds`` (None if unreadable)."""
    try:
        total0, busy0 = _cpu_ticks()
        time.sleep(seconds)
        total1, busy1 = _cpu_ticks()
    except (OSError, ValueError, IndexError):
        return None
    return (busy1 - busy0) / max(total1 - total0, 1)


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_one(args: argparse.Namespace, size: int, out: Path, env: dict[str, str]) -> tuple[dict, str]:
    """Run bench_step.py on ``size`` ranks; return its JSON and the command line as text."""
    cmd = [args.mpiexec, "-n", str(size), args.python, str(HERE / "bench_step.py"),
           "--out", str(out), "--repeats", str(args.repeats), "--steps", str(args.steps),
           "--warmup", str(args.warmup)]
    shown = " ".join(["env", *(f"-u {v}" for v in DROP_ENV),
                      *(f"{k}={v}" for k, v in THREAD_ENV.items()), shlex.join(cmd)])
    busy = cpu_busy()
    if busy is not None and busy > BUSY_WARN:
        print(f"WARNING: the CPUs were {busy:.0%} busy before this job; other work skews timings",
              file=sys.stderr, flush=True)
    print(f"$ {shown}", flush=True)
    ticks0, own0, t0 = _cpu_ticks()[1], _children_cpu_s(), time.monotonic()
    # own process group, so a timeout ends mpiexec and every rank it started
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True)
    try:
        rc = proc.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise RuntimeError(f"P={size}: no result within {args.timeout:.0f} s; job killed") from None
    if rc != 0:
        raise RuntimeError(f"P={size}: mpiexec exited with status {rc}")
    wall = time.monotonic() - t0
    other = ((_cpu_ticks()[1] - ticks0) / os.sysconf("SC_CLK_TCK") - (_children_cpu_s() - own0)) / wall
    if other > BUSY_WARN * (os.cpu_count() or 1):
        print(f"WARNING: other processes used {other:.2f} CPUs on average during this job",
              file=sys.stderr, flush=True)
    with open(out) as f:
        result = json.load(f)
    result["cpu_busy_before"], result["other_cpus_during"] = busy, max(other, 0.0)
    return result, shown


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def efficiencies(runs: dict[int, dict]) -> dict[int, dict[str, float | None]]:
    """Parallel efficiency samples/s(P) / (P * samples/s(1)) per implementation (None without P=1)."""
    out = {}
    for size, run in runs.items():
        base = runs.get(1)
        out[size] = {name: (run[name]["samples_per_s"] / (size * base[name]["samples_per_s"])
                            if base else None) for name in IMPLS}
    return out


def check_targets(runs: dict[int, dict], eff: dict[int, dict]) -> list[dict]:
    """The stated targets, each with its measured value and verdict."""
    checks = []
    for size, run in runs.items():
        ratio = run["ratio_mpidp_over_handwritten"]
        checks.append({"target": f"P={size}: mpidp step time within 5% of hand-written "
                       f"(ratio <= {MAX_STEP_RATIO})", "value": f"{ratio:.3f}",
                       "pass": ratio <= MAX_STEP_RATIO})
    for size, e in eff.items():
        if size > 1 and e["mpidp"] is not None:
            checks.append({"target": f"P={size}: mpidp efficiency >= hand-written's",
                           "value": f"{e['mpidp']:.3f} vs {e['handwritten']:.3f}",
                           "pass": e["mpidp"] >= e["handwritten"]})
    return checks


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    runs, eff, m = report["runs"], report["efficiency"], report["machine"]
    blas = "; ".join(f"{b['internal_api']} {b['version']} ({b['architecture']}, "
                     f"{b['num_threads']} thread(s))" for b in m["blas"]) \
        if isinstance(m["blas"], list) else m["blas"]
    lines = [
        "# Step time: mpidp vs a hand-written mpi4py + NumPy loop", "",
        "Standard workload (DESIGN.md): MLP 784-1024-1024-10 ReLU, softmax cross-entropy, SGD "
        "lr 0.05, float32; synthetic 60,000 x 784, 10 classes; global batch 512 split over P "
        f"ranks; {report['warmup']} warm-up + {report['steps']} timed steps between barriers "
        f"(slowest rank); median of {report['repeats']} alternating repeats.", "",
        "| P | mpidp step (ms) | hand-written step (ms) | ratio mpidp/hand | comm share mpidp | "
        "comm share hand | samples/s mpidp | samples/s hand | efficiency mpidp | efficiency hand |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, run in sorted(runs.items()):
        mp, hw, e = run["mpidp"], run["handwritten"], eff[size]
        lines.append(
            f"| {size} | {mp['step_ms']:.2f} | {hw['step_ms']:.2f} | "
            f"{run['ratio_mpidp_over_handwritten']:.3f} | {mp['comm_share']:.1%} | "
            f"{hw['comm_share']:.1%} | {mp['samples_per_s']:.0f} | {hw['samples_per_s']:.0f} | "
            f"{_fmt(e['mpidp'], '.3f')} | {_fmt(e['handwritten'], '.3f')} |")
    lines += ["", "Efficiency at P = samples/s at P / (P x samples/s at P=1). Comm share = time "
              "in the gradient Allreduce (waiting for the slower rank included) / time in `step`.",
              "", "## Targets", ""]
    lines += [f"- {'PASS' if c['pass'] else 'FAIL'}: {c['target']} (measured {c['value']})"
              for c in report["targets"]]
    lines += ["", "## Where and how", "",
              f"- Machine: {m['nproc']} CPUs, {m['cpu_model']}, {m['platform']}",
              f"- BLAS: {blas}",
              f"- OpenBLAS variables removed for the runs: {', '.join(m['openblas_env_removed']) or 'none were set'}",
              f"- MPI: {m['mpi_library']} (mpi4py {m['mpi4py']}); numpy {m['numpy']}; "
              f"Python {m['python']}",
              f"- Date: {report['date']}",
              f"- Command: `{report['command']}`"]
    lines += [f"- P={size}: `{cmd}` (CPUs {_fmt(runs[size]['cpu_busy_before'], '.0%')} busy just "
              f"before; other processes used {runs[size]['other_cpus_during']:.2f} CPUs during it)"
              for size, cmd in sorted(report["commands"].items())]
    return "\n".join(lines) + "\n"


def _short(path: str) -> str:
    """``path`` relative to the working directory when it lies below it."""
    rel = os.path.relpath(path)
    return path if rel.startswith("..") else rel


def machine_info(first_run: dict, dropped: list[str]) -> dict:
    env = first_run["environment"]
    return {"nproc": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
            "blas": env["blas"], "openblas_env_removed": dropped,
            "openblas_env_seen_by_ranks": env["openblas_env_set"],
            "mpi_library": " ".join(env["mpi_library"].split()), "mpi4py": env["mpi4py"], "numpy": env["numpy"],
            "python": env["python"]}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env, dropped = bench_env()
    runs, commands = {}, {}
    with tempfile.TemporaryDirectory(prefix="step_bench_") as tmp:
        for size in args.ranks:
            runs[size], commands[size] = run_one(args, size, Path(tmp) / f"p{size}.json", env)
    eff = efficiencies(runs)
    report = {
        "benchmark": "step", "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": f"cd {os.getcwd()} && {shlex.join([_short(sys.executable), *sys.argv])}",
        "commands": commands, "machine": machine_info(runs[args.ranks[0]], dropped),
        "efficiency": eff, "targets": check_targets(runs, eff), "runs": runs,
    }
    with open(out_dir / "step_bench.json", "w") as f:
        json.dump(report, f, indent=2)
    text = markdown(report)
    with open(out_dir / "step_bench.md", "w") as f:
        f.write(text)
    print(text)
    print(f"wrote {out_dir / 'step_bench.json'} and {out_dir / 'step_bench.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
