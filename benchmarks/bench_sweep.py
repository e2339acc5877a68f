"""``make bench-sweep``: the same trials of ``mpidp sweep`` on one job of P ranks, as P
groups of one rank (``--ranks-per-trial 1``) against one after another on all P ranks
(``--ranks-per-trial P``); the wall time of each job, median of the repeats taken side by
side. Writes benchmarks/results/sweep.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import (
    RESULTS,
    alternate,
    bench_env,
    children_cpu_s,
    command,
    cpu_model,
    cpu_ticks,
    git_commit,
    loadavg,
    now,
    other_cpus,
    quick_defaults,
    shown,
    write,
)

#: Each trial: a small MLP on synthetic data; the trials differ by seed.
TRAIN = ["--dataset", "synthetic", "--n-samples", "20000", "--n-features", "32",
         "--hidden", "256", "--batch-size", "500", "--epochs", "5", "--val-fraction", "0.1",
         "--quiet", "--no-progress"]


def job(mpiexec: str, ranks: int, k: int, trials: int, out: Path) -> list[str]:
    return [mpiexec, "-n", str(ranks), sys.executable, "-m", "mpidp", "sweep",
            "--ranks-per-trial", str(k), "--grid", "seed=" + ",".join(map(str, range(trials))),
            "--out", str(out), *TRAIN]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mpiexec", default=shutil.which("mpiexec") or "mpiexec")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS / "sweep"))
    quick_defaults(p, repeats=1, trials=4)
    args = p.parse_args(argv)
    env, _ = bench_env()
    shapes = {"groups": 1, "one after another": args.ranks}
    times: dict[str, list[float]] = {name: [] for name in shapes}
    busy: list[float | None] = []
    with tempfile.TemporaryDirectory() as tmp:
        def runner(name: str):
            def one(r: int) -> float:
                cmd = job(args.mpiexec, args.ranks, shapes[name], args.trials,
                          Path(tmp) / f"{shapes[name]}-{r}")
                print(f"$ {shown(cmd)}", flush=True)
                ticks0, own0, t0 = cpu_ticks(), children_cpu_s(), time.monotonic()
                subprocess.run(cmd, env=env, check=True, timeout=1800,
                               stdout=subprocess.DEVNULL)
                wall = time.monotonic() - t0
                busy.append(other_cpus(ticks0, own0, wall))
                print(f"{name}: {wall:.1f} s", flush=True)
                return wall
            return one
        for got in alternate({n: runner(n) for n in shapes}, args.repeats):
            for name, wall in got.items():
                times[name].append(wall)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    report = {"ranks": args.ranks, "trials": args.trials, "train": TRAIN,
              "wall_s": times, "median_s": med,
              "speedup": med["one after another"] / med["groups"],
              "commands": {name: shown(job("mpiexec", args.ranks, k, args.trials,
                                           Path("OUT"))) for name, k in shapes.items()},
              "other_cpus_during": busy, "cpus": os.cpu_count(), "machine": cpu_model(),
              "oversubscribed": args.ranks > (os.cpu_count() or 1), "load": loadavg(),
              "commit": git_commit(), "date": now(), "command": command("bench_sweep")}
    md = [f"# {args.trials} sweep trials on {args.ranks} ranks", "",
          f"{os.cpu_count()} CPUs ({cpu_model()})"
          + (f", {args.ranks} ranks oversubscribed" if report["oversubscribed"] else ""), "",
          "| shape | ranks per trial | wall s (median of "
          f"{args.repeats}) | runs |", "|---|---:|---:|---|"]
    md += [f"| {name} | {k} | {med[name]:.1f} | "
           + ", ".join(f"{t:.1f}" for t in times[name]) + " |" for name, k in shapes.items()]
    md += ["", f"groups of 1 are {report['speedup']:.2f}x as fast", "",
           *(f"    {c}" for c in report["commands"].values()), ""]
    print("\n".join(md))
    print("wrote " + ", ".join(map(str, write(Path(args.out), report, "\n".join(md)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
