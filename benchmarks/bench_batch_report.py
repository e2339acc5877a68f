"""The report of ``bench_batch.py``: targets, ``batch.md``, ``batch.json`` and ``batch.png``
(also rebuilt from a saved JSON with ``bench_batch.py --replot benchmarks/results/batch.json``)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import blas_text

BUSY_WARN = 0.10  # share of the CPUs other work may use before timings are suspect
TOL = 1e-9  # accuracies are multiples of 1/1000: a comparison must not hinge on rounding


def median_nan(values: Sequence[float]) -> float:
    """Median where a NaN (a failed or diverged run) ranks below every number: NaN when a
    middle value is NaN; ``inf`` ranks above every number (a target never reached)."""
    vals = sorted(values, key=lambda v: (not math.isnan(v), v if not math.isnan(v) else 0.0))
    n = len(vals)
    if n == 0:
        return math.nan
    mid = vals[(n - 1) // 2:n // 2 + 1]
    if any(math.isnan(v) for v in mid):
        return math.nan
    return sum(mid) / len(mid) if all(math.isfinite(v) for v in mid) else max(mid)


def holds_up_to(by_batch: dict, ref: float, gap: float) -> tuple[int | None, int | None]:
    """The largest batch up to which EVERY batch's median accuracy stays within ``gap`` of
    ``ref`` (None if not even the first), and the first batch that falls below."""
    last = None
    for b in sorted(by_batch, key=int):
        med = by_batch[b]["median"]
        if not (math.isfinite(med) and med >= ref - gap - TOL):
            return last, int(b)
        last = int(b)
    return last, None


def analyse(report: dict) -> dict:
    """Baselines, where each recipe holds, and the targets (added to ``report``)."""
    sw, base, gap = report["sweep"], str(report["base_batch"]), report["gap"]
    baseline = sw["constant"]["by_batch"][base]["median"] if "constant" in sw else math.nan
    holds = {}
    for name, r in sw.items():
        own = r["by_batch"][base]["median"]
        up, below = holds_up_to(r["by_batch"], baseline, gap)
        up_own, below_own = holds_up_to(r["by_batch"], own, gap)
        diverged = sum(s == "diverged" for v in r["by_batch"].values() for s in v["status"].values())
        failed = sum(s in ("failed", "timeout") for v in r["by_batch"].values()
                     for s in v["status"].values())
        holds[name] = {"own_base": own, "up_to": up, "first_below": below, "up_to_own": up_own,
                       "first_below_own": below_own, "diverged_runs": diverged, "failed_runs": failed,
                       "runs": sum(len(v["status"]) for v in r["by_batch"].values())}
    B0 = report["base_batch"]
    targets = []

    def up(name):
        return holds.get(name, {}).get("up_to") or 0

    if "linear" in holds:
        targets.append({"target": f"(b) linear scaling + warmup: median test accuracy within "
                        f"{gap * 100:g} pp of the small-batch baseline ({baseline:.4f}) up to at least "
                        f"8x the base batch ({8 * B0})",
                        "value": f"holds up to {up('linear') or 'none'}; first below: "
                        f"{holds['linear']['first_below'] or 'none'}", "pass": up("linear") >= 8 * B0})
    if "lamb" in holds and "linear" in holds:
        targets.append({"target": "(c) LAMB extends the batch up to which that holds beyond (b)'s",
                        "value": f"LAMB holds up to {up('lamb') or 'none'}, "
                        f"(b) up to {up('linear') or 'none'}",
                        "pass": up("lamb") > up("linear")})
    for name, ex in report["exactness"].items():
        targets.append({"target": f"{name} at global batch {ex['batch']}, float64: parameters at P = 2 "
                        f"equal P = 1's to <= {report['max_param_diff']:g}",
                        "value": f"max |diff| {ex['max_abs_diff']:.3g}",
                        "pass": math.isfinite(ex["max_abs_diff"])
                        and ex["max_abs_diff"] <= report["max_param_diff"]})
    tm = report["timing"]
    ref = tm["configs"][0]["summary"]["1"]["time_to_target_median_s"]
    for c in tm["configs"][1:]:
        t = c["summary"]["2"]["time_to_target_median_s"]
        targets.append({"target": f"{c['recipe']} at batch {c['batch']}, P = 2, reaches "
                        f"{tm['target']:.0%} test accuracy sooner than the small-batch baseline at P = 1",
                        "value": f"{_s(t)} against {_s(ref)}", "pass": math.isfinite(t) and t < ref})
    report["analysis"] = {"baseline": baseline, "holds": holds}
    report["targets"] = targets
    return report


def _sweep_from(report: dict) -> list[str]:
    f = report.get("sweep_from")
    if not f:
        return []
    return [f"Tuning and accuracy sweep: from the earlier run finished {f['date']} at commit {f['commit']} "
            f"(`{f['command']}`, {f['wall_s'] / 60:.1f} min; P = 1 runs are deterministic); this run "
            "(`--timing-from`) repeated only the timing and exactness sections.", ""]


def _moved(m: dict) -> str:
    end = m.get("commit_at_end")
    return f" (HEAD was {end} by the end)" if end and end != m["commit"] else ""


def _s(t: float | None) -> str:
    if t is None or (isinstance(t, float) and math.isnan(t)):
        return "-"
    return "not reached" if math.isinf(t) else f"{t:.2f} s"


def _acc(a: float) -> str:
    return "NaN" if math.isnan(a) else f"{a:.4f}"


def _verdict(t: dict) -> str:
    return "n/a" if t["pass"] is None else ("PASS" if t["pass"] else "MISS")


def _cell(v: dict, ref: float, gap: float) -> str:
    med = v["median"]
    bad = {s: st for s, st in v["status"].items() if st != "ok"}
    txt = f"{_acc(med)} ({_acc(v['min'])}–{_acc(v['max'])})"
    if math.isfinite(med) and med >= ref - gap - TOL:
        txt = f"**{txt}**"
    if bad:
        txt += " " + ", ".join(f"seed {s} {st}" for s, st in bad.items())
    return txt


def markdown(report: dict) -> str:
    a, sw, B0, gap = report["analysis"], report["sweep"], report["base_batch"], report["gap"]
    m = report["machine"]
    ref = a["baseline"]
    names = list(sw)
    L = [f"# Large batches: MNIST-1D `cnn`, {report['epochs']} epochs at every batch", "",
         f"Command `{report['command']}` ({report['wall_s'] / 60:.1f} min, {report['jobs_run']} "
         f"mpiexec jobs, untimed P = 1 accuracy runs {report['parallel_untimed_jobs']} at a time), "
         f"commit {m['commit']}{_moved(m)}, finished {report['date']}. Data: MNIST-1D's own 4,000 "
         f"training / 1,000 test rows. Seeds {', '.join(map(str, report['seeds']))}: medians "
         "(min–max); a run that failed or diverged counts as NaN, below every number.", "",
         *_sweep_from(report),
         f"## Rates tuned at the base batch ({B0})", "",
         "| grid | recipe | rate | " + " | ".join(f"seed {s}" for s in report["tuning"]["sgd"]["seeds"])
         + " | median |", "|---|---|---:|" + "---:|" * (len(report["tuning"]["sgd"]["seeds"]) + 1)]
    for grid, t in report["tuning"].items():
        for rate, v in t["by_rate"].items():
            mark = " (chosen)" if float(rate) == t["best"] else ""
            L.append(f"| {grid} | {t['recipe']} | {rate}{mark} | "
                     + " | ".join(_acc(v["by_seed"][s] if s in v["by_seed"] else v["by_seed"][str(s)])
                                  for s in t["seeds"]) + f" | {_acc(v['median'])} |")
    L += ["", "## Test accuracy against the global batch", "",
          f"Small-batch baseline: (a) at batch {B0}, median {_acc(ref)}. Bold: within {gap * 100:g} pp "
          "of it. The peak rate each recipe reached at each batch is in the second table.", "",
          "| global batch | steps | " + " | ".join(sw[n]["label"] for n in names) + " |",
          "|---:|---:|" + "---|" * len(names)]
    for b in map(str, report["batches"]):
        steps = next((sw[n]["by_batch"][b]["steps"] for n in names if sw[n]["by_batch"][b]["steps"]), "-")
        cells = " | ".join(_cell(sw[n]["by_batch"][b], ref, gap) for n in names)
        L.append(f"| {b} | {steps} | {cells} |")
    L += ["", "Peak learning rate (after warmup and scaling; read back from the runs' history):", "",
          "| global batch | " + " | ".join(n for n in names) + " |", "|---:|" + "---:|" * len(names)]
    for b in map(str, report["batches"]):
        L.append(f"| {b} | " + " | ".join(f"{sw[n]['by_batch'][b]['peak_lr']:.4g}"
                                          if sw[n]["by_batch"][b]["peak_lr"] else "-" for n in names) + " |")
    L += ["", "## Where each recipe breaks down", "",
          f"| recipe | at batch {B0} | within {gap * 100:g} pp of the baseline up to | first batch below "
          f"| within {gap * 100:g} pp of its own batch-{B0} run up to | first below "
          "| diverged / failed runs |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for n in names:
        h = a["holds"][n]
        L.append(f"| {sw[n]['label']} | {_acc(h['own_base'])} | {h['up_to'] or 'none'} | "
                 f"{h['first_below'] or '-'} | {h['up_to_own'] or 'none'} | {h['first_below_own'] or '-'} | "
                 f"{h['diverged_runs']} / {h['failed_runs']} of {h['runs']} |")
    tm = report["timing"]
    L += ["", f"## Time to {tm['target']:.0%} test accuracy", "",
          "Cumulative per-epoch training `seconds` from metrics.json (evaluation excluded) up to the "
          "first epoch whose test accuracy reaches the target; medians over the seeds (a run that never "
          "reaches it counts as infinitely slow). Every row was run alone, P = 1 and P = 2 in turns, "
          "seed by seed, after waiting up to "
          f"{report.get('wait_quiet_s', '?')} s for the CPUs to go quiet; a run during which other "
          f"processes used more than {BUSY_WARN:.0%} of the CPUs was run again (up to "
          f"{report.get('timed_retries', 0)} time(s)) and the least disturbed kept; `other CPUs` is "
          "the median of what other processes used during the kept runs.", "",
          "| recipe | global batch | P | reached | epochs to target | seconds to target | speedup vs "
          "baseline P = 1 | training s, all epochs | final test accuracy | other CPUs |",
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in tm["configs"]:
        for P, s in c["summary"].items():
            ep = s["epochs_to_target_median"]
            sp = s["speedup_vs_baseline_P1"]
            L.append(f"| {c['recipe']} | {c['batch']} | {P} | {s['reached']} | "
                     f"{'-' if math.isinf(ep) or math.isnan(ep) else f'{ep:g}'} | "
                     f"{_s(s['time_to_target_median_s'])} | {'-' if sp is None else f'{sp:.2f}x'} | "
                     f"{_s(s['train_s_median'])} | {_acc(s['test_accuracy_median'])} | "
                     f"{s['other_cpus_median']:.2f} |")
    busy = [r["other_cpus_during"] for c in tm["configs"] for rs in c["runs"].values() for r in rs
            if r.get("other_cpus_during") is not None]
    limit = BUSY_WARN * report["machine"]["nproc"]
    if busy and max(busy) > limit:
        L += ["", f"WARNING: during {sum(b > limit for b in busy)} of the {len(busy)} kept timed runs "
              f"other processes used more than {limit:.2f} CPUs (up to {max(busy):.2f}; median over all "
              f"{median_nan(busy):.2f}): those runs' seconds are suspect (per run in batch.json)."]
    same = [r.get("same_accuracy_as_sweep") for c in tm["configs"] for r in c["runs"]["1"]
            if "same_accuracy_as_sweep" in r]
    if same:
        L += ["", f"The P = 1 timing runs repeat sweep runs: {sum(same)} of {len(same)} ended with the "
              "same test accuracy (P = 1 is deterministic)."]
    L += ["", "## Exactness (float64, P = 2 against P = 1)", "",
          "| recipe | global batch | parameters | max abs difference | test accuracy P = 1 / P = 2 |",
          "|---|---:|---:|---:|---|"]
    for n, ex in report["exactness"].items():
        acc = ex["test_accuracy"]
        L.append(f"| {n} | {ex['batch']} | {ex['n_params']} | {ex['max_abs_diff']:.3g} | "
                 f"{_acc(acc.get('1', acc.get(1, math.nan)))} / {_acc(acc.get('2', acc.get(2, math.nan)))} |")
    L += ["", "## Targets", "", *(f"- {_verdict(t)}: {t['target']} (measured: {t['value']})"
                                  for t in report["targets"])]
    L += ["", "## Where and how", "",
          f"- Machine: {m['nproc']} CPUs, {m['cpu_model']}, {m['platform']}; load average "
          f"{m['loadavg_before']} before, {m['loadavg_after']} after; other processes used "
          f"{m['other_cpus_during_benchmark']:.2f} CPUs on average during the benchmark",
          f"- BLAS (threadpoolctl, in a rank): {blas_text(m['blas'])}",
          "- OpenBLAS variables removed for the runs: "
          f"{', '.join(m['openblas_env_removed']) or 'none were set'}",
          f"- MPI: {m.get('mpi_library', '?')} (mpi4py {m.get('mpi4py', '?')}); numpy {m.get('numpy', '?')}; "
          f"Python {m.get('python', '?')}",
          "- Every run: `env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OMP_NUM_THREADS=1 "
          "OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/mpiexec -n P .venv/bin/python -m mpidp "
          f"train --dataset mnist1d --model cnn --epochs {report['epochs']} --batch-size B --seed S "
          "--dtype float32 RECIPE --out DIR -q`, with RECIPE:"]
    for n in names:
        L.append(f"  - {n}: `{' '.join(sw[n]['args'])}`")
    L.append("- Every command is listed with its run in batch.json.")
    return "\n".join(L) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    sw, a, gap = report["sweep"], report["analysis"], report["gap"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.4), gridspec_kw={"width_ratios": [1.1, 1.1, 1]})
    colors = dict(zip(sw, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, zoom in ((axes[0], False), (axes[1], True)):
        ref = a["baseline"]
        ax.axhspan(ref - gap, ref, color="0.88", zorder=0,
                   label=f"within {gap * 100:g} pp of the baseline")
        ax.axhline(ref, color="0.5", lw=0.8, ls="--")
        for n, r in sw.items():
            bs = [int(b) for b in r["by_batch"]]
            med = np.array([v["median"] for v in r["by_batch"].values()])
            lo = np.array([v["min"] for v in r["by_batch"].values()])
            hi = np.array([v["max"] for v in r["by_batch"].values()])
            ok = np.isfinite(med)
            err = [np.where(np.isfinite(lo), med - lo, 0)[ok], np.where(np.isfinite(hi), hi - med, 0)[ok]]
            ax.errorbar(np.array(bs)[ok], med[ok], yerr=err, marker="o", ms=4, capsize=2,
                        color=colors[n], label=r["label"])
            bad = [b for b, good in zip(bs, ok) if not good]
            if bad:
                y0 = 0.9 if zoom else 0.0
                ax.plot(bad, [y0] * len(bad), "x", color=colors[n], ms=8, mew=2, clip_on=False,
                        label=f"{n}: median NaN (diverged)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["batches"], [str(b) for b in report["batches"]])
        ax.set_xlabel("global batch size (log2)")
        ax.set_ylabel("test accuracy (median over seeds; bars: min–max)")
        if zoom:
            ax.set_ylim(0.9, min(1.0, ref + 0.03))
            ax.set_title("the same, zoomed in")
        else:
            ax.set_ylim(0.0, 1.0)
            ax.set_title(f"MNIST-1D cnn, {report['epochs']} epochs at every batch")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower left")
    tm = report["timing"]
    labels, vals, cols = [], [], []
    for c in tm["configs"]:
        for P, s in c["summary"].items():
            labels.append(f"{c['recipe']} B={c['batch']} P={P}")
            t = s["time_to_target_median_s"]
            vals.append(t if math.isfinite(t) else 0.0)
            cols.append(colors.get(c["recipe"], "0.5"))
    ax = axes[2]
    bars = ax.bar(range(len(vals)), vals, color=cols)
    ranks = [P for c in tm["configs"] for P in c["summary"]]
    for i, (bar, P) in enumerate(zip(bars, ranks)):
        bar.set_hatch("//" if P == "2" else "")
        if vals[i] == 0.0:
            ax.text(i, 0.0, "not\nreached", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(vals)), labels, fontsize=7, rotation=40, ha="right")
    ax.set_ylabel(f"training seconds to {tm['target']:.0%} test accuracy (median)")
    ax.set_ylim(bottom=0.0)
    ax.set_title("time to the target (hatched: P = 2)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(report: dict, out_dir: Path) -> str:
    """Analyse, write batch.json, batch.md and batch.png into ``out_dir``; return the markdown."""
    report = analyse(report)
    text = markdown(report)
    with open(out_dir / "batch.json", "w") as f:
        json.dump(report, f, indent=1)
    (out_dir / "batch.md").write_text(text)
    plot(report, out_dir / "batch.png")
    return text + f"\nwrote {out_dir / 'batch.json'}, {out_dir / 'batch.md'} and {out_dir / 'batch.png'}"
