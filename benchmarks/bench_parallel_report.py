"""The model of ``bench_parallel.py`` (its layers and predicted bytes) and its report:
tables, targets and plot (JSON + Markdown + PNG)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from benchmarks.plotting import cores, legend_outside, log_if_wide, oversubscribed, p_label

MIB = 2**20
LABEL = {"data": "data parallel", "gpipe": "pipeline GPipe", "1f1b": "pipeline 1F1B",
         "hybrid": "hybrid 2 stages x 2 (1F1B)"}


def layers(w: int, d: int, n_in: int | None = None):
    """``d`` Dense layers (``n_in`` -> w, then w x w), ReLU between, ``w`` classes."""
    from mpidp.parallel import model_layers
    return model_layers("mlp", n_in or w, w, [w] * (d - 1), True)


def param_bytes_model(w: int, d: int, P: int, mode: str) -> list[int]:
    """Predicted parameter + gradient bytes per rank (float32), from the stage split alone."""
    from mpidp.parallel import buffer
    from mpidp.parallel import stages as St
    counts, extras = St.param_counts(layers(w, d)[0]), 4 * buffer.N_EXTRA
    if mode == "data":
        return [8 * sum(counts) + extras] * P
    S = 2 if mode == "hybrid" else P
    b = St.split_stages(counts, S)
    return [8 * sum(counts[b[r % S]:b[r % S + 1]]) + extras for r in range(P)]


def largest_width(a, mode: str, P: int) -> int:
    """Largest width (depth ``--budget-depth``) whose predicted parameter bytes plus the
    activation bytes per sample measured in this run fit ``--budget-mib`` on every rank."""
    best, w = 0, 64
    while w <= 1 << 16:
        per_rank = max(param_bytes_model(w, a.budget_depth, P, mode))
        act = a.act_per_sample.get((mode, P), 0.0) * w / a.ref_width * a.batch
        if per_rank + act > a.budget_mib * 2**20:
            break
        best, w = w, w + 64
    return best


MARKERS = {"data": "o", "gpipe": "s", "1f1b": "^", "hybrid": "D"}


def predicted(P: int, m: int) -> float:
    return (P - 1) / (m + P - 1)


def _row(run: dict) -> dict:
    """One line of the comparison table: worst rank for memory, mean rank for idle."""
    r = run["ranks"]
    P, m = run["P"], run["m"]
    step = r[0]["step_s"]
    stages = r[0].get("stages", 1)
    pred = predicted(stages, m) if run["mode"] != "data" else None
    return {"P": P, "mode": run["mode"], "model": f"{run['width']}x{run['depth']}",
            "param_mib": max(x["param_bytes"] for x in r) / MIB,
            "act_mib": max(x["activation_bytes"] for x in r) / MIB,
            "rss_mib": max(x["rss_peak_kib"] for x in r) / 1024,
            "rss_model_mib": max(x["rss_peak_kib"] - x["rss0_kib"] for x in r) / 1024,
            "comm_mib": max(x["comm_bytes"] for x in r) / MIB,
            "step_ms": step * 1e3, "samples_s": run.get("batch", 512) / step,
            "cpu_ms": float(np.mean([x["cpu_s"] for x in r])) * 1e3,
            "idle_wall": float(np.mean([x["idle_wall"] for x in r])),
            "idle_replay": (float(np.mean([x["idle_replay"] for x in r]))
                            if "idle_replay" in r[0] else None), "predicted": pred,
            "cpu_imbalance": max(x["cpu_s"] for x in r) / np.mean([x["cpu_s"] for x in r])}


def _fmt(v, spec=".3f"):
    return "–" if v is None else format(v, spec)


def comparison_table(runs: list[dict]) -> list[str]:
    lines = ["| P | model (width x depth) | mode | params+grads MiB/rank | activations MiB/rank | "
             "peak RSS MiB/rank (model part) | MPI payload MiB/step/rank | step ms | samples/s | "
             "CPU ms/step/rank | idle wall | idle replay | predicted |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        x = _row(run)
        lines.append(f"| {x['P']} | {x['model']} | {LABEL[x['mode']]} | {x['param_mib']:.2f} | "
                     f"{x['act_mib']:.2f} | {x['rss_mib']:.0f} ({x['rss_model_mib']:.0f}) | "
                     f"{x['comm_mib']:.2f} | {x['step_ms']:.0f} | {x['samples_s']:.0f} | "
                     f"{x['cpu_ms']:.0f} | {x['idle_wall']:.3f} | {_fmt(x['idle_replay'])} | "
                     f"{_fmt(x['predicted'])} |")
    return lines


def sweep_checks(sweeps: list[dict]) -> tuple[list[str], list[dict]]:
    """Bubble vs prediction for every (P, schedule, m), by replay and by wall clock.

    A rank's idle share is the schedule's bubble plus its load imbalance: the busiest stage
    idles least, and only because of the schedule, so the bubble is the smallest idle share
    over the ranks and each rank's imbalance is its idle share minus that. Both the bubble
    and every rank's whole idle share are compared with (P-1)/(m+P-1)."""
    lines = ["| P | schedule | m | predicted | idle per rank (replay) | bubble (replay) | "
             "error | idle per rank (wall) | bubble (wall) | error | stage busy min/max | "
             "max error of any rank's idle (replay, wall) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    checks = []
    for sw in sweeps:
        for rows in sw["by_m"]:
            P, m = sw["P"], rows[0]["m"]
            pred = predicted(P, m)
            rep = [x["idle_replay"] for x in rows]
            wall = [x["idle_wall"] for x in rows]
            c = {"P": P, "schedule": sw["schedule"], "m": m, "predicted": pred,
                 "bubble_replay": min(rep), "bubble_wall": min(wall),
                 "replay_err": abs(min(rep) - pred), "wall_err": abs(min(wall) - pred),
                 "any_rank_replay_err": max(abs(v - pred) for v in rep),
                 "any_rank_wall_err": max(abs(v - pred) for v in wall)}
            c["ok"] = c["replay_err"] <= 0.05
            checks.append(c)
            busy = rows[0].get("stage_busy_s")
            lines.append(
                f"| {P} | {sw['schedule']} | {m} | {pred:.3f} | "
                f"{', '.join(f'{v:.3f}' for v in rep)} | {c['bubble_replay']:.3f} | "
                f"{c['replay_err']:.3f}{'' if c['ok'] else ' (over 0.05)'} | "
                f"{', '.join(f'{v:.3f}' for v in wall)} | {c['bubble_wall']:.3f} | "
                f"{c['wall_err']:.3f} | {f'{min(busy) / max(busy):.3f}' if busy else '–'} | "
                f"{c['any_rank_replay_err']:.3f}, {c['any_rank_wall_err']:.3f} |")
    return lines, checks


def activation_checks(sweeps: list[dict]) -> tuple[list[str], list[dict]]:
    by = {(s["P"], s["schedule"]): {rows[0]["m"]: rows for rows in s["by_m"]} for s in sweeps}
    lines = ["| P | m | GPipe peak cached MiB (max rank) | 1F1B | ratio | P/m | <= P/m |",
             "|---|---|---|---|---|---|---|"]
    out = []
    for (P, sched), ms in sorted(by.items()):
        if sched != "gpipe" or (P, "1f1b") not in by:
            continue
        for m, rows in sorted(ms.items()):
            if m < 2 * P or m not in by[(P, "1f1b")]:
                continue
            g = max(x["cached_bytes"] for x in rows)
            f = max(x["cached_bytes"] for x in by[(P, "1f1b")][m])
            ok = 0 < g and f <= (P / m) * g * 1.001
            g = g or float("nan")
            out.append({"P": P, "m": m, "ratio": f / g, "bound": P / m, "ok": ok})
            lines.append(f"| {P} | {m} | {g / MIB:.2f} | {f / MIB:.2f} | {f / g:.3f} | "
                         f"{P / m:.3f} | {'yes' if ok else 'NO'} |")
    return lines, out


def param_checks(runs: list[dict]) -> tuple[list[str], list[dict]]:
    lines = ["| P | model | mode | max params+grads per rank MiB | replica/P | largest stage "
             "imbalance | bound | ok | predicted = measured |", "|---|---|---|---|---|---|---|---|---|"]
    out = []
    dp = {(r["P"], r["width"], r["depth"]): r["ranks"][0]["param_bytes"] for r in runs
          if r["mode"] == "data"}
    for r in runs:
        if r["mode"] not in ("gpipe", "1f1b") or (r["P"], r["width"], r["depth"]) not in dp:
            continue
        per = [x["param_bytes"] for x in r["ranks"]]
        share = dp[(r["P"], r["width"], r["depth"])] / r["P"]
        imbalance = max(per) - sum(per) / len(per)
        ok = max(per) <= share + imbalance + 64
        same = per == param_bytes_model(r["width"], r["depth"], r["P"], r["mode"])
        out.append({"P": r["P"], "ok": ok, "formula_exact": same})
        lines.append(f"| {r['P']} | {r['width']}x{r['depth']} | {r['mode']} | {max(per) / MIB:.2f} | "
                     f"{share / MIB:.2f} | {imbalance / MIB:.2f} | {(share + imbalance) / MIB:.2f} | "
                     f"{'yes' if ok else 'NO'} | {same} |")
    return lines, out


def budget_table(a, runs: list[dict]) -> list[str]:
    a.act_per_sample, a.ref_width = {}, 1
    deep = [r for r in runs if r["depth"] == a.budget_depth]
    if not deep:
        return ["(no measured model of the budget depth)"]
    widest = max(r["width"] for r in deep)
    for r in deep:
        if r["width"] == widest:  # activation bytes per (width x sample), measured
            key = (r["mode"], r["P"])
            a.act_per_sample[key] = max(x["activation_bytes"] for x in r["ranks"]) / widest / a.batch
    lines = [f"Largest width of a depth-{a.budget_depth} MLP whose parameters + gradients + "
             f"activations (batch {a.batch}) fit {a.budget_mib:.0f} MiB on every rank:", "",
             "| P | mode | largest width | parameters (millions) |", "|---|---|---|---|"]
    for (mode, P) in sorted(a.act_per_sample, key=lambda k: (k[1], k[0])):
        w = largest_width(a, mode, P)
        n = (w * w + w) * a.budget_depth / 1e6
        lines.append(f"| {P} | {LABEL[mode]} | {w} | {n:.1f} |")
    return lines


def _bubble_panel(ax, sweeps: list[dict], n_cores: int) -> None:
    """Idle share against micro-batches, measured (replay, wall) over the prediction."""
    for P in sorted({sw["P"] for sw in sweeps}):
        ms = np.arange(1, 17)
        ax.plot(ms, [predicted(P, m) for m in ms], "k--", lw=0.8, zorder=1,
                label=f"(P-1)/(m+P-1), P={P}")
    for i, sw in enumerate(sweeps):
        ms = [rows[0]["m"] for rows in sw["by_m"]]
        rep = [np.mean([x["idle_replay"] for x in rows]) for rows in sw["by_m"]]
        wall = [np.mean([x["idle_wall"] for x in rows]) for rows in sw["by_m"]]
        over = oversubscribed(sw["P"], n_cores)
        c = f"C{i}"
        ax.plot(ms, rep, "o-", color=c, zorder=3, mfc="none" if over else c,
                label=f"{p_label(sw['P'], n_cores)} {sw['schedule']}, replay")
        ax.plot(ms, wall, "x:", color=c, zorder=3,
                label=f"{p_label(sw['P'], n_cores)} {sw['schedule']}, wall")
    ax.set(xscale="log", xlabel="micro-batches m", ylabel="idle fraction (mean over ranks)",
           title="Bubble: measured (points) over the prediction (dashed)")
    legend_outside(ax, fontsize=6)


def _by_model_panel(ax, rows: list[dict], key: str, title: str, n_cores: int) -> list[float]:
    """``key`` per model for each (P, mode); oversubscribed P hollow and dotted, a marker
    per mode."""
    models = list(dict.fromkeys(x["model"] for x in rows))
    values, k = [], 0
    for P in sorted({x["P"] for x in rows}):
        over = oversubscribed(P, n_cores)
        for j, mode in enumerate(LABEL):
            pts = [x for x in rows if x["P"] == P and x["mode"] == mode]
            if pts:  # each series nudged sideways: equal values stay visible
                c, dx = f"C{j}", 0.04 * (k - 3.5)
                ax.plot([models.index(x["model"]) + dx for x in pts], [x[key] for x in pts],
                        MARKERS[mode] + (":" if over else "-"), color=c,
                        mfc="none" if over else c, label=f"{p_label(P, n_cores)} {LABEL[mode]}")
                values += [x[key] for x in pts]
                k += 1
    ax.set_xticks(range(len(models)), models)
    ax.set(title=title, xlabel="model (width x depth)")
    legend_outside(ax, fontsize=6)
    return values


def plot(path: Path, results: dict) -> None:
    """``parallel.png``: the bubble against micro-batches, parameter memory and throughput
    per model (log axes: they span orders of magnitude); runs with more ranks than cores
    drawn hollow and dotted, legends beside the panels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n_cores = cores(results)
    fig, axes = plt.subplots(3, 1, figsize=(10, 13))
    _bubble_panel(axes[0], results["sweeps"], n_cores)
    rows = [_row(r) for r in results["runs"]]
    mem = _by_model_panel(axes[1], rows, "param_mib", "params+grads per rank (MiB)", n_cores)
    rate = _by_model_panel(axes[2], rows, "samples_s", "throughput (samples/s)", n_cores)
    log_if_wide(axes[1], mem, factor=5)
    log_if_wide(axes[2], rate, factor=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _sweep_model(sweeps: list[dict]) -> str:
    if not sweeps:
        return ""
    sw = sweeps[0]
    n_in = sw.get("n_in", sw["width"])
    return (f"Model: {sw['depth']} Dense layers, {n_in} -> {sw['width']} then {sw['width']} x "
            f"{sw['width']}, ReLU, {sw['width']} classes. The first layer's backward skips dL/dx "
            f"(the data needs no gradient), so an input width of 1.5 x {sw['width']} gives it the "
            f"FLOPs of the other layers and the stages can be equal, as (P-1)/(m+P-1) assumes. "
            f"A rank's idle share is the schedule's bubble plus its load imbalance; the "
            f"busiest stage idles least and only because of the schedule, so 'bubble' is the "
            f"smallest idle share over the ranks, and the last column holds each rank's whole "
            f"idle share to the same bound. 'stage busy min/max' shows how equal the stages "
            f"were. Replay: each op's median CPU time run through the schedule's "
            f"dependencies (every rank as if on its own core); wall: time inside ops over the "
            f"step's makespan (faithful at P = 2, inflated by core sharing at P = 4).")


def write_reports(a, results: dict) -> None:
    out = Path(a.out)
    sweep_lines, bubble = sweep_checks(results["sweeps"])
    act_lines, act = activation_checks(results["sweeps"])
    par_lines, par = param_checks(results["runs"])
    results["targets"] = {
        "bubble_within_0.05_replay": all(c["ok"] for c in bubble),
        "bubble_within_0.05_wall_P2": all(c["wall_err"] <= 0.05 for c in bubble if c["P"] == 2),
        "every_rank_idle_within_0.05_replay": all(c["any_rank_replay_err"] <= 0.05 for c in bubble),
        "every_rank_idle_within_0.05_wall_P2": all(c["any_rank_wall_err"] <= 0.05
                                                   for c in bubble if c["P"] == 2),
        "bubble_checks": bubble, "1f1b_activation_le_P_over_m": all(c["ok"] for c in act),
        "activation_checks": act, "pipeline_params_le_share_plus_imbalance": all(c["ok"] for c in par),
        "param_checks": par}
    md = ["# Data parallel vs pipeline vs hybrid", "", f"Command: `{results['env']['command']}`",
          f"Machine: {results['env']['cpus']} CPUs ({results['env']['machine']}), python "
          f"{results['env']['python']}, numpy {results['env']['numpy']}; one BLAS thread per rank; "
          f"mpidp commit {results['env'].get('commit', 'unknown')}, {results['env'].get('date', '')}.",
          "", "## Comparison (m = 2P micro-batches)", "", *comparison_table(results["runs"]), "",
          "## Bubble vs micro-batches", "", _sweep_model(results["sweeps"]), "", *sweep_lines, "",
          "## 1F1B vs GPipe activation memory (m >= 2P)", "", *act_lines, "",
          "## Pipeline parameter memory per rank", "", *par_lines, "",
          "## Largest model within the memory budget", "", *budget_table(a, results["runs"]), "",
          "## Targets", "", *[f"- {k}: {v}" for k, v in results["targets"].items()
                                if isinstance(v, bool)]]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    plot(out.with_suffix(".png"), results)
    print("\n".join(md))


def main(argv: list[str] | None = None) -> int:
    """``--replot parallel.json [--out parallel.png]``: redraw the figure, run nothing."""
    import argparse
    p = argparse.ArgumentParser(description="redraw bench_parallel's figure from its JSON")
    p.add_argument("--replot", metavar="JSON", required=True)
    p.add_argument("--out", default=None, help="PNG to write (default: beside the JSON)")
    a = p.parse_args(argv)
    out = Path(a.out or Path(a.replot).with_suffix(".png"))
    plot(out, json.loads(Path(a.replot).read_text()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
