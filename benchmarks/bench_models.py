"""Driver behind ``make bench-models``: accuracy, exactness and speed of the layers of
``mpidp.nn`` (convolutions, pooling, batch norm), written to
``benchmarks/results/models.{json,md}``.

1. MNIST-1D (``--dataset mnist1d``) through the CLI at P = 2, ``--model logreg``, ``mlp``,
   ``cnn`` with the CLI's DEFAULT settings (what each run used is read back from its
   ``metrics.json``), several seeds, beside the published baselines; and the ``cnn`` run
   at P = 1, 2 and 4 in float64: max |difference| of the saved parameters.
2. ``--dataset digits --model cnn`` at P = 2 (target >= 0.98; when the defaults miss it,
   longer runs are tried and the first that reaches it is reported).
3. Step time (``bench_models_step.py``): a LeNet-sized CNN in mpidp against PyTorch at P = 1,
   P = 2 efficiency next to the standard MLP workload's, and the GEMM share of a CNN step.
4. Batch norm's collectives and global against per-rank statistics (``bench_models_bn.py``).

Every job is ``mpiexec -n P ...`` in a subprocess with a timeout, one BLAS thread per rank,
``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE`` removed. Timed jobs wait for the CPUs to go
quiet first and run again (``--retries``) when other processes kept them busy. Targets
are printed as PASS/MISS; a miss does not fail the command (a benchmark, not a test).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import (
    BUSY_WARN,
    Jobs,
    blas_text,
    command,
    loadavg,
    machine,
    quick_defaults,
    write,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
#: Greydanus (2020), "Scaling down deep learning", MNIST-1D test accuracy of the baselines.
PUBLISHED = {"logreg": 0.32, "mlp": 0.68, "cnn": 0.94}
MAX_PARAM_DIFF = 1e-10
MIN_DIGITS_ACC = 0.98
MAX_TORCH_RATIO = 1.3
BN_MODEL = "examples/models/digits-cnn-bn.toml"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mpiexec", default=str(REPO / ".venv" / "bin" / "mpiexec"))
    p.add_argument("--python", default=sys.executable, help="interpreter for the ranks")
    p.add_argument("--out-dir", default=str(HERE / "results"), help="where results are written")
    p.add_argument("--seeds", default="0,1,2,3,4", help="seeds of the accuracy runs (0: the default)")
    p.add_argument("--exact-ranks", default="1,2,4", help="world sizes of the float64 runs")
    p.add_argument("--repeats", type=int, default=7, help="timed runs of each workload per job")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per mpiexec job")
    p.add_argument("--retries", type=int, default=2,
                   help="reruns of a timed job during which other processes kept the CPUs busy")
    p.add_argument("--wait-quiet", type=float, default=30,
                   help="seconds to wait for the CPUs to go quiet before each timed job")
    p.add_argument("--quick", action="store_true", help="few seeds and repeats (a smoke test)")
    quick_defaults(p, quick=True, wait_quiet=0, retries=0)
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.repeats, args.exact_ranks = "0", 2, "1,2"
    args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    args.exact_ranks = sorted({int(r) for r in args.exact_ranks.split(",") if r.strip()} | {1})
    if not args.seeds or args.repeats < 1:
        p.error("give at least one seed and --repeats >= 1")
    return args


# --- jobs ---------------------------------------------------------------------------------

def train(jobs: Jobs, P: int, dataset: str, model: str, out: Path, *extra: str) -> dict:
    """``mpidp train`` through the CLI on ``P`` ranks; what it reported and used."""
    cmd = [jobs.args.mpiexec, "-n", str(P), jobs.args.python, "-m", "mpidp", "train",
           "--dataset", dataset, "--model", model, "--out", str(out), "-q", *extra]
    jobs.run(cmd, f"mpidp train --dataset {dataset} --model {model} -n {P}")
    m = json.loads((out / "metrics.json").read_text())
    cfg = m["config"]
    return {"P": P, "test_accuracy": m["test_accuracy"], "train_accuracy": m["train_accuracy"],
            "final_loss": m["final_loss"], "wall_s": m["wall_s"], "n_params": m["n_params"],
            "steps": m["steps"], **{k: cfg[k] for k in USED}, "model_dir": out}


#: the settings of a run that its metrics.json records and the report shows
USED = ("epochs", "batch_size", "optimizer", "lr", "momentum", "weight_decay", "dtype",
        "test_fraction", "seed")


# --- 1. and 2.: accuracy and exactness through the CLI ---------------------------------

def architecture(model_dir: Path) -> list[str]:
    """The layers of the model a run saved (what the preset built at this commit)."""
    from mpidp import nn
    return [repr(layer) for layer in nn.load(model_dir).layers]


def split_of(dataset: str, test_fraction: float | None, seed: int) -> dict:
    """How the CLI's run split ``dataset``: train/test rows and whether it is the data set's
    own test set (for mnist1d the package's 4,000/1,000 split)."""
    from mpidp.data.partition import DEFAULT_TEST_FRACTION, split_rows
    from mpidp.data.sources import open_source
    src = open_source(dataset)
    train, test = split_rows(src.n_samples, test_fraction, seed, src.fixed_test)
    fixed = (src.fixed_test is not None and len(test) == src.fixed_test
             and int(test[0]) == src.n_samples - src.fixed_test)
    return {"n_train": len(train), "n_test": len(test),
            "split": "the data set's own test set (last rows)" if fixed else
            f"a random {test_fraction if test_fraction is not None else DEFAULT_TEST_FRACTION:.0%} "
            "of the rows (seeded)"}


def seeds_summary(runs: list[dict]) -> dict:
    accs = [r["test_accuracy"] for r in runs]
    return {"median": statistics.median(accs), "min": min(accs), "max": max(accs),
            "by_seed": {r["seed"]: r["test_accuracy"] for r in runs},
            "settings": {k: runs[0][k] for k in USED if k != "seed"},
            "wall_s_median": statistics.median(r["wall_s"] for r in runs),
            "steps": runs[0]["steps"], "n_params": runs[0]["n_params"]}


def mnist1d_accuracy(jobs: Jobs, tmp: Path, seeds: list[int]) -> dict:
    out = {}
    for model in ("logreg", "mlp", "cnn"):
        runs = [train(jobs, 2, "mnist1d", model, tmp / f"m1d-{model}-{s}", "--seed", str(s))
                for s in seeds]
        out[model] = {**seeds_summary(runs), "published": PUBLISHED[model],
                      "layers": architecture(runs[0]["model_dir"])}
    r0 = out["cnn"]["settings"]
    out["split"] = split_of("mnist1d", r0["test_fraction"], seeds[0])
    return out


def exactness(jobs: Jobs, tmp: Path, ranks: list[int]) -> dict:
    import numpy as np
    params = {}
    for P in ranks:
        d = tmp / f"exact-{P}"
        train(jobs, P, "mnist1d", "cnn", d, "--dtype", "float64")
        with np.load(d / "model.npz") as z:
            params[P] = z["params"].astype(np.float64)
    diffs = {P: float(np.max(np.abs(params[P] - params[1]))) for P in ranks if P != 1}
    return {"dataset": "mnist1d", "model": "cnn", "dtype": "float64", "n_params": len(params[1]),
            "max_abs_diff_vs_P1": diffs, "max": max(diffs.values())}


def digits_accuracy(jobs: Jobs, tmp: Path, seeds: list[int]) -> dict:
    runs = [train(jobs, 2, "digits", "cnn", tmp / f"digits-{s}", "--seed", str(s)) for s in seeds]
    out = {"default": {**seeds_summary(runs), "layers": architecture(runs[0]["model_dir"])},
           "split": split_of("digits", runs[0]["test_fraction"], seeds[0]), "longer": []}
    base = runs[0]["epochs"]
    if out["default"]["median"] < MIN_DIGITS_ACC:  # what does reach it: the same, for longer
        for factor in (2, 3, 4):
            longer = [train(jobs, 2, "digits", "cnn", tmp / f"digits-{factor}x-{s}", "--seed", str(s),
                                 "--epochs", str(base * factor)) for s in seeds]
            out["longer"].append(seeds_summary(longer))
            if out["longer"][-1]["median"] >= MIN_DIGITS_ACC:
                break
    return out


# --- 3. and 4.: the timed jobs -----------------------------------------------------------

def speed(jobs: Jobs, tmp: Path, repeats: int) -> dict:
    runs = {}
    for P in ("1", "2"):
        out = tmp / f"step{P}.json"
        extra = ["--profile"] if P == "1" else ["--no-torch"]
        runs[P] = jobs.timed([jobs.args.mpiexec, "-n", P, jobs.args.python,
                              "-m", "benchmarks.bench_models_step", "--out", str(out),
                              "--repeats", str(repeats), *extra], out, f"step time P={P}")
    one, two = runs["1"]["results"], runs["2"]["results"]
    eff = {w: two[w]["samples_per_s"] / (2 * one[w]["samples_per_s"]) for w in ("cnn", "mlp")}
    return {"runs": runs, "efficiency_P2": eff, "profile": summarise_profile(one["profile"])}


def summarise_profile(prof: dict) -> dict:
    """The CNN step split into matrix products and the rest, by kind of work."""
    parts, gemms = prof["parts_ms"], prof["gemm_alone_ms"]
    step = prof["plain_step_ms"]
    gemm_by_layer: dict[str, float] = {}
    for label, ms in gemms.items():
        layer = " ".join(label.split()[:2])  # "0 Conv2d"
        pas = label.split()[2]  # forward / backward
        gemm_by_layer[f"{layer} {pas}"] = gemm_by_layer.get(f"{layer} {pas}", 0.0) + ms
    kinds = {"GEMMs (the same shapes timed alone)": sum(gemms.values())}
    rest = {"conv: im2col copy, layout transposes, bias (forward)": 0.0,
            "conv: col2im adds, dy/dx transposes, bias gradient (backward)": 0.0,
            "dense: bias and its gradient": 0.0, "pooling (max)": 0.0, "activations (ReLU)": 0.0,
            "flatten": 0.0, "loss (softmax cross-entropy)": 0.0}
    other = {}
    for label, ms in parts.items():
        words = label.split()
        if len(words) == 3 and words[0].isdigit():
            kind, pas = words[1], words[2]
            non_gemm = ms - gemm_by_layer.get(label, 0.0)
            if kind == "Conv2d":
                key = "forward" if pas == "forward" else "backward"
                rest[next(k for k in rest if k.startswith("conv") and key in k)] += non_gemm
            elif kind == "Dense":
                rest["dense: bias and its gradient"] += non_gemm
            elif kind == "MaxPool":
                rest["pooling (max)"] += ms
            elif kind == "ReLU":
                rest["activations (ReLU)"] += ms
            elif kind == "Flatten":
                rest["flatten"] += ms
            else:
                other[label] = ms
        elif label.startswith("loss"):
            rest["loss (softmax cross-entropy)"] += ms
        else:
            other[label] = ms
    kinds.update(rest)
    kinds.update(other)
    instrumented = prof["instrumented_step_ms"]
    return {"step_ms": step, "instrumented_step_ms": instrumented,
            "gemm_ms": kinds["GEMMs (the same shapes timed alone)"],
            "gemm_share": kinds["GEMMs (the same shapes timed alone)"] / instrumented,
            "by_kind_ms": kinds, "gemm_alone_ms": gemms, "layers_ms": parts,
            "conv_dW_other_order_ms": prof.get("conv_dW_other_order_ms", {})}


def batchnorm(jobs: Jobs, tmp: Path, repeats: int, seeds: list[int]) -> dict:
    """The timed cost job (run again when disturbed), then the accuracy job (once)."""
    cmd = [jobs.args.mpiexec, "-n", "2", jobs.args.python, "-m", "benchmarks.bench_models_bn",
           "--model", BN_MODEL, "--repeats", str(repeats), "--seeds", ",".join(map(str, seeds))]
    out = tmp / "bn-cost.json"
    result = jobs.timed([*cmd, "--out", str(out), "--part", "cost"], out, "batch norm cost P=2")
    out = tmp / "bn-accuracy.json"
    jobs.run([*cmd, "--out", str(out), "--part", "accuracy"], "batch norm accuracy P=2")
    result["accuracy"] = json.loads(out.read_text())["accuracy"]
    return result


# --- report -----------------------------------------------------------------------------

def targets(r: dict) -> list[dict]:
    out = []
    ex = r["exactness"]
    out.append({"target": f"MNIST-1D cnn, float64: parameters at P = "
                f"{', '.join(map(str, ex['max_abs_diff_vs_P1']))} equal P = 1's to <= {MAX_PARAM_DIFF:g}",
                "value": f"max |diff| {ex['max']:.3g}", "pass": ex["max"] <= MAX_PARAM_DIFF})
    dg = r["digits"]["default"]
    out.append({"target": f"digits cnn at P = 2, default settings: test accuracy >= {MIN_DIGITS_ACC}",
                "value": f"median {dg['median']:.4f} over {len(dg['by_seed'])} seed(s) "
                f"(seed 0: {dg['by_seed'].get(0, float('nan')):.4f})",
                "pass": dg["median"] >= MIN_DIGITS_ACC})
    one = r["speed"]["runs"]["1"]["results"]
    if "ratio_mpidp_over_torch" in one:
        ratio = one["paired_ratio_median"]
        out.append({"target": f"LeNet-sized CNN step at P = 1 within {MAX_TORCH_RATIO}x of PyTorch",
                    "value": f"{ratio:.3f} (median of paired ratios; ratio of medians "
                    f"{one['ratio_mpidp_over_torch']:.3f})", "pass": ratio <= MAX_TORCH_RATIO})
    else:
        out.append({"target": f"LeNet-sized CNN step at P = 1 within {MAX_TORCH_RATIO}x of PyTorch",
                    "value": f"skipped: {one['torch_note']}", "pass": None})
    return out


def _verdict(t: dict) -> str:
    return "SKIPPED" if t["pass"] is None else ("PASS" if t["pass"] else "MISS")


def _settings(s: dict) -> str:
    opt = s["optimizer"] + (f" {s['momentum']}" if s["optimizer"] == "momentum" else "")
    return f"{s['epochs']} epochs, batch {s['batch_size']}, {opt}, lr {s['lr']}, {s['dtype']}"


def _acc(summary: dict) -> str:
    return (f"{summary['median']:.4f} ({summary['min']:.4f}-{summary['max']:.4f})"
            if len(summary["by_seed"]) > 1 else f"{summary['median']:.4f}")


def markdown(report: dict) -> str:
    r = report["results"]
    m1d, dg, ex, sp, bn = r["mnist1d"], r["digits"], r["exactness"], r["speed"], r["batchnorm"]
    L = ["# Models: accuracy, exactness and speed of the new layers", "",
         f"Command `{report['command']}`, commit {report['machine']['commit']}, "
         f"{report['date']}; {report['wall_s'] / 60:.1f} minutes.", "",
         "## MNIST-1D through the CLI", "",
         f"`mpidp train --dataset mnist1d --model M` at P = 2 with the CLI's default settings, seeds "
         f"{', '.join(map(str, report['seeds']))} (0 is the default); test accuracy: median (min-max). "
         f"Split: {m1d['split']['split']}, {m1d['split']['n_train']} training and "
         f"{m1d['split']['n_test']} test series.", "",
         "| model | layers (as the preset built them) | parameters | settings (read back from metrics.json) "
         "| test accuracy | published (Greydanus 2020) | s per run |",
         "|---|---|---:|---|---:|---:|---:|"]
    for name in ("logreg", "mlp", "cnn"):
        s = m1d[name]
        L.append(f"| {name} | {', '.join(s['layers'])} | {s['n_params']:,} | {_settings(s['settings'])} | "
                 f"{_acc(s)} | {s['published']:.2f} | {s['wall_s_median']:.1f} |")
    diffs = ", ".join(f"P = {P}: {d:.3g}" for P, d in ex["max_abs_diff_vs_P1"].items())
    L += ["", f"Exactness: the `cnn` run (seed 0) with `--dtype float64` at P = 1, "
          f"{', '.join(map(str, ex['max_abs_diff_vs_P1']))}: max |difference| of the "
          f"{ex['n_params']:,} saved parameters from P = 1's: {diffs}.", "",
          "## Digits as images", "",
          f"`mpidp train --dataset digits --model cnn` at P = 2, seeds as above; layers "
          f"{', '.join(dg['default']['layers'])} ({dg['default']['n_params']:,} parameters); "
          f"{dg['split']['split']}, {dg['split']['n_train']}/{dg['split']['n_test']} rows.", "",
          "| settings | test accuracy | by seed |", "|---|---:|---|",
          f"| defaults: {_settings(dg['default']['settings'])} | {_acc(dg['default'])} | "
          f"{', '.join(f'{v:.4f}' for v in dg['default']['by_seed'].values())} |"]
    for s in dg["longer"]:
        L.append(f"| `--epochs {s['settings']['epochs']}`: {_settings(s['settings'])} | {_acc(s)} | "
                 f"{', '.join(f'{v:.4f}' for v in s['by_seed'].values())} |")
    one, two = sp["runs"]["1"]["results"], sp["runs"]["2"]["results"]
    L += ["", "## Step time", "",
          "LeNet-sized CNN on (1, 28, 28) float32 inputs (Conv2d(6, 5) ReLU MaxPool(2) Conv2d(16, 5) "
          "ReLU MaxPool(2) Flatten Dense 120 ReLU Dense 84 ReLU Dense 10; "
          f"{sp['runs']['1']['cnn']['n_params']:,} parameters), global batch 64, "
          "SGD with momentum 0.9; the standard MLP workload (784-1024-1024-10, plain SGD, batch 512) "
          f"in the same jobs. One BLAS thread per rank (PyTorch: `torch.set_num_threads(1)`); "
          f"{report['repeats']} repeats per job taking turns, 5 warm-up steps dropped each, "
          "slowest rank between barriers, medians.", "",
          "| workload | P = 1 ms/step | P = 2 ms/step | samples/s P = 1 | samples/s P = 2 | "
          "efficiency P = 2 |", "|---|---:|---:|---:|---:|---:|"]
    for w, label in (("cnn", "CNN, mpidp"), ("mlp", "MLP standard workload, mpidp")):
        L.append(f"| {label} | {one[w]['step_ms']:.2f} | {two[w]['step_ms']:.2f} | "
                 f"{one[w]['samples_per_s']:.0f} | {two[w]['samples_per_s']:.0f} | "
                 f"{sp['efficiency_P2'][w]:.3f} |")
    if "torch" in one:
        L.append(f"| CNN, PyTorch {one['torch_note']} | {one['torch']['step_ms']:.2f} | - | "
                 f"{one['torch']['samples_per_s']:.0f} | - | - |")
        L += ["", f"mpidp / PyTorch at P = 1: **{one['paired_ratio_median']:.3f}** (median of the "
              f"{len(one['paired_ratios'])} paired repeats; ratio of the medians "
              f"{one['ratio_mpidp_over_torch']:.3f}). Both start from the same parameters on the same "
              f"batches: after 5 steps they differ by at most {one['params_diff_after_5_steps']:.2g} "
              "(float32 rounding), so they compute the same thing."]
    else:
        L += ["", f"PyTorch comparison skipped: {one['torch_note']}."]
    pr = sp["profile"]
    L += ["", "### Where an mpidp CNN step goes (P = 1, batch 64)", "",
          f"Each layer's forward and backward, the loss, the exchange and the update timed inside "
          f"{one['profile']['steps']} steps ({pr['instrumented_step_ms']:.2f} ms "
          f"per step instrumented, {pr['step_ms']:.2f} ms plain), and the step's matrix products "
          "timed alone with the same shapes and layouts (warm in cache: a lower bound); a "
          "layer's time less its GEMMs is its non-GEMM work.", "",
          "| part | ms/step | share |", "|---|---:|---:|"]
    for k, v in pr["by_kind_ms"].items():
        L.append(f"| {k} | {v:.3f} | {v / pr['instrumented_step_ms']:.1%} |")
    L += ["", "| GEMM alone | ms |", "|---|---:|",
          *(f"| {k} | {v:.3f} |" for k, v in pr["gemm_alone_ms"].items()),
          *(f"| (not in the step) {k} | {v:.3f} |" for k, v in pr["conv_dW_other_order_ms"].items())]
    cost = bn["cost"]
    L += ["", "## Batch norm's collectives", "",
          f"`{bn['model_file']}` ({', '.join(bn['layers'])}; {bn['n_params']:,} parameters) on "
          f"{bn['dataset']} at P = 2. Global statistics: the layers' own `Allreduce`s, counted in "
          "`DataParallel.layer_sums` and timed in `layer_sums_s` (waiting for the other rank "
          "included); per-rank statistics: `dp.model.context.reduce_sum = lambda a: a` (no extra "
          f"collective). Both in turns in one job, {bn['repeats']} repeats of {bn['steps']} steps, medians. "
          f"Back-to-back floor of one such `Allreduce` ({cost['allreduce_floor_doubles']} doubles): "
          f"{cost['allreduce_floor_us']:.1f} us.", "",
          "| global batch | Allreduces per step | their ms per step (mean over ranks) | share of the step "
          "| step ms, global stats | step ms, per-rank stats | difference ms | paired ratio |",
          "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for batch, c in cost["by_batch"].items():
        g, p = c["global"], c["per_rank"]
        L.append(f"| {batch} | {g['layer_sums_per_step']:.0f} | {g['layer_sums_ms_mean']:.3f} | "
                 f"{c['layer_sums_share']:.1%} | {g['step_ms']:.3f} | {p['step_ms']:.3f} | "
                 f"{c['extra_ms']:.3f} | {c['paired_ratio_global_over_per_rank']:.3f} |")
    d = bn["cli_defaults"]
    for acc in bn["accuracy"].values():
        L += ["", f"Accuracy at global batch {acc['global_batch']} ({acc['per_rank_batch']:g} rows per "
              f"rank), `mpidp.fit` with the CLI's defaults otherwise ({d['epochs']} epochs, "
              f"{d['optimizer']} {d['momentum']}, lr {d['lr']}), seeds {', '.join(map(str, acc['seeds']))}. "
              "With per-rank statistics the running statistics differ between the ranks (parameters "
              "stay identical), so the figure is rank 0's model on the whole test set (rank 1's in "
              "brackets).", "",
              "| seed | global statistics | per-rank statistics | difference | per-rank running stats: "
              "max rank difference |", "|---:|---:|---:|---:|---:|"]
        for row in acc["runs"]:
            g, p = row["global"], row["per_rank"]
            L.append(f"| {row['seed']} | {g['test_accuracy_rank0']:.4f} | {p['test_accuracy_rank0']:.4f} "
                     f"({p['test_accuracy_by_rank'][1]:.4f}) | {row['difference']:+.4f} | "
                     f"{p['state_max_abs_diff_between_ranks']:.3g} |")
        L.append(f"| median | {acc['median_global']:.4f} | {acc['median_per_rank']:.4f} | "
                 f"{acc['median_difference']:+.4f} | |")
    L += ["", "## Targets", "",
          *(f"- {_verdict(t)}: {t['target']} (measured {t['value']})" for t in report["targets"]),
          *(f"- WARNING: other processes used {run['other_cpus_during']:.2f} CPUs during the {name} "
            "job: its timings are suspect" for name, run in report["timed_jobs"].items()
            if (run.get("other_cpus_during") or 0.0) > BUSY_WARN * report["machine"]["nproc"]),
          "", "## Where and how", "", *provenance(report)]
    return "\n".join(L) + "\n"


def provenance(report: dict) -> list[str]:
    m = report["machine"]
    removed = ", ".join(m["openblas_env_removed"]) or "none were set"
    lines = [f"- Machine: {m['nproc']} CPUs, {m['cpu_model']}, {m['platform']}; load average "
             f"{m['loadavg_before']} before, {m['loadavg_after']} after",
             f"- BLAS (threadpoolctl, in the ranks): {blas_text(m['blas'])}",
             f"- OpenBLAS variables removed for the runs: {removed}",
             f"- MPI: {m['mpi_library']} (mpi4py {m['mpi4py']}); numpy {m['numpy']}; Python {m['python']}; "
             f"PyTorch {m['torch']}",
             f"- mpidp {m['mpidp']} at commit {m['commit']}"]
    for name, run in report["timed_jobs"].items():
        busy, other = run.get("cpu_busy_before"), run.get("other_cpus_during")
        lines.append(f"- {name} job: CPUs {'-' if busy is None else format(busy, '.0%')} busy just "
                     f"before; other processes used {'-' if other is None else format(other, '.2f')} "
                     f"CPUs during it (attempt {run.get('attempt')} of {run.get('attempts')}, "
                     "the least disturbed)")
    lines += ["- Commands:", *(f"  - `{c}`" for c in report["commands"])]
    return lines


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return str(obj) if isinstance(obj, Path) else obj


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs, t0, load_before = Jobs(args), time.monotonic(), loadavg()
    try:
        with tempfile.TemporaryDirectory(prefix="bench_models_") as tmp_name:
            tmp = Path(tmp_name)  # the timed jobs first, while the machine is as quiet as it gets
            speed_r = speed(jobs, tmp, args.repeats)
            bn = batchnorm(jobs, tmp, args.repeats, args.seeds)
            results = {"mnist1d": mnist1d_accuracy(jobs, tmp, args.seeds),
                       "exactness": exactness(jobs, tmp, args.exact_ranks),
                       "digits": digits_accuracy(jobs, tmp, args.seeds),
                       "speed": speed_r, "batchnorm": bn}
    except (RuntimeError, OSError, ValueError, KeyError) as exc:  # no result: that is an error
        print(f"bench_models: {exc}", file=sys.stderr)
        return 1
    env = speed_r["runs"]["1"]["environment"]
    report = {"benchmark": "models", "seeds": args.seeds, "repeats": args.repeats,
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "wall_s": time.monotonic() - t0,
              "command": command("bench_models", argv),
              "commands": jobs.commands, "machine": machine(
                  env, jobs.dropped, loadavg_before=load_before, loadavg_after=loadavg(),
                  torch=env["torch"] or "not installed"),
              "timed_jobs": {name: {k: run.get(k) for k in ("cpu_busy_before", "other_cpus_during",
                                                            "attempt", "attempts")}
                             for name, run in (("step time P=1", speed_r["runs"]["1"]),
                                               ("step time P=2", speed_r["runs"]["2"]),
                                               ("batch norm cost", bn))},
              "results": results}
    report["targets"] = targets(results)
    report = _jsonable(report)
    text = markdown(report)
    write(out_dir / "models", report, text)
    print(text)
    print(f"wrote {out_dir / 'models.json'} and {out_dir / 'models.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
