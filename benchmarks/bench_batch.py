"""Driver behind ``make bench-batch``: how far the global batch can grow on MNIST-1D
(``--dataset mnist1d --model cnn``, its own 4,000/1,000 split, a fixed epoch budget),
written to ``benchmarks/results/batch.{json,md,png}``.

1. Test accuracy against the global batch (32 ... 2048) for four recipes, several seeds:
   (a) momentum SGD at one constant rate, tuned on a small grid at the base batch and then
   kept at every batch; (b) the linear scaling rule from that rate with a 2-epoch warmup, a
   cosine decay and clipping of the global gradient norm; (b0) the same without clipping
   (the ablation that shows what clipping does); (c) LAMB, its rate tuned on a grid at the
   base batch and scaled by the square root of the batch, with the same warmup and decay.
2. Time to a target test accuracy (cumulative per-epoch training ``seconds`` of
   metrics.json, evaluation excluded) for the small-batch baseline and the large-batch
   recipes at P = 1 and P = 2, run alone, P = 1 and P = 2 in turns.
3. Exactness: the large-batch recipes at P = 1 and P = 2 in float64, max |difference| of
   the saved parameters.

Every job is ``mpiexec -n P python -m mpidp train ... --out DIR -q`` (DIR/metrics.json read
back) with one BLAS thread per rank and ``OPENBLAS_CORETYPE``/``OPENBLAS_L2_SIZE`` removed.
Accuracy runs at P = 1 are deterministic, so ``--jobs`` of them share the CPUs; timed runs
run alone, again (``--retries``) while other processes keep the CPUs busy. A run that
diverges or fails is recorded (accuracy NaN), never dropped. ``--timing-from batch.json``
reuses an earlier run's tuning and sweep and repeats only sections 2 and 3 (for a quieter
moment). Targets are printed as PASS/MISS; a miss does not fail the command (a benchmark,
not a test).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.bench_batch_report import median_nan, write_report
from benchmarks.harness import (
    bench_env,
    children_cpu_s,
    command,
    cpu_model,
    cpu_ticks,
    git_commit,
    least_disturbed,
    loadavg,
    other_cpus,
    quick_defaults,
    shown,
    wait_quiet,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
GAP = 0.01  # the accuracy a larger batch may lose against the small-batch baseline
MAX_PARAM_DIFF = 1e-10

#: The recipes: CLI options after the common ones, ``{lr}`` and ``{base}`` filled in.
#: ``tuned`` names the grid the base rate comes from (tuned at the base batch).
RECIPES: dict[str, dict] = {
    "constant": {"label": "(a) momentum SGD, constant rate tuned at the base batch",
                 "tuned": "sgd", "args": ["--optimizer", "momentum", "--momentum", "0.9",
                                          "--lr", "{lr}"]},
    "linear-noclip": {"label": "(b0) linear scaling + 2-epoch warmup + cosine, no clipping",
                      "tuned": "sgd", "args": ["--optimizer", "momentum", "--momentum", "0.9",
                                               "--lr", "{lr}", "--lr-scaling", "linear",
                                               "--base-batch", "{base}", "--warmup-epochs", "2",
                                               "--lr-schedule", "cosine"]},
    "linear": {"label": "(b) linear scaling + 2-epoch warmup + cosine + --clip-norm 2",
               "tuned": "sgd", "args": ["--optimizer", "momentum", "--momentum", "0.9",
                                        "--lr", "{lr}", "--lr-scaling", "linear",
                                        "--base-batch", "{base}", "--warmup-epochs", "2",
                                        "--lr-schedule", "cosine", "--clip-norm", "2"]},
    "lamb": {"label": "(c) LAMB, sqrt scaling + 2-epoch warmup + cosine", "tuned": "lamb",
             "args": ["--optimizer", "lamb", "--lr", "{lr}", "--lr-scaling", "sqrt",
                      "--base-batch", "{base}", "--warmup-epochs", "2", "--lr-schedule", "cosine"]},
}
#: the recipe whose grid each tuning uses (at the base batch every scaling is the identity)
TUNE_WITH = {"sgd": "constant", "lamb": "lamb"}
#: the large-batch recipes of the timing and exactness sections
LARGE = ("linear", "lamb")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mpiexec", default=str(REPO / ".venv" / "bin" / "mpiexec"))
    p.add_argument("--python", default=sys.executable, help="interpreter for the ranks")
    p.add_argument("--out-dir", default=str(HERE / "results"), help="where results are written")
    p.add_argument("--batches", default="32,64,128,256,512,1024,2048", help="global batch sizes")
    p.add_argument("--epochs", type=int, default=20, help="the fixed epoch budget of every run")
    p.add_argument("--seeds", default="0,1,2", help="seeds of every accuracy run (median)")
    p.add_argument("--tune-seeds", default="0,1", help="seeds of the tuning runs (median)")
    p.add_argument("--sgd-grid", default="0.01,0.03,0.1", help="momentum SGD rates tried at the base batch")
    p.add_argument("--lamb-grid", default="0.003,0.01,0.03", help="LAMB rates tried at the base batch")
    p.add_argument("--recipes", default=",".join(RECIPES), help="which recipes to sweep")
    p.add_argument("--target", type=float, default=0.93, help="test accuracy of the time-to-target section")
    p.add_argument("--exact-batch", type=int, default=512, help="global batch of the float64 runs")
    p.add_argument("--jobs", type=int, default=2, help="untimed P = 1 accuracy runs at once")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per mpiexec job")
    p.add_argument("--wait-quiet", type=float, default=10,
                   help="seconds to wait for the CPUs to go quiet before each timed job")
    p.add_argument("--retries", type=int, default=1,
                   help="reruns of a timed job during which other processes kept the CPUs busy "
                   "(the least disturbed is kept)")
    p.add_argument("--timing-from", metavar="JSON",
                   help="take the tuning and the accuracy sweep from an earlier batch.json (P = 1 "
                   "runs are deterministic) and run only the timing and exactness sections again")
    p.add_argument("--replot", metavar="JSON", help="only rewrite batch.md and batch.png from JSON")
    p.add_argument("--quick", action="store_true", help="two batches, one seed, 3 epochs (a smoke test)")
    quick_defaults(p, quick=True, wait_quiet=0, retries=0)
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.seeds, args.tune_seeds, args.epochs = "32,256", "0", "0", 3
        args.sgd_grid, args.lamb_grid, args.exact_batch = "0.03", "0.01", 256
    ints = lambda s: [int(x) for x in s.split(",") if x.strip()]
    floats = lambda s: [float(x) for x in s.split(",") if x.strip()]
    args.batches, args.seeds = sorted(ints(args.batches)), ints(args.seeds)
    args.tune_seeds = ints(args.tune_seeds)
    args.grids = {"sgd": floats(args.sgd_grid), "lamb": floats(args.lamb_grid)}
    args.recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in args.recipes if r not in RECIPES]
    if unknown:
        p.error(f"unknown recipe(s) {', '.join(unknown)}; choose from {', '.join(RECIPES)}")
    if not args.batches or not args.seeds or not args.tune_seeds or not all(args.grids.values()):
        p.error("give at least one batch, seed, tuning seed and rate in each grid")
    return args


# --- jobs -------------------------------------------------------------------------------

def first_error(text: str) -> str:
    """The line of a failed job's output that says why (mpidp's ``error:`` line if any)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if "error:" in ln:
            return ln[:400]
    return (lines[-1] if lines else "no output")[:400]


