"""``make bench-sync``: every synchronisation mode at P = 1, 2, 4 (strong and weak scaling),
the cost model's predictions checked against measured step times at P = 2, 3, 4, the
accuracy cost of the lossy modes, the asynchronous against the synchronous parameter server
with and without a straggler (loss curves), and PyTorch DDP when it is installed.

Run: python benchmarks/run_sync_bench.py   (writes benchmarks/results/sync_bench.{json,md,png}
and sync_async.png)
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

import numpy as np

from benchmarks.harness import bench_env, command, cpu_model, git_commit, quick_defaults, write
from benchmarks.plotting import (
    OVER_HATCH,
    cores,
    legend_outside,
    oversubscribed,
    p_label,
    shade_oversubscribed,
    spread,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
BIN = Path(sys.executable).parent
LOSSY = ("allreduce", "compressed", "accumulate", "local-sgd")


def _run(cmd: list[str], env: dict, timeout: float) -> None:
    print("$ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, env=env, cwd=REPO, timeout=timeout, check=True)


def job(P: int, out: Path, env: dict, args, *extra: str) -> dict:
    _run([str(BIN / "mpiexec"), "-n", str(P), sys.executable, "-m", "benchmarks.bench_sync",
          "--out", str(out), "--steps", str(args.steps), "--repeats", str(args.repeats),
          "--pair-repeats", str(max(args.pair_repeats, args.repeats)), *extra],
         env, args.timeout)
    return json.loads(out.read_text())


def accuracy(mode: str, tmp: Path, env: dict, args) -> dict:
    """Digits, 2 ranks, 15 epochs: what each lossy mode costs in accuracy."""
    out = tmp / f"acc-{mode}"
    _run([str(BIN / "mpiexec"), "-n", "2", sys.executable, "-m", "mpidp", "train", "--dataset",
          "digits", "--epochs", "15", "--lr", "0.05", "--sync", mode, "--no-progress",
          "--out", str(out)], env, args.timeout)
    m = json.loads((out / "metrics.json").read_text())
    t = np.cumsum([h.get("seconds") or 0.0 for h in m["history"]])
    return {"test_accuracy": m["test_accuracy"], "final_loss": m["final_loss"],
            "bytes_per_step": m["bytes_sent_per_step"],
            "curve": [[float(s), h["loss"]] for s, h in zip(t, m["history"])]}


def ddp(strong: dict, tmp: Path, env: dict, args) -> tuple[str, dict]:
    """PyTorch DDP (gloo, CPU, one thread per rank) at P = 1, 2 when torch is installed:
    the report's text and ``{P: DDP ms per step}``."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "skipped (PyTorch is not installed in this environment)", {}
    parts, steps = [], {}
    for P in (1, 2):
        out = tmp / f"ddp{P}.json"
        _run([str(BIN / "mpiexec"), "-n", str(P), sys.executable, "-m", "benchmarks.bench_ddp",
              "--out", str(out), "--repeats", str(args.repeats), "--steps", str(args.steps)],
             env, args.timeout)
        r = json.loads(out.read_text())
        steps[P] = r["step_ms"]
        modes = strong[P]["modes"]
        mine = modes["allreduce"]
        best = best_mode(modes)
        floor = modes["compute-only"]["step_ms"]
        parts.append(f"- P={P}: DDP {r['step_ms']:.1f} ms/step ({r['samples_per_s']:.0f} samples/s, "
                     f"torch {r['torch']}); mpidp allreduce {mine['step_ms']:.1f} ms/step, "
                     f"mpidp/DDP samples/s = **{r['step_ms'] / mine['step_ms']:.2f}**; best mode "
                     f"({best}) {r['step_ms'] / modes[best]['step_ms']:.2f}; compute-only floor "
                     f"{floor:.1f} ms/step, so even with free communication mpidp/DDP <= "
                     f"{r['step_ms'] / floor:.2f}")
    return "\n".join(parts), steps


