"""``make bench-partition``: every partition strategy on each workload at P = 2 and 4, the
straggler case, and map/reduce (dynamic vs static) on variable-cost work.

Runs ``mpiexec -n P python -m mpidp train ...`` jobs (one BLAS thread per rank), reads their
``metrics.json``, takes the median over ``--repeats`` of the last epoch's figures, checks the
targets and writes ``benchmarks/results/partition.{json,md,png}``. Imbalance is
reported from wall time and from CPU (process) time; with 4 ranks on 2 cores judge by CPU.
The machine's 1-minute load average is sampled between jobs and reported with the results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.harness import quick_defaults, write

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
#: ``weighted`` runs only where rank speeds differ (the straggler rows): with equal ranks its
#: capacities would all be 1, i.e. ``block`` again.
STRATEGIES = ("block", "cyclic", "shuffled", "cost", "adaptive")
WORKLOADS = {
    "bow-sorted": ["--dataset", "bow", "--n-samples", "16000", "--n-features", "2000",
                   "--hidden", "128", "--batch-size", "1024", "--epochs", "2"],
    "uniform": ["--dataset", "synthetic", "--n-samples", "8192", "--n-features", "784",
                "--hidden", "256", "--batch-size", "512", "--epochs", "2"],
}
# Rank 1 slowed 2x (its forward/backward; see StepTimer). The standard benchmark model
# (784-1024-1024-10, 1.9 M parameters) with global batches of 4096, so that per-sample compute
# dominates a step: at batch 512 the 7.5 MB Allreduce plus the replicated update were ~20% of
# a step, which no split can remove (measured as ``fixed_s``); at 4096 they are ~3-4%.
STRAGGLER = ["--dataset", "synthetic", "--n-samples", "24576", "--n-features", "784",
             "--hidden", "1024,1024", "--batch-size", "4096", "--epochs", "3", "--slowdown", "1:2"]
#: Rows per chunk of every map/reduce mode (static and dynamic alike, so the comparison is
#: about the split only). The heaviest 16-row chunk of the sorted bag-of-words rows is 12% of
#: a rank's share at P = 4 (46% for 64 rows): a dynamic schedule can end with that chunk.
MR_CHUNK = 16
#: The straggler rows: the equal split, the 2:1 split told by hand, and adaptive (re-measured
#: every epoch; add e.g. "adaptive-every-2": [..., "--adapt-every", "2"] to compare).
STRAGGLER_RUNS = {"block": ["--partition", "block"],
                  "weighted": ["--partition", "weighted", "--capacities", "2,1"],
                  "adaptive": ["--partition", "adaptive"]}
LOADS: list[float] = []


def load_now() -> float:
    LOADS.append(os.getloadavg()[0])
    return LOADS[-1]
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def run_train(args, ranks: int, extra: list[str]) -> dict:
    load_now()
    with tempfile.TemporaryDirectory() as out:
        cmd = [args.mpiexec, "-n", str(ranks), args.python, "-m", "mpidp", "train",
               "--no-progress", "--model", "mlp", "--lr", "0.05", "--test-fraction", "0",
               *extra, "--out", out]
        env = {**os.environ, **ENV, "PYTHONPATH": str(REPO)}
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
        return json.loads(Path(out, "metrics.json").read_text())


def summarize(runs: list[dict]) -> dict:
    """Median over repeats of the last epoch's figures (per-rank figures of the median run)."""
    last = [m["history"][-1]["balance"] for m in runs]
    keys = ("imbalance", "imbalance_cpu", "efficiency", "efficiency_cpu", "rate", "ideal_rate",
            "attainable_rate", "fixed_s")
    out = {k: float(np.median([b[k] for b in last])) for k in keys}
    mid = int(np.argsort([b["imbalance_cpu"] for b in last])[len(last) // 2])
    out["per_rank"] = last[mid]["per_rank"]
    out["slowest_rank"] = last[mid]["slowest_rank"]
    out["epoch_s"] = float(np.median([m["history"][-1]["seconds"] for m in runs]))
    epochs = range(len(runs[0]["history"]))
    for key, ideal in (("eff_vs_ideal_by_epoch", "ideal_rate"),
                       ("eff_vs_attainable_by_epoch", "attainable_rate")):
        out[key] = [float(np.median([m["history"][e]["balance"]["rate"] /
                                     m["history"][e]["balance"][ideal] for m in runs]))
                    for e in epochs]
    out["capacities_by_epoch"] = [runs[0]["history"][e]["balance"]["capacities"] for e in epochs]
    out["repeats"] = {k: [b[k] for b in last] for k in ("efficiency", "efficiency_cpu")}
    return out


def bench_training(args) -> list[dict]:
    rows = []
    for ranks in args.ranks:
        for name, extra in WORKLOADS.items():
            for strategy in STRATEGIES:
                opts = ["--partition", strategy]
                runs = [run_train(args, ranks, extra + opts) for _ in range(args.repeats)]
                rows.append({"P": ranks, "workload": name, "strategy": strategy, **summarize(runs)})
                print(f"P={ranks} {name:10s} {strategy:9s} imbalance {rows[-1]['imbalance']:.3f} "
                      f"(cpu {rows[-1]['imbalance_cpu']:.3f})", flush=True)
    for strategy, opts in STRAGGLER_RUNS.items():
        runs = [run_train(args, 2, STRAGGLER + opts) for _ in range(args.repeats)]
        rows.append({"P": 2, "workload": "straggler-2x", "strategy": strategy, **summarize(runs)})
        print(f"straggler {strategy}: vs sum of speeds {rows[-1]['eff_vs_ideal_by_epoch']}, "
              f"vs attainable {rows[-1]['eff_vs_attainable_by_epoch']}", flush=True)
    return rows


def bench_mapreduce(args) -> dict:
    out = {}
    for ranks in args.ranks:
        load_now()
        cmd = [args.mpiexec, "-n", str(ranks), args.python, "-m", "benchmarks.mapreduce_worker",
               str(max(args.repeats, 9)), str(MR_CHUNK)]  # each map takes < 1 s
        env = {**os.environ, **ENV, "PYTHONPATH": str(REPO)}
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        if r.returncode != 0:
            raise RuntimeError(f"map/reduce job failed:\n{r.stderr[-2000:]}")
        out[ranks] = json.loads(r.stdout.strip().splitlines()[-1])
        print(f"map/reduce P={ranks}: {out[ranks]}", flush=True)
    return out


def targets(rows: list[dict], mr: dict) -> list[dict]:
    pick = {(r["P"], r["workload"], r["strategy"]): r for r in rows}
    checks = []
    for P in sorted({r["P"] for r in rows if r["workload"] == "bow-sorted"}):
        for strategy, op, bound in (("block", ">=", 1.5), ("cost", "<=", 1.05)):
            r = pick[(P, "bow-sorted", strategy)]
            for kind in ("imbalance", "imbalance_cpu"):
                v = r[kind]
                checks.append({"target": f"bow-sorted P={P} {strategy} {kind} {op} {bound}",
                               "value": round(v, 3), "pass": v >= bound if op == ">=" else v <= bound,
                               "headline": P == 2 or kind == "imbalance_cpu"})
    eq = pick[(2, "straggler-2x", "block")]
    for key, ideal in (("eff_vs_ideal_by_epoch", "sum of speeds"),
                       ("eff_vs_attainable_by_epoch", "attainable")):
        checks.append({"target": f"straggler 2x P=2: equal split <= 75% of ideal ({ideal})",
                       "value": round(eq[key][-1], 3), "pass": eq[key][-1] <= 0.75,
                       "headline": True})
        for name in ("adaptive", "adaptive-every-2"):
            ad = pick.get((2, "straggler-2x", name))
            if ad is not None:
                checks.append({"target": f"straggler 2x P=2: {name} >= 90% of ideal ({ideal}) "
                               "by epoch 2", "value": round(ad[key][1], 3),
                               "pass": ad[key][1] >= 0.90, "headline": True})
    for P, m in mr.items():
        for kind, label in (("seconds", "wall"), ("cpu_makespan", "CPU")):
            best = min(m[s][kind] for s in ("block", "cyclic", "cost"))
            ratio = m["dynamic"][kind] / best
            checks.append({"target": f"map/reduce P={P}: dynamic within 10% of best static "
                           f"({label})", "value": round(ratio, 3), "pass": ratio <= 1.10,
                           "headline": P == 2 or label == "CPU"})
    return checks


def markdown(rows, mr, checks, meta) -> str:
    lines = [f"Machine: {meta['machine']}; command: `{meta['command']}`; median of "
             f"{meta['repeats']} runs, last epoch; 1-minute load average {meta['load']}.", "",
             "| P | workload | strategy | imbalance (wall) | imbalance (CPU) | efficiency | "
             "max idle | slowest | epoch s | rate / sum of speeds, by epoch | "
             "rate / attainable, by epoch |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        idle = max(p["idle_fraction"] for p in r["per_rank"])
        eff = ", ".join(f"{e:.0%}" for e in r["eff_vs_ideal_by_epoch"])
        att = ", ".join(f"{e:.0%}" for e in r["eff_vs_attainable_by_epoch"])
        lines.append(f"| {r['P']} | {r['workload']} | {r['strategy']} | {r['imbalance']:.3f} | "
                     f"{r['imbalance_cpu']:.3f} | {r['efficiency']:.1%} | {idle:.0%} | "
                     f"{r['slowest_rank']} | {r['epoch_s']:.2f} | {eff} | {att} |")
    lines += ["", f"Map/reduce: {MR_CHUNK} rows per chunk in every mode; CPU makespan = the "
              "largest per-rank CPU (process) time.", "",
              "| P | map/reduce mode | wall s | CPU makespan s | CPU imbalance | "
              "samples per rank |", "|---|---|---|---|---|---|"]
    for P, m in mr.items():
        for mode, v in m.items():
            lines.append(f"| {P} | {mode} | {v['seconds']:.3f} | {v['cpu_makespan']:.3f} | "
                         f"{v['imbalance_cpu']:.3f} | {v['samples']} |")
    lines += ["", "| target | measured | result |", "|---|---|---|"]
    for c in checks:
        lines.append(f"| {c['target']} | {c['value']} | {'PASS' if c['pass'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def _per_rank_bars(ax, sel: list[dict], over: bool) -> None:
    """Stacked compute / comm / wait seconds of every rank, grouped by strategy."""
    from benchmarks.plotting import OVER_HATCH
    colors = {"compute_s": "#4c72b0", "comm_s": "#55a868", "wait_s": "#c44e52"}
    x, ticks, labels = 0, [], []
    for r in sel:
        for p in r["per_rank"]:
            bottom = 0.0
            for key, color in colors.items():
                ax.bar(x, p[key], bottom=bottom, color=color, width=0.8,
                       hatch=OVER_HATCH if over else None, edgecolor="white" if over else None,
                       label=key[:-2] if x == 0 else None)
                bottom += p[key]
            x += 1
        ticks.append(x - (len(r["per_rank"]) + 1) / 2)
        labels.append(r["strategy"])
        x += 1
    ax.set_xticks(ticks, labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("seconds in last epoch (per rank)")


def _efficiency_bars(ax, sel: list[dict], over: bool) -> None:
    """Efficiency per strategy: from wall time, or from CPU time when oversubscribed (ranks
    sharing a core wait for it, which wall time counts as imbalance); whiskers: min-max
    over the repeats when recorded."""
    from benchmarks.plotting import OVER_HATCH, spread
    key = "efficiency_cpu" if over else "efficiency"
    for i, r in enumerate(sel):
        reps = r.get("repeats", {}).get(key)
        med, lo, hi = spread(reps) if reps else (r[key], 0.0, 0.0)
        ax.bar(i, med, 0.7, yerr=[[lo], [hi]] if reps else None, capsize=3, color="C0",
               hatch=OVER_HATCH if over else None, edgecolor="white" if over else None)
    ax.set_xticks(range(len(sel)), [r["strategy"] for r in sel], rotation=45, ha="right",
                  fontsize=8)
    ax.set(ylabel=f"efficiency ({'CPU' if over else 'wall'} time)", ylim=(0, 1.05))
    ax.axhline(1.0, color="0.5", lw=0.5)


def figure(rows, path: Path, n_cores: int | None = None) -> None:
    """Per-rank seconds (top) and efficiency (bottom) per strategy, one column per
    (P, workload); P above the core count hatched and titled oversubscribed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks.plotting import cores, legend_outside, oversubscribed, p_label  # beside this file
    n_cores = n_cores or cores()
    panels = sorted({(r["P"], r["workload"]) for r in rows})
    fig, axes = plt.subplots(2, len(panels), figsize=(4.2 * len(panels), 8),
                             squeeze=False, height_ratios=(3, 2))
    for col, (P, wl) in enumerate(panels):
        sel = [r for r in rows if r["P"] == P and r["workload"] == wl]
        over = oversubscribed(P, n_cores)
        _per_rank_bars(axes[0][col], sel, over)
        _efficiency_bars(axes[1][col], sel, over)
        axes[0][col].set_title(f"{wl}, {p_label(P, n_cores)}", fontsize=9)
    legend_outside(axes[0][-1], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--mpiexec", default=str(REPO / ".venv" / "bin" / "mpiexec"))
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--out-dir", default=str(HERE / "results"))
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="only redraw partition.png (into --out-dir) from a partition.json "
                   "written earlier; runs nothing")
    quick_defaults(p, repeats=1, ranks="2")
    args = p.parse_args(argv)
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        cpus = [int(w) for w in saved["meta"]["machine"].split() if w.isdigit()]
        out = Path(args.out_dir) / "partition.png"
        figure([r for r in saved["training"] if r["workload"] != "uniform"], out,
               cpus[0] if cpus else None)
        print(f"wrote {out}")
        return 0
    args.ranks = [int(r) for r in args.ranks.split(",")]
    t0 = time.time()
    print(f"1-minute load average at start: {load_now():.2f}", flush=True)
    rows = bench_training(args)
    mr = bench_mapreduce(args)
    checks = targets(rows, mr)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} "
                       f"{platform.release()}, Python {platform.python_version()}",
            "command": "make bench-partition", "repeats": args.repeats,
            "seconds": round(time.time() - t0, 1),
            "load": f"{min(LOADS):.2f}-{max(LOADS):.2f} (sampled before each job)"}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write(out / "partition", {"meta": meta, "training": rows, "mapreduce": mr, "targets": checks},
          markdown(rows, mr, checks, meta))
    figure([r for r in rows if r["workload"] != "uniform"], out / "partition.png")
    for c in checks:
        print(f"{'PASS' if c['pass'] else 'FAIL'}  {c['target']}: {c['value']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