class Runs:
    """``mpidp train`` jobs through mpiexec, each run once and remembered by its settings."""

    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args, self.tmp = args, tmp
        self.env, self.dropped = bench_env()
        self.cache: dict[tuple, dict] = {}
        self.count, self.lock = 0, threading.Lock()
        self.attempts: dict[tuple, int] = {}

    def command(self, P: int, batch: int, seed: int, recipe_args: list[str], out: Path,
                dtype: str = "float32") -> list[str]:
        return [self.args.mpiexec, "-n", str(P), self.args.python, "-m", "mpidp", "train",
                "--dataset", "mnist1d", "--model", "cnn", "--epochs", str(self.args.epochs),
                "--batch-size", str(batch), "--seed", str(seed), "--dtype", dtype, *recipe_args,
                "--out", str(out), "-q"]

    def run(self, P: int, batch: int, seed: int, recipe_args: list[str], dtype: str = "float32",
            timed: bool = False) -> dict:
        """:meth:`once`; a timed job again (up to ``--retries``) while other processes used
        more than BUSY_WARN of the CPUs, keeping the least disturbed run."""
        if not timed:
            return self.once(P, batch, seed, recipe_args, dtype)
        return least_disturbed(lambda: self.once(P, batch, seed, recipe_args, dtype, timed=True),
                               self.args.retries, f"P={P} batch {batch} seed {seed}")

    def once(self, P: int, batch: int, seed: int, recipe_args: list[str], dtype: str = "float32",
             timed: bool = False) -> dict:
        """One job; its test accuracy (NaN when it failed or diverged), per-epoch history and
        how it ended. Untimed runs with the same settings are run once."""
        key = (P, batch, seed, tuple(recipe_args), dtype)
        if not timed and key in self.cache:
            return self.cache[key]
        with self.lock:
            self.count += 1
            out = self.tmp / f"run{self.count:04d}"
        cmd = self.command(P, batch, seed, recipe_args, out, dtype)
        busy = wait_quiet(self.args.wait_quiet) if timed else None
        print(f"$ {shown(cmd)}", flush=True)
        ticks0, own0, t0 = cpu_ticks(), children_cpu_s(), time.monotonic()
        proc = subprocess.Popen(cmd, env=self.env, cwd=REPO, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            text, _ = proc.communicate(timeout=self.args.timeout)
            status = "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            status = "timeout"
        job_s = time.monotonic() - t0
        rec = {"P": P, "batch": batch, "seed": seed, "dtype": dtype, "args": recipe_args,
               "command": shown(cmd), "status": status, "job_s": job_s, "test_accuracy": math.nan,
               "out": str(out)}
        if timed:
            self.attempts[key] = self.attempts.get(key, 0) + 1
            rec["attempt"] = self.attempts[key]
            rec["cpu_busy_before"] = busy
            rec["other_cpus_during"] = other_cpus(ticks0, own0, job_s)
        if status == "ok":
            m = json.loads((out / "metrics.json").read_text())
            rec.update(test_accuracy=float(m["test_accuracy"]), train_accuracy=m["train_accuracy"],
                       final_loss=m["final_loss"], wall_s=m["wall_s"], steps=m["steps"],
                       history=[{"epoch": h["epoch"], "test_accuracy": h.get("test_accuracy"),
                                 "seconds": h["seconds"], "lr": h.get("lr"), "loss": h["loss"]}
                                for h in m["history"]])
            if not math.isfinite(rec["test_accuracy"]):
                rec["status"] = "diverged"
        else:
            err = first_error(text or "")
            rec["error"] = err
            if "non-finite" in err or "nan" in err.lower():
                rec["status"] = "diverged"
            print(f"  -> {rec['status']}: {err}", flush=True)
        if not timed:
            self.cache[key] = rec
        return rec

    def many(self, jobs: list[tuple]) -> list[dict]:
        """Untimed P = 1 runs ``(batch, seed, recipe_args)``, ``--jobs`` at a time."""
        with ThreadPoolExecutor(max(1, self.args.jobs)) as pool:
            return list(pool.map(lambda j: self.run(1, *j), jobs))


def fill(recipe: str, lr: float, base: int) -> list[str]:
    return [a.format(lr=f"{lr:g}", base=base) for a in RECIPES[recipe]["args"]]


def brief(rec: dict) -> dict:
    """What the report keeps of a run (no temporary paths)."""
    return {k: v for k, v in rec.items() if k != "out"}


# --- 1. tuning and the sweep --------------------------------------------------------------

def tune(runs: Runs, base: int) -> dict:
    """Each grid's rates at the base batch with its recipe; the best median test accuracy wins."""
    out = {}
    for grid, recipe in TUNE_WITH.items():
        rates = runs.args.grids[grid]
        jobs = [(base, s, fill(recipe, lr, base)) for lr in rates for s in runs.args.tune_seeds]
        recs = runs.many(jobs)
        by_rate = {}
        for i, lr in enumerate(rates):
            rs = recs[i * len(runs.args.tune_seeds):(i + 1) * len(runs.args.tune_seeds)]
            by_rate[f"{lr:g}"] = {"median": median_nan([r["test_accuracy"] for r in rs]),
                                  "by_seed": {r["seed"]: r["test_accuracy"] for r in rs},
                                  "status": [r["status"] for r in rs]}
        finite = {k: v["median"] for k, v in by_rate.items() if math.isfinite(v["median"])}
        best = max(finite, key=finite.get) if finite else f"{min(rates):g}"
        out[grid] = {"recipe": recipe, "batch": base, "seeds": runs.args.tune_seeds,
                     "by_rate": by_rate, "best": float(best)}
    return out


def sweep(runs: Runs, tuned: dict, base: int) -> dict:
    jobs, where = [], []
    for recipe in runs.args.recipes:
        lr = tuned[RECIPES[recipe]["tuned"]]["best"]
        for batch in runs.args.batches:
            for seed in runs.args.seeds:
                jobs.append((batch, seed, fill(recipe, lr, base)))
                where.append((recipe, batch))
    recs = runs.many(jobs)
    out: dict = {}
    for (recipe, batch), rec in zip(where, recs):
        r = out.setdefault(recipe, {"label": RECIPES[recipe]["label"],
                                    "base_lr": tuned[RECIPES[recipe]["tuned"]]["best"],
                                    "args": fill(recipe, tuned[RECIPES[recipe]["tuned"]]["best"], base),
                                    "by_batch": {}})
        r["by_batch"].setdefault(str(batch), []).append(brief(rec))
    for r in out.values():
        for batch, rs in r["by_batch"].items():
            accs = [x["test_accuracy"] for x in rs]
            peak = [max((h["lr"] or 0.0) for h in x["history"]) for x in rs if x.get("history")]
            r["by_batch"][batch] = {"median": median_nan(accs), "min": min(accs), "max": max(accs),
                                    "by_seed": {x["seed"]: x["test_accuracy"] for x in rs},
                                    "status": {x["seed"]: x["status"] for x in rs},
                                    "errors": {x["seed"]: x["error"] for x in rs if x.get("error")},
                                    "peak_lr": peak[0] if peak else None,
                                    "steps": next((x["steps"] for x in rs if x.get("steps")), None),
                                    "runs": rs}
    return out


# --- 2. time to the target accuracy ---------------------------------------------------------

def time_to(history: list[dict] | None, target: float) -> tuple[float | None, int | None]:
    """Cumulative training seconds and epochs until the test accuracy first reaches ``target``."""
    total = 0.0
    for h in history or []:
        total += h["seconds"]
        if h["test_accuracy"] is not None and h["test_accuracy"] >= target:
            return total, h["epoch"]
    return None, None


def timing_configs(sw: dict, base: int, target: float) -> list[dict]:
    """The small-batch baseline and, per large-batch recipe, 8x the base batch and the
    largest swept batch whose median run reaches ``target`` (when that is larger)."""
    configs = [{"recipe": "constant", "batch": base}]
    for recipe in LARGE:
        if recipe not in sw:
            continue
        ok = [int(b) for b, v in sw[recipe]["by_batch"].items()
              if int(b) > base and math.isfinite(v["median"]) and v["median"] >= target]
        for batch in sorted({8 * base, *([max(ok)] if ok else [])}):
            configs.append({"recipe": recipe, "batch": batch})
    return configs


def timing(runs: Runs, sw: dict, tuned: dict, base: int, target: float) -> dict:
    configs = timing_configs(sw, base, target)
    for c in configs:
        c["args"] = fill(c["recipe"], tuned[RECIPES[c["recipe"]]["tuned"]]["best"], base)
        c["runs"] = {"1": [], "2": []}
    for seed in runs.args.seeds:  # in turns, so drifting load touches every row alike
        for c in configs:
            for P in (1, 2):
                rec = runs.run(P, c["batch"], seed, c["args"], timed=True)
                rec["time_to_target_s"], rec["epochs_to_target"] = time_to(rec.get("history"), target)
                rec["train_s"] = sum(h["seconds"] for h in rec.get("history") or []) or None
                if P == 1 and c["recipe"] in sw:  # deterministic: the sweep's run must match
                    swept = sw[c["recipe"]]["by_batch"].get(str(c["batch"]), {}).get("by_seed", {})
                    if seed in swept:
                        a, b = swept[seed], rec["test_accuracy"]
                        rec["same_accuracy_as_sweep"] = (a == b) or (math.isnan(a) and math.isnan(b))
                c["runs"][str(P)].append(brief(rec))
    for c in configs:
        c["summary"] = {}
        for P, rs in c["runs"].items():
            tts = [r["time_to_target_s"] for r in rs]
            reached = [t for t in tts if t is not None]
            c["summary"][P] = {
                "reached": f"{len(reached)}/{len(tts)}",
                # a run that never reaches the target counts as infinitely slow
                "time_to_target_median_s": median_nan([math.inf if t is None else t for t in tts]),
                "epochs_to_target_median": median_nan([math.inf if r["epochs_to_target"] is None
                                                       else r["epochs_to_target"] for r in rs]),
                "train_s_median": median_nan([r["train_s"] for r in rs if r["train_s"]] or [math.nan]),
                "test_accuracy_median": median_nan([r["test_accuracy"] for r in rs]),
                "other_cpus_median": median_nan([r["other_cpus_during"] or 0.0 for r in rs])}
    ref = configs[0]["summary"]["1"]["time_to_target_median_s"]
    for c in configs:
        for s in c["summary"].values():
            t = s["time_to_target_median_s"]
            ok = math.isfinite(t) and math.isfinite(ref) and t > 0
            s["speedup_vs_baseline_P1"] = ref / t if ok else None
    return {"target": target, "configs": configs}


# --- 3. exactness ---------------------------------------------------------------------------

def exactness(runs: Runs, tuned: dict, base: int, batch: int) -> dict:
    import numpy as np
    out = {}
    for recipe in LARGE:
        args = fill(recipe, tuned[RECIPES[recipe]["tuned"]]["best"], base)
        params, recs = {}, {}
        for P in (1, 2):
            rec = runs.run(P, batch, runs.args.seeds[0], args, dtype="float64")
            recs[P] = rec
            if rec["status"] == "ok":
                with np.load(Path(rec["out"]) / "model.npz") as z:
                    params[P] = z["params"].astype(np.float64)
        diff = float(np.max(np.abs(params[2] - params[1]))) if len(params) == 2 else math.nan
        out[recipe] = {"batch": batch, "seed": runs.args.seeds[0], "dtype": "float64", "args": args,
                       "n_params": len(params[1]) if 1 in params else None, "max_abs_diff": diff,
                       "test_accuracy": {P: r["test_accuracy"] for P, r in recs.items()},
                       "status": {P: r["status"] for P, r in recs.items()},
                       "commands": [r["command"] for r in recs.values()]}
    return out


# --- environment ----------------------------------------------------------------------------

PROBE = ("import json, platform, numpy, threadpoolctl, mpi4py; from mpi4py import MPI; "
         "print(json.dumps({'blas': threadpoolctl.threadpool_info(), 'numpy': numpy.__version__, "
         "'python': platform.python_version(), 'mpi4py': mpi4py.__version__, "
         "'mpi_library': ' '.join(MPI.Get_library_version().splitlines()[0].split())}))")


def probe(runs: Runs) -> dict:
    """BLAS (threadpoolctl) and versions as a rank sees them, in the ranks' environment."""
    cmd = [runs.args.mpiexec, "-n", "1", runs.args.python, "-c", PROBE]
    try:
        done = subprocess.run(cmd, env=runs.env, cwd=REPO, capture_output=True, text=True,
                              timeout=120, check=True)
        info = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        return {"blas": f"unknown ({exc})"}
    info["blas"] = [{k: b.get(k) for k in ("internal_api", "version", "architecture", "num_threads")}
                    for b in info["blas"]]
    return info


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.replot:
        report = json.loads(Path(args.replot).read_text())
        print(write_report(report, out_dir))
        return 0
    earlier = json.loads(Path(args.timing_from).read_text()) if args.timing_from else None
    if earlier is not None:  # the sweep's settings are the earlier run's
        args.batches, args.seeds, args.epochs = earlier["batches"], earlier["seeds"], earlier["epochs"]
    base = args.batches[0]
    t0, load_before, ticks0, own0 = time.monotonic(), loadavg(), cpu_ticks(), children_cpu_s()
    commit = git_commit()  # at the start: others may commit while it runs
    with tempfile.TemporaryDirectory(prefix="bench_batch_") as tmp_name:
        runs = Runs(args, Path(tmp_name))
        env = probe(runs)
        if earlier is None:
            tuned = tune(runs, base)
            sw = sweep(runs, tuned, base)
        else:
            tuned, sw = earlier["tuning"], earlier["sweep"]
            for r in sw.values():  # JSON turned the seeds into strings
                for v in r["by_batch"].values():
                    v["by_seed"] = {int(k): a for k, a in v["by_seed"].items()}
        tm = timing(runs, sw, tuned, base, args.target)
        ex = exactness(runs, tuned, base, args.exact_batch)
    wall = time.monotonic() - t0
    report = {"benchmark": "batch", "dataset": "mnist1d", "model": "cnn", "epochs": args.epochs,
              "base_batch": base, "batches": args.batches, "seeds": args.seeds, "gap": GAP,
              "max_param_diff": MAX_PARAM_DIFF,
              "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "wall_s": wall, "jobs_run": runs.count, "parallel_untimed_jobs": args.jobs,
              "timed_retries": args.retries, "wait_quiet_s": args.wait_quiet,
              "command": command("bench_batch", argv),
              "recipes": {k: {"label": v["label"], "args": v["args"], "tuned": v["tuned"]}
                          for k, v in RECIPES.items() if k in args.recipes},
              "machine": {"nproc": os.cpu_count(), "cpu_model": cpu_model(),
                          "platform": platform.platform(), "loadavg_before": load_before,
                          "loadavg_after": loadavg(),
                          "other_cpus_during_benchmark": other_cpus(ticks0, own0, wall),
                          "openblas_env_removed": runs.dropped, **env, "commit": commit,
                          "commit_at_end": git_commit()},
              "tuning": tuned, "sweep": sw, "timing": tm, "exactness": ex}
    if earlier is not None:
        report["sweep_from"] = {k: earlier.get(k) for k in ("date", "command", "wall_s", "jobs_run")}
        report["sweep_from"]["commit"] = earlier["machine"]["commit"]
        report["sweep_from"]["other_cpus_during_benchmark"] = \
            earlier["machine"].get("other_cpus_during_benchmark")
    print(write_report(report, out_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