def best_mode(modes: dict) -> str:
    """The fastest training mode (not the compute-only floor or the hand-written loop)."""
    return min((m for m in modes if m not in ("compute-only", "handwritten")),
               key=lambda m: modes[m]["step_ms"])


def targets(strong: dict, ddp_ms: dict) -> list[dict]:
    """The targets at P = 2 (strong scaling), each with the figure that decides it."""
    one, two = strong[1]["modes"], strong[2]["modes"]

    def eff(mode: str) -> float:
        base = one.get(mode, one["allreduce"])["step_ms"]
        return base / (2 * two[mode]["step_ms"])

    ar, hw, best = two["allreduce"], two["handwritten"], best_mode(two)
    cut = two["compressed"]["bytes_per_step"] / ar["bytes_per_step"]
    rows = [
        {"target": "fused allreduce within 5% of the hand-written loop (paired ratio)",
         "value": f"{ar['paired_ratio_to_handwritten']:.3f} (ratio of medians "
                  f"{ar['step_ms'] / hw['step_ms']:.3f})",
         "met": ar["paired_ratio_to_handwritten"] <= 1.05},
        {"target": "best variant beats the hand-written loop with efficiency >= 0.88",
         "value": f"{best} {two[best]['step_ms']:.1f} vs {hw['step_ms']:.1f} ms, efficiency "
                  f"{eff(best):.2f} (hand-written {eff('handwritten'):.2f})",
         "met": two[best]["step_ms"] < hw["step_ms"] and eff(best) >= 0.88},
        {"target": "synchronous parameter server within 10% of allreduce",
         "value": f"{two['ps']['step_ms'] / ar['step_ms'] - 1:+.1%}",
         "met": two["ps"]["step_ms"] <= 1.10 * ar["step_ms"]},
        {"target": "compression halves the bytes per step",
         "value": f"{cut:.4f} of allreduce's ({two['compressed']['bytes_per_step'] / 2**20:.2f} "
                  f"vs {ar['bytes_per_step'] / 2**20:.2f} MiB; "
                  f"{two['compressed']['bytes_per_step'] - ar['bytes_per_step'] / 2:+.0f} bytes "
                  "from exactly half: loss and counts go as float64)",
         "met": cut <= 0.501}]
    if 2 in ddp_ms:
        floor = ddp_ms[2] / two["compute-only"]["step_ms"]
        rows.append({"target": "mpidp >= 2x the samples/s of PyTorch DDP",
                     "value": f"{ddp_ms[2] / ar['step_ms']:.2f}x (best mode "
                              f"{ddp_ms[2] / two[best]['step_ms']:.2f}x; with no communication "
                              f"at all <= {floor:.2f}x)",
                     "met": ddp_ms[2] / ar["step_ms"] >= 2})
    return rows


def smoothed(trace: list, window: int) -> np.ndarray:
    """``(k, 3)`` rows of (seconds, samples so far, loss) for a trace of (seconds, loss sum,
    count): each row's loss is the mean over the rows that lie wholly within the last
    ``window`` samples (at least the row itself)."""
    t = np.asarray(trace, np.float64).reshape(-1, 3)
    seen, loss = np.cumsum(t[:, 2]), np.cumsum(t[:, 1])
    before = np.concatenate([[0.0], seen[:-1]])  # samples seen before each row
    lo = np.minimum(np.searchsorted(before, seen - window), np.arange(len(t)))
    base_seen = np.where(lo > 0, seen[lo - 1], 0.0)
    base_loss = np.where(lo > 0, loss[lo - 1], 0.0)
    return np.column_stack([t[:, 0], seen, (loss - base_loss) / (seen - base_seen)])


