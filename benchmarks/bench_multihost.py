"""``make bench-multihost``: the step benchmark and the cost model across two test hosts
(network namespaces, TCP through veth and a bridge; benchmarks/cluster.py).

Measures the TCP path's latency and bandwidth (``mpidp model`` with one rank per host), the
standard workload's step time with 1 rank locally and 2 and 4 ranks over 2 hosts, and the
cost model's predictions for those runs. Needs root. Writes
benchmarks/results/multihost.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import bench_env, command, cpu_model, git_commit, quick_defaults, write

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
from benchmarks.cluster import MPIEXEC, Cluster, available  # noqa: E402
from mpidp.scale.costmodel import Fit, step_time  # noqa: E402


def _run(cmd: list[str], env: dict) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, cwd=REPO, check=True, timeout=900)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--results", default=str(HERE / "results"))
    quick_defaults(p, steps=3, repeats=1)
    args = p.parse_args(argv)
    reason = available()
    if reason:
        print(f"bench-multihost skipped: {reason}")
        return 0
    env, _ = bench_env()
    env["PYTHONPATH"] = str(REPO)
    job = [sys.executable, "-m", "benchmarks.bench_sync", "--modes", "allreduce",
           "--steps", str(args.steps), "--repeats", str(args.repeats)]
    with tempfile.TemporaryDirectory() as t, Cluster(2) as c:
        tmp = Path(t)
        _run([MPIEXEC, "-n", "1", *job, "--out", str(tmp / "p1.json")], env)
        _run(c.mpiexec(2, 1, sys.executable, "-m", "mpidp", "model", "--out", str(tmp / "m")), env)
        for n in (2, 4):
            _run(c.mpiexec(n, n // 2, *job, "--out", str(tmp / f"p{n}.json")), env)
        runs = {n: json.loads((tmp / f"p{n}.json").read_text()) for n in (1, 2, 4)}
        model = json.loads((tmp / "m" / "model.json").read_text())
    fit = Fit(**model["fit"])
    t1 = runs[1]["modes"]["allreduce"]["step_ms"] / 1e3
    m = model["standard_model_params"] * 4
    rows = []
    for n in (2, 4):
        measured = runs[n]["modes"]["allreduce"]["step_ms"] / 1e3
        predicted = float(step_time(n, m, 512, t1 / 512, fit, "ring", cores=os.cpu_count()))
        rows.append({"P": n, "hosts": 2, "measured_ms": measured * 1e3,
                     "predicted_ms": predicted * 1e3, "error": (predicted - measured) / measured,
                     "comm_share": runs[n]["modes"]["allreduce"]["comm_share"],
                     "efficiency": t1 / (n * measured)})
    report = {"fit_tcp": model["fit"], "pingpong_s": model["pingpong"], "p1_step_ms": t1 * 1e3,
              "rows": rows, "machine": cpu_model(), "commit": git_commit(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": command("bench_multihost")}
    f = model["fit"]
    md = ["# Across two test hosts (TCP through veth + bridge)", "",
          f"TCP path fit (`mpidp model`, 1 rank per host): latency alpha = {f['alpha'] * 1e6:.1f} us, "
          f"bandwidth 1/beta = {1 / max(f['beta'], 1e-30) / 1e9:.2f} GB/s, gamma = "
          f"{f['gamma'] * 1e9:.3f} ns/B. Standard workload at P = 1 (local): {t1 * 1e3:.1f} ms/step.", "",
          "| P | hosts | measured ms/step | predicted (ring) | error | comm share | efficiency |",
          "|---:|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {r['P']} | 2 | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | {r['error']:+.1%} | "
           f"{r['comm_share']:.1%} | {r['efficiency']:.2f} |" for r in rows]
    md += ["", f"Machine: {report['machine']} (2 cores; both test hosts share them). "
           f"Command: `{report['command']}`; commit {report['commit']}; {report['date']}."]
    out = Path(args.results)
    write(out / "multihost", report, "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
