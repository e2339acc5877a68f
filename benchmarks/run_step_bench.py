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
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import (
    BUSY_WARN,
    Jobs,
    blas_text,
    command,
    machine,
    quick_defaults,
    shown,
    write,
)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
IMPLS = ("mpidp", "handwritten")
MAX_STEP_RATIO = 1.03  # target: mpidp's step time within 3% of the hand-written loop's


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", default="1,2", help="comma-separated world sizes to run")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each implementation")
    p.add_argument("--steps", type=int, default=60, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each run")
    p.add_argument("--on-nonfinite", default="stop", choices=("stop", "skip", "ignore"),
                   help="mpidp's NaN/Inf policy (ignore: no check, the hand-written loop's work)")
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per mpiexec job")
    p.add_argument("--retries", type=int, default=2,
                   help="reruns of a job during which other processes kept the CPUs busy")
    p.add_argument("--wait-quiet", type=float, default=30,
                   help="seconds to wait for the CPUs to go quiet before each job")
    p.add_argument("--mpiexec", default=str(REPO / ".venv" / "bin" / "mpiexec"))
    p.add_argument("--python", default=sys.executable, help="interpreter for the ranks")
    p.add_argument("--out-dir", default=str(HERE / "results"), help="where results are written")
    quick_defaults(p, repeats=1, steps=5, warmup=1, wait_quiet=0, retries=0)
    args = p.parse_args(argv)
    try:
        args.ranks = sorted({int(r) for r in args.ranks.split(",") if r.strip()})
    except ValueError:
        p.error(f"--ranks must be comma-separated integers like 1,2, got {args.ranks!r}")
    if args.retries < 0 or args.wait_quiet < 0:
        p.error("--retries and --wait-quiet must be >= 0")
    if not args.ranks or args.ranks[0] < 1:
        p.error("--ranks needs at least one world size >= 1")
    return args


def run_size(jobs: Jobs, args: argparse.Namespace, size: int, out: Path) -> tuple[dict, str]:
    """bench_step on ``size`` ranks (see :meth:`Jobs.timed`); its JSON and its command."""
    cmd = [args.mpiexec, "-n", str(size), args.python, "-m", "benchmarks.bench_step",
           "--out", str(out), "--repeats", str(args.repeats), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--on-nonfinite", args.on_nonfinite]
    return jobs.timed(cmd, out, f"P={size}"), shown(cmd)


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
        checks.append({"target": f"P={size}: mpidp step time within "
                       f"{round((MAX_STEP_RATIO - 1) * 100)}% of hand-written "
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


def _table(report: dict) -> list[str]:
    runs, eff = report["runs"], report["efficiency"]
    lines = [
        "| P | mpidp step (ms) | hand-written step (ms) | ratio mpidp/hand | comm share mpidp "
        "(ms/step) | comm share hand (ms/step) | samples/s mpidp | samples/s hand | "
        "efficiency mpidp | efficiency hand |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, run in sorted(runs.items()):
        mp, hw, e = run["mpidp"], run["handwritten"], eff[size]
        lines.append(
            f"| {size} | {mp['step_ms']:.2f} | {hw['step_ms']:.2f} | "
            f"{run['ratio_mpidp_over_handwritten']:.3f} | "
            f"{mp['comm_share']:.1%} ({mp['comm_share'] * mp['step_ms']:.2f}) | "
            f"{hw['comm_share']:.1%} ({hw['comm_share'] * hw['step_ms']:.2f}) | "
            f"{mp['samples_per_s']:.0f} | {hw['samples_per_s']:.0f} | "
            f"{_fmt(e['mpidp'], '.3f')} | {_fmt(e['handwritten'], '.3f')} |")
    diff = max(max(run["params_max_abs_diff"]) for run in runs.values())
    return lines + [
        "", "Efficiency at P = samples/s at P / (P x samples/s at P=1): each implementation "
        "against itself, so a slower step hides the same Allreduce better; compare the comm "
        "ms too. Comm share = time in the gradient Allreduce (waiting for the slower rank "
        "included) / time inside `step`, averaged over ranks.",
        f"Both implementations train the same steps from the same parameters on the same "
        f"batches; largest parameter difference between them at the end: {diff:.3g}."]


def _provenance(report: dict) -> list[str]:
    runs, m = report["runs"], report["machine"]
    removed = ", ".join(m["openblas_env_removed"]) or "none were set"
    lines = [f"- Machine: {m['nproc']} CPUs, {m['cpu_model']}, {m['platform']}",
             f"- BLAS: {blas_text(m['blas'])}",
             f"- OpenBLAS variables removed for the runs: {removed}",
             f"- MPI: {m['mpi_library']} (mpi4py {m['mpi4py']}); numpy {m['numpy']}; "
             f"Python {m['python']}",
             f"- mpidp {m['mpidp']} at commit {m['commit']}; date: {report['date']}",
             f"- Command: `{report['command']}`"]
    return lines + [f"- P={size}: `{cmd}` (CPUs {_fmt(runs[size]['cpu_busy_before'], '.0%')} "
                    f"busy just before; other processes used {_fmt(runs[size]['other_cpus_during'], '.2f')} "
                    "CPUs during it)" for size, cmd in sorted(report["commands"].items())]


def markdown(report: dict) -> str:
    """The report as Markdown: results table, targets with verdicts, machine and commands."""
    lines = [
        "# Step time: mpidp vs a hand-written mpi4py + NumPy loop", "",
        "Standard workload (docs/benchmarks.md): MLP 784-1024-1024-10 ReLU, softmax cross-entropy, SGD "
        "lr 0.05, float32; synthetic 60,000 x 784, 10 classes; global batch 512 split over P "
        f"ranks; {report['warmup']} warm-up + {report['steps']} timed steps between barriers "
        f"(slowest rank); median of {report['repeats']} alternating repeats.", "",
        *_table(report), "", "## Targets", "",
        *(f"- {'PASS' if c['pass'] else 'FAIL'}: {c['target']} (measured {c['value']})"
          for c in report["targets"]),
        *(f"- WARNING: other processes used {run['other_cpus_during']:.2f} CPUs during the P={size} "
          "job: its timings are suspect" for size, run in sorted(report["runs"].items())
          if (run["other_cpus_during"] or 0.0) > BUSY_WARN * report["machine"]["nproc"]),
        "", "## Where and how", "", *_provenance(report)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = Jobs(args)
    runs, commands = {}, {}
    with tempfile.TemporaryDirectory(prefix="step_bench_") as tmp:
        for size in args.ranks:
            try:
                runs[size], commands[size] = run_size(jobs, args, size, Path(tmp) / f"p{size}.json")
            except (RuntimeError, OSError, ValueError) as exc:  # no result: that is an error
                print(f"run_step_bench: {exc}", file=sys.stderr)
                return 1
    eff = efficiencies(runs)
    report = {
        "benchmark": "step", "repeats": args.repeats, "steps": args.steps, "warmup": args.warmup,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": command("run_step_bench", argv),
        "commands": commands, "machine": machine(runs[args.ranks[0]]["environment"], jobs.dropped),
        "efficiency": eff, "targets": check_targets(runs, eff), "runs": runs,
    }
    text = markdown(report)
    write(out_dir / "step_bench", report, text)
    print(text)
    print(f"wrote {out_dir / 'step_bench.json'} and {out_dir / 'step_bench.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