def async_summary(report: dict, window: int = 4096) -> dict:
    """Per run of ``bench_async.py``: samples/s, updates, losses and seconds to reach two
    losses of the equal-speed synchronous run (its loss at half its samples, and at the end),
    each loss a mean over the last ``window`` samples; and how much the straggler slows each."""
    curves = {name: smoothed(r["trace"], window) for name, r in report["runs"].items()}
    ref = curves["sync-equal"]
    half = float(ref[np.searchsorted(ref[:, 1], ref[-1, 1] / 2), 2])
    targets = {"half": half, "end": float(ref[-1, 2])}
    rows = {}
    for name, r in report["runs"].items():
        c = curves[name]
        reach = {k: float(c[np.argmax(c[:, 2] <= v), 0]) if (c[:, 2] <= v).any() else None
                 for k, v in targets.items()}
        rows[name] = {"wall_s": r["wall_s"], "samples_per_s": c[-1, 1] / r["wall_s"],
                      "updates": r.get("applied", len(r["trace"])), "final_loss": float(c[-1, 2]),
                      "test_accuracy": r["test_accuracy"], "seconds_to": reach,
                      **{k: r[k] for k in ("dropped", "staleness_mean", "staleness_max") if k in r}}
    hurt = {}
    for mode in ("sync", "async"):
        eq, st = rows[f"{mode}-equal"]["seconds_to"]["half"], rows[f"{mode}-straggler"]["seconds_to"]["half"]
        hurt[mode] = st / eq if eq and st else None
    return {"targets": targets, "window": window, "runs": rows, "straggler_slowdown": hurt,
            "curves": {k: v[:: max(1, len(v) // 200)].tolist() for k, v in curves.items()}}


def async_markdown(a: dict, report: dict) -> list[str]:
    t = a["targets"]
    L = [f"## Asynchronous parameter server (rank 0 serves, {report['workers']} workers; "
         f"straggler: the last worker {report['slowdown']:g}x slower)", "",
         f"Standard workload, {report['epochs']} epochs, global batch {report['batch_size']}; "
         f"synchronous = `ps` with a dedicated server. Losses are means over the last "
         f"{a['window']} samples (server's view). Targets: the synchronous run's loss at half "
         f"its samples ({t['half']:.3f}) and at its end ({t['end']:.3f}).", "",
         "| run | wall s | samples/s | updates | final loss | test accuracy | s to half-way loss "
         "| s to final loss | staleness mean / max, dropped |",
         "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    def sec(v):
        return f"{v:.2f}" if v is not None else "not reached"

    for name, r in a["runs"].items():
        stale = (f"{r['staleness_mean']:.2f} / {r['staleness_max']}, {r['dropped']}"
                 if "staleness_mean" in r else "-")
        L.append(f"| {name} | {r['wall_s']:.2f} | {r['samples_per_s']:.0f} | {r['updates']} | "
                 f"{r['final_loss']:.3f} | {r['test_accuracy']:.4f} | {sec(r['seconds_to']['half'])} | "
                 f"{sec(r['seconds_to']['end'])} "
                 f"| {stale} |")
    h = a["straggler_slowdown"]
    fmt = lambda v: f"{v:.2f}x" if v else "n/a"
    L += ["", f"The straggler stretches the time to the half-way loss {fmt(h['sync'])} for "
          f"synchronous training and {fmt(h['async'])} for asynchronous.", ""]
    return L


def plot_async(a: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, c in a["curves"].items():
        c = np.asarray(c)
        style = "-" if name.startswith("sync") else "--"
        axes[0].plot(c[:, 0], c[:, 2], style, label=name)
        axes[1].plot(c[:, 1], c[:, 2], style, label=name)
    axes[0].set(xlabel="seconds", ylabel=f"training loss (last {a['window']} samples)")
    axes[1].set(xlabel="samples processed")
    for ax in axes:
        ax.axhline(a["targets"]["half"], color="grey", lw=0.5)
        ax.set_ylim(top=2.5)
    legend_outside(axes[1])
    fig.suptitle("Synchronous vs asynchronous parameter server, with and without a straggler")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True


def predictions(model: dict, strong: dict) -> list[dict]:
    """Cost-model step time for allreduce at P = 2, 3, 4 vs measured. Compute comes from this
    run's P = 1 step, split into a fixed part and a part per sample, with the contention and
    jitter that ``mpidp model`` measured; ``ideal_ms`` leaves those out (P = 1's compute / P
    plus the allreduce), as the model did before it measured them."""
    from mpidp.scale.costmodel import Compute, Fit, step_time
    fit = Fit(**model["fit"])
    t1 = strong[1]["modes"]["allreduce"]["step_ms"] / 1e3
    c = Compute(**model["compute"])
    c = c.scaled(t1 / (c.overhead + c.per_sample * 512))  # this run's machine speed
    m = model["standard_model_params"] * 4
    rows = []
    for P in (2, 3, 4):
        measured = strong[P]["modes"]["allreduce"]["step_ms"] / 1e3
        predicted = float(step_time(P, m, 512, c, fit, "ring", cores=os.cpu_count()))
        ideal = float(step_time(P, m, 512, t1 / 512, fit, "ring", cores=os.cpu_count()))
        rows.append({"P": P, "measured_ms": measured * 1e3, "predicted_ms": predicted * 1e3,
                     "error": (predicted - measured) / measured, "ideal_ms": ideal * 1e3,
                     "ideal_error": (ideal - measured) / measured})
    return rows


def markdown(report: dict) -> str:
    L = ["# Synchronisation strategies on the standard workload", "",
         "MLP 784-1024-1024-10, float32, SGD lr 0.05, synthetic 60,000 x 784; median of "
         f"{report['repeats']} repeats of {report['steps']} timed steps (slowest rank); fused "
         f"allreduce and the hand-written loop: {report['pair_repeats']} repeats, back to back.",
         "", "## Targets at P = 2", "", "| target | measured | met |", "|---|---|---|"]
    L += [f"| {t['target']} | {t['value']} | {'yes' if t['met'] else '**no**'} |"
          for t in report["targets"]]
    L.append("")
    for kind in ("strong", "weak"):
        runs = report[kind]
        Ps = sorted(runs)
        L += [f"## {kind.capitalize()} scaling ("
              + ("global batch 512" if kind == "strong" else "256 samples per rank") + ")", "",
              "| mode | " + " | ".join(f"P={p} ms" for p in Ps) + " | "
              + " | ".join(f"P={p} eff" for p in Ps if p > 1)
              + " | samples/s P=2 | comm share P=2 | MB/step/rank |",
              "|---|" + "---:|" * (2 * len(Ps) - 1 + 3)]
        for mode in runs[Ps[-1]]["modes"]:
            base = runs[1]["modes"].get(mode) or runs[1]["modes"]["allreduce"]
            cells, effs = [], []
            for P in Ps:
                r = runs[P]["modes"].get(mode)
                cells.append(f"{r['step_ms']:.1f}" if r else "-")
                if P > 1 and r:
                    per = runs[P]["batch_size"] / r["step_ms"]
                    effs.append(f"{per / (P * runs[1]['batch_size'] / base['step_ms']):.2f}")
                elif P > 1:
                    effs.append("-")
            r2 = runs[2]["modes"].get(mode, {})
            mb = r2.get("bytes_per_step")
            sps = f"{r2['samples_per_s']:.0f}" if r2 else "-"
            L.append(f"| {mode} | " + " | ".join(cells) + " | " + " | ".join(effs) +
                     f" | {sps} | {r2.get('comm_share', 0):.1%} | "
                     + (f"{mb / 2**20:.2f}" if mb else "-") + " |")
        L.append("")
    c = report.get("model_compute", {})
    L += ["## Cost model vs measurement (allreduce, strong scaling)", "",
          f"Compute: {c.get('overhead', 0) * 1e3:.2f} ms per step + {c.get('per_sample', 0) * 1e6:.1f} "
          f"us per sample alone, x{c.get('contention', 1):.2f} with every rank computing, "
          f"step-time spread {c.get('jitter', 0):.1%} (`mpidp model`; rescaled to this run's "
          "P = 1 step). 'Ideal' is P = 1's compute divided by P plus the allreduce.", "",
          "| P | measured ms | predicted ms | error | ideal ms | ideal error |",
          "|---:|---:|---:|---:|---:|---:|"]
    L += [f"| {r['P']} | {r['measured_ms']:.1f} | {r['predicted_ms']:.1f} | {r['error']:+.1%} | "
          f"{r['ideal_ms']:.1f} | {r['ideal_error']:+.1%} |" for r in report["validation"]]
    L += ["", "## Accuracy cost (digits, 2 ranks, 15 epochs)", "",
          "| mode | test accuracy | final loss | bytes/step |", "|---|---:|---:|---:|"]
    L += [f"| {k} | {v['test_accuracy']:.4f} | {v['final_loss']:.4f} | {v['bytes_per_step']:.0f} |"
          for k, v in report["accuracy"].items()]
    if report.get("progress"):
        two, thread = report["strong"][2]["modes"], report["progress"]["modes"]
        L += ["", "## MPICH's progress thread (P = 2, `MPIR_CVAR_ASYNC_PROGRESS=1`)", "",
              "Without it, a non-blocking collective advances only inside MPI calls, so "
              "`overlapped` cannot overlap much; with it, a thread per rank drives them.", "",
              "| mode | ms per step, default | ms per step, progress thread |", "|---|---:|---:|"]
        L += [f"| {m} | {two[m]['step_ms']:.1f} | {thread[m]['step_ms']:.1f} |"
              for m in ("overlapped", "compute-only", "handwritten") if m in thread]
    if report.get("async"):
        L += [""] + async_markdown(report["async"], report["async_run"])
    L += ["", "## PyTorch DDP (gloo, CPU, one thread per rank; same model, data and batches)", "",
          report["torch"], "", "## Where and how", "",
          f"- Machine: {report['machine']}", f"- Command: `{report['command']}`",
          f"- {_blas_line(report['strong'][2]['environment'])}",
          f"- mpidp commit {report['commit']}; {report['date']}"]
    return "\n".join(L) + "\n"


def _blas_line(env: dict) -> str:
    """BLAS kernel (threadpoolctl), MPI library and whether the OpenBLAS variables were set."""
    blas = env.get("blas")
    kern = ", ".join(f"{b['internal_api']} {b['version']} {b['architecture']} kernel, "
                     f"{b['num_threads']} thread(s)" for b in blas) if isinstance(blas, list) else blas
    unset = [v for v, present in env.get("openblas_env_set", {}).items() if not present]
    return (f"BLAS: {kern}; {env.get('mpi_library')}; numpy {env.get('numpy')}; "
            f"not set for the ranks: {', '.join(unset) or 'none'}")


def _step_ms(mode_row: dict) -> tuple[float, float, float]:
    """Median step ms of a mode and its error bar (min and max over the repeats)."""
    reps = [r["step_s"] * 1e3 for r in mode_row.get("repeats", [])]
    return spread(reps) if reps else (mode_row["step_ms"], 0.0, 0.0)


def _bars(ax, runs: dict, n_cores: int) -> None:
    """Step time per mode and P, with the repeats' range; oversubscribed P hatched."""
    Ps = sorted(runs)
    modes = list(runs[Ps[-1]]["modes"])
    width = 0.8 / len(Ps)
    x = np.arange(len(modes))
    for i, P in enumerate(Ps):
        rows = [runs[P]["modes"].get(m) for m in modes]
        med = [_step_ms(r) if r else (np.nan, 0.0, 0.0) for r in rows]
        over = oversubscribed(P, n_cores)
        ax.bar(x + i * width, [m[0] for m in med], width, yerr=[[m[1] for m in med],
               [m[2] for m in med]], capsize=2, label=p_label(P, n_cores),
               hatch=OVER_HATCH if over else None, edgecolor="0.3" if over else None,
               alpha=0.6 if over else 1.0, error_kw={"lw": 0.8})
    ax.set_xticks(x + width * (len(Ps) - 1) / 2, modes, rotation=35, ha="right", fontsize=8)
    ax.set(ylabel="ms per step (global batch 512)",
           title="Step time, strong scaling (bars: median; whiskers: min-max of repeats)")
    legend_outside(ax)


def _efficiency(ax, runs: dict, n_cores: int, title: str) -> None:
    """Parallel efficiency against P per mode (whiskers from the repeats' range)."""
    Ps = sorted(runs)
    for mode in runs[Ps[-1]]["modes"]:
        if mode == "compute-only":
            continue
        base = runs[1]["modes"].get(mode) or runs[1]["modes"]["allreduce"]
        rate1 = runs[1]["batch_size"] / base["step_ms"]
        pts = []
        for P in Ps:
            r = runs[P]["modes"].get(mode)
            if r:
                med, lo, hi = _step_ms(r)
                e = [runs[P]["batch_size"] / ms / (P * rate1) for ms in (med, med + hi, med - lo)]
                pts.append((P, e[0], e[0] - e[1], e[2] - e[0]))
        P_, e, lo, hi = zip(*pts)
        hand = mode == "handwritten"
        ax.errorbar(P_, e, yerr=[lo, hi], fmt="--" if hand else "o-", ms=4, capsize=2, lw=1,
                    label=mode, color="k" if hand else None)
    shade_oversubscribed(ax, n_cores, max(Ps))
    ax.axhline(1.0, color="0.5", lw=0.5)
    ax.set(xlabel="ranks P", ylabel="parallel efficiency", title=title, xticks=Ps)
    legend_outside(ax)


def _cost_model(ax, report: dict, n_cores: int) -> None:
    """The cost model's step time (lines) with the measured steps on top (points)."""
    v = sorted(report["validation"], key=lambda r: r["P"])
    strong = report["strong"]
    one = _step_ms(strong[1]["modes"]["allreduce"])
    P_ = [1] + [r["P"] for r in v]
    ax.plot(P_, [one[0]] + [r["predicted_ms"] for r in v], "s-", color="C1", ms=5, zorder=1,
            label="cost model (contention, jitter, cores)")
    ax.plot(P_, [one[0]] + [r["ideal_ms"] for r in v], "^:", color="C2", ms=5, zorder=1,
            label="ideal (P=1 compute / P + allreduce)")
    meas = [one] + [_step_ms(strong[r["P"]]["modes"]["allreduce"]) if r["P"] in strong
                    else (r["measured_ms"], 0.0, 0.0) for r in v]
    ax.errorbar(P_, [m[0] for m in meas], yerr=[[m[1] for m in meas], [m[2] for m in meas]],
                fmt="o", color="k", ms=6, capsize=3, zorder=3, label="measured (min-max)")
    shade_oversubscribed(ax, n_cores, max(P_))
    ax.set(xlabel="ranks P", ylabel="ms per step (allreduce, batch 512)", xticks=P_,
           title="Cost model vs measurement", ylim=(0, None))
    legend_outside(ax)


def plot(report: dict, path: Path) -> bool:
    """``sync_bench.png``: step times with error bars, efficiency against P (strong and
    weak scaling), the cost model under the measured points, and (when the report holds
    them) loss against seconds per synchronisation mode."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    n_cores = cores(report)
    curves = any("curve" in a for a in report.get("accuracy", {}).values())
    fig, axes = plt.subplots(4 + curves, 1, figsize=(10, 4.2 * (4 + curves)))
    _bars(axes[0], report["strong"], n_cores)
    _efficiency(axes[1], report["strong"], n_cores, "Efficiency, strong scaling (batch 512)")
    _efficiency(axes[2], report["weak"], n_cores, "Efficiency, weak scaling (256 per rank)")
    _cost_model(axes[3], report, n_cores)
    if curves:
        _loss_curves(axes[4], report["accuracy"])
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def _loss_curves(ax, acc: dict) -> None:
    """Training loss against seconds since the start, one curve per synchronisation mode."""
    for mode, a in acc.items():
        if "curve" in a:
            c = np.asarray(a["curve"], np.float64)
            ax.plot(c[:, 0], c[:, 1], "o-", ms=3, label=mode)
    ax.set(xlabel="seconds since the start", ylabel="training loss", yscale="log",
           title="Loss against time per synchronisation mode (digits, 2 ranks)")
    legend_outside(ax)


def replot(path: Path, results: Path) -> int:
    """Redraw the figures from a saved report (JSON turned the ranks counts into strings)."""
    report = json.loads(path.read_text())
    for kind in ("strong", "weak"):
        report[kind] = {int(P): r for P, r in report[kind].items()}
    results.mkdir(parents=True, exist_ok=True)
    ok = plot(report, results / "sync_bench.png") and plot_async(report["async"],
                                                                  results / "sync_async.png")
    print(f"wrote {results / 'sync_bench.png'} and {results / 'sync_async.png'}" if ok
          else "matplotlib is not installed: pip install matplotlib")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60,
                   help="timed steps per repeat (>= 60: the standard workload)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--pair-repeats", type=int, default=7,
                   help="back-to-back runs of fused allreduce and the hand-written loop")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--results", default=str(HERE / "results"))
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="only redraw sync_bench.png and sync_async.png (into --results) from "
                   "a sync_bench.json written earlier; runs nothing")
    quick_defaults(p, steps=5, repeats=1, pair_repeats=1)
    args = p.parse_args(argv)
    if args.replot:
        return replot(Path(args.replot), Path(args.results))
    env, _ = bench_env()
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        strong = {P: job(P, tmp / f"s{P}.json", env, args) for P in (1, 2, 4)}
        strong_3 = job(3, tmp / "s3.json", env, args, "--modes", "allreduce")
        # does overlapping pay when MPICH progresses collectives from a thread of its own?
        progress = job(2, tmp / "progress.json", {**env, "MPIR_CVAR_ASYNC_PROGRESS": "1"}, args,
                       "--modes", "overlapped,compute-only")
        weak = {P: job(P, tmp / f"w{P}.json", env, args, "--weak") for P in (1, 2, 4)}
        _run([str(BIN / "mpiexec"), "-n", "2", sys.executable, "-m", "mpidp", "model", "--out",
              str(tmp / "model")], env, args.timeout)
        model = json.loads((tmp / "model" / "model.json").read_text())
        acc = {m: accuracy(m, tmp, env, args) for m in LOSSY}
        _run([str(BIN / "mpiexec"), "-n", "3", sys.executable, "-m", "benchmarks.bench_async",
              "--out", str(tmp / "async.json")], env, args.timeout)
        async_run = json.loads((tmp / "async.json").read_text())
        torch_note, ddp_ms = ddp(strong, tmp, env, args)
    report = {"steps": args.steps, "repeats": args.repeats, "pair_repeats": args.pair_repeats,
              "strong": strong, "weak": weak, "targets": targets(strong, ddp_ms),
              "progress": progress,
              "validation": predictions(model, {**strong, 3: strong_3}), "model_fit": model["fit"],
              "model_compute": model["compute"],
              "accuracy": acc, "torch": torch_note, "async": async_summary(async_run),
              "async_run": {k: v for k, v in async_run.items() if k != "runs"},
              "machine": cpu_model(), "cores": os.cpu_count(), "commit": git_commit(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": command("run_sync_bench", argv)}
    write(results / "sync_bench", report, markdown(report))
    plot(report, results / "sync_bench.png")
    plot_async(report["async"], results / "sync_async.png")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
