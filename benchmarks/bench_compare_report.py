"""Cells, cost-model predictions, verdicts, Markdown and plot for ``bench_compare.py``."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

from benchmarks.harness import command, git_commit, loadavg

HERE = Path(__file__).resolve().parent

MIB = 2**20
HIDDEN = (1024, 1024)  # the workload: MLP 784-1024-1024-10, SGD with momentum
N_IN, N_OUT, LR, MOMENTUM = 784, 10, 0.05, 0.9
LABEL = {"dp": "data parallel (allreduce)", "ps": "sync parameter server (dedicated)",
         "async": "async parameter server", "pipeline": "pipeline (1F1B)",
         "hybrid": "hybrid (2 stages x P/2, 1F1B)"}
TRAVELS = {"dp": "gradients, every rank with every rank (reduce-scatter + allgather ring)",
           "ps": "gradients to the server (Reduce_scatter + Gatherv), parameters back (Bcast)",
           "async": "each worker's gradients to the server, the server's parameters back",
           "pipeline": "activations to the next stage, their gradients to the previous one",
           "hybrid": "activations/gradients between the 2 stages + each stage's gradients "
                     "among its P/2 replicas (Allreduce)"}
WAITS_FOR = {"dp": "the slowest rank's gradients (inside the Allreduce)",
             "ps": "workers: the slowest worker + the server's update; server: the gradients",
             "async": "workers: the server to answer their push (it serves one push at a time)",
             "pipeline": "the previous stage's activations / the next stage's gradients (bubble)",
             "hybrid": "neighbour stage (bubble) + the replicas' Allreduce"}


def wire_bytes(kind: str, m: float, P: int, root: bool) -> tuple[float, float]:
    """Bytes one rank sends and receives for one call moving ``m`` payload bytes over ``P``
    ranks, by the algorithm MPICH uses for large messages: Allreduce as reduce-scatter +
    allgather (ring), Bcast as scatter + allgather, Reduce to root (mpidp's reduce_sum_to_)
    as Reduce_scatter + Gatherv. Point to point: exactly ``m``."""
    f = (P - 1) / P
    if kind == "allreduce":
        return 2 * f * m, 2 * f * m
    if kind == "reduce":
        return f * m + (0 if root else m / P), f * m + (f * m if root else 0)
    if kind == "bcast":
        return (2 * f * m, f * m) if root else (f * m, m)
    return (m, 0.0) if kind == "send" else (0.0, m)


def environment(a, seconds: float) -> dict:
    """Machine, software, BLAS kernel, commit and command of this run."""
    from threadpoolctl import threadpool_info

    def version(mpiexec: str) -> str:
        try:
            out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True).stdout
        except OSError:
            return "not found"
        return " ".join(out.split()[:6]).split(" Report bugs")[0]  # Open MPI's 2nd line
    return {"python": platform.python_version(), "numpy": np.__version__,
            "cpus": os.cpu_count(), "machine": platform.machine(),
            "processor": platform.processor() or platform.machine(),
            "mpiexec": version(a.mpiexec), "elastic_mpiexec": version(a.elastic_mpiexec),
            "load": loadavg(),
            "blas": [{k: d.get(k) for k in ("internal_api", "version", "architecture")}
                     for d in threadpool_info() if d.get("user_api") == "blas"],
            "command": command("bench_compare"), "commit": git_commit(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "seconds": seconds,
            "settings": {k: _in_repo(v) for k, v in vars(a).items()
                         if k not in ("task", "column", "json", "step_dir", "rest", "split",
                                      "elastic_only")}}


def _in_repo(value):
    """A path inside the repository as the relative path a reader types (others as they are)."""
    root = str(Path(__file__).resolve().parents[1]) + os.sep
    return value[len(root):] if isinstance(value, str) and value.startswith(root) else value


# --- one measured figure (or a few) per row, column and P -------------------------------

def _busy(r: dict) -> float:
    return r["compute_cpu_s"] + r["update_s"]


def cpu_step(column: str, ranks: list[dict]) -> float:
    """Seconds per step if every rank had its own core: compute and update CPU time of the
    busiest rank plus the communication no rank avoids (the least-waiting rank's); for
    pipelines the replayed makespan of the measured ops' CPU times plus the update; for the
    asynchronous server, the slower of a worker's push cycle and the server's updates."""
    if column in ("pipeline", "hybrid"):
        return ranks[0]["makespan_s"] + max(r["update_s"] for r in ranks)
    if column == "async":
        server, workers = ranks[0], ranks[1:]
        per_push = server["compute_cpu_s"] / len(workers)
        return max(max(_busy(w) for w in workers) + per_push, server["compute_cpu_s"])
    return max(_busy(r) for r in ranks) + min(r["comm_s"] for r in ranks)


def waits(column: str, ranks: list[dict]) -> list[float]:
    """Seconds per step each rank waits for others: time blocked in communication beyond
    the least-blocked rank's (collectives); all blocked time (point to point)."""
    if column in ("dp", "ps"):
        low = min(r["comm_s"] for r in ranks)
        return [r["comm_s"] - low for r in ranks]
    return [r["comm_s"] for r in ranks]


def speed_cells(run: dict, baseline: dict, balanced: dict, batch: int) -> dict:
    c, r = run["column"], run["ranks"]
    step_cpu, base_cpu = cpu_step(c, r), _busy(baseline)
    return {
        "param_mib": max(x["param_bytes"] for x in r) / MIB,
        "grad_mib": max(x["grad_bytes"] for x in r) / MIB,
        "opt_mib": max(x["opt_bytes"] for x in r) / MIB,
        "act_mib": max(x["act_bytes"] for x in r) / MIB,
        "held_total_mib": sum(x["param_bytes"] + x["grad_bytes"] + x["opt_bytes"]
                              + x["act_bytes"] for x in r) / MIB,
        "samples_per_rank": [int(x["samples"]) for x in r],
        "sent_mib": max(x["sent"] for x in r) / MIB, "recv_mib": max(x["recv"] for x in r) / MIB,
        "comm_ms": float(np.mean([x["comm_s"] for x in r])) * 1e3,
        "samples_s": batch / max(x["step_s"] for x in r),
        "speedup_wall": baseline["step_s"] / max(x["step_s"] for x in r),
        "speedup_cpu": base_cpu / step_cpu,
        "idle_cpu": float(np.mean([max(1 - _busy(x) / step_cpu, 0.0) for x in r])),
        "busiest_link_mib": max(x["sent"] + x["recv"] for x in r) / MIB,
        "wait_ms": max(waits(c, r)) * 1e3,
        "balance_default": _ratio(r), "balance_balanced": _ratio(balanced["ranks"]),
    }


def _ratio(ranks: list[dict]) -> float:
    busy = [_busy(x) for x in ranks]
    return max(busy) / float(np.mean(busy))


def time_to_target(column: str, trace: list, target: float, window: int) -> dict:
    """First time and samples at which the loss over the last ``window`` samples is at most
    ``target`` (pushes of the asynchronous server are in arrival order)."""
    t = np.array([row[0] for row in trace])
    loss, count = np.array([row[1] for row in trace]), np.array([row[2] for row in trace])
    seen = np.cumsum(count)
    out = {"time_to_target_s": math.nan, "samples_to_target": math.nan,
           "final_loss": float(loss[-8:].sum() / count[-8:].sum())}
    for i in range(len(t)):
        j = np.searchsorted(seen, seen[i] - window, side="right")
        if seen[i] >= window and loss[j:i + 1].sum() / count[j:i + 1].sum() <= target:
            out.update(time_to_target_s=float(t[i]), samples_to_target=int(seen[i]))
            break
    if column == "async":
        stale = np.array([row[3] for row in trace])
        out.update(staleness_mean=float(stale.mean()), staleness_max=int(stale.max()))
    return out


def cells(res: dict, a) -> dict:
    """``{P: {column: {figure: value}}}`` from the raw results."""
    out: dict = {}
    base = res["baseline"][0]
    by = {(s["P"], s["column"], s["split"]): s for s in res["speed"]}
    for (P, c, split), run in by.items():
        if split == "default":
            out.setdefault(P, {})[c] = speed_cells(run, base, by[(P, c, "balanced")], a.batch)
    for conv in res["conv"]:
        out[conv["P"]][conv["column"]].update(time_to_target(
            conv["column"], conv["trace"], a.target, 4 * a.batch))
    for f in res["fault"]:
        out[f["P"]][f["column"]].update(
            kill_to_end_s=f["seconds_kill_to_end"], steps_lost=f["steps_lost"],
            resumed_param_diff=f["max_param_diff"], recovery_overhead_s=f["recovery_overhead_s"],
            continues=(f"resumes on {f['survivors']} as {f['resumed_as']} from "
                       f"{f.get('resumed_from', 'step {}'.format(f['last_checkpoint_step']))}"
                       if f["checkpoints"] else
                       f"no checkpoint: restart from step 0 on {f['survivors']} as "
                       f"{f['resumed_as']}"))
    return out


# --- the cost model's view of P = 64 and 1024 -------------------------------------------

def predictions(res: dict, a, Ps=(64, 1024)) -> dict:
    """Per column: bytes of the busiest link per step (the wire formulas of the measurement),
    speedup (cost model fitted on this machine, ``benchmarks/results/model/model.json``;
    pipelines: P m/(m+P-1) with equal stages) and mean async staleness (workers - 1)."""

    from mpidp.scale import costmodel as M
    base = res["baseline"][0]
    m = base["grad_bytes"]
    act = max(x["sent"] for s in res["speed"] if s["column"] == "pipeline"
              and s["split"] == "default" and s["P"] == max(s2["P"] for s2 in res["speed"])
              for x in s["ranks"])
    cal = json.loads((HERE / "results" / "model" / "model.json").read_text())
    fit, comp = M.Fit(**cal["fit"]), M.Compute(**cal["compute"])
    out: dict = {}
    for P in Ps:
        ring = 2 * sum(wire_bytes("allreduce", m, P, False))
        root = sum(wire_bytes("reduce", m, P, True)) + sum(wire_bytes("bcast", m, P, True))
        half = P // 2
        speed = {alg: float(P * M.efficiency(P, m, a.batch, comp, fit, alg))
                 for alg in ("ring", "reduce-broadcast")}
        t1 = float(M.step_time(1, m, a.batch, comp, fit))
        serve = (P - 1) * (base["update_s"] + 2 * m * fit.beta)  # one global batch of pushes
        out[P] = {
            "dp": {"busiest_link_mib": ring / 2 / MIB, "speedup": speed["ring"],
                   "wait_ms": 1e3 * t1 / P * comp.jitter * math.sqrt(2 * math.log(P))},
            "ps": {"busiest_link_mib": root / MIB, "speedup": speed["reduce-broadcast"]},
            "async": {"busiest_link_mib": 2 * (P - 1) * m / MIB,
                      "speedup": t1 / max(t1 / (P - 1), serve),
                      "staleness_mean": P - 2},
            "pipeline": {"busiest_link_mib": 2 * act / MIB,
                         "speedup": P * a.micro / (a.micro + P - 1),
                         "idle": (P - 1) / (a.micro + P - 1)},
            "hybrid": {"busiest_link_mib": (2 * act / half
                                            + sum(wire_bytes("allreduce", m / 2, half, False))) / MIB,
                       "speedup": 2 * a.micro / (a.micro + 1) * float(
                           half * M.efficiency(half, m / 2, a.batch // 2, comp, fit, "ring"))},
        }
    return out


# --- verdicts ---------------------------------------------------------------------------

def elastic_holds(e: dict) -> bool:
    """Row 3 holds when elastic data parallelism went on without losing an update, ended
    with the uninterrupted model, sooner than a requeue, while a pipeline was refused."""
    return ("skipped" not in e and e["updates_lost"] == 0 and e["max_param_diff"] < 1e-9
            and e["kill_to_next_step_s"] < e["requeue"]["kill_to_next_step_s"]
            and e["pipeline_refused"]["rc"] == 2)


def elastic_measured(e: dict) -> str:
    if "skipped" in e:
        return f"Elastic column {e['skipped']}"
    q = e["requeue"]
    return (f"Elastic data parallelism (P={e['P']}, rank {e['killed_rank']} SIGKILLed after "
            f"step {e['steps_done_at_kill']}): the {e['survivors']} survivors finished their "
            f"next step {e['kill_to_next_step_s']:.2f} s after the kill, {e['updates_lost']} "
            f"updates lost, {e['steps_recomputed']} recomputed, {e['samples_s_before']:.0f} -> "
            f"{e['samples_s_after']:.0f} samples/s, final model = uninterrupted (max |dparam| "
            f"{e['max_param_diff']:.1e}); checkpoint and requeue: next step "
            f"{q['kill_to_next_step_s']:.2f} s after the kill (job end "
            f"{q['kill_to_job_end_s']:.2f} s, restart to first step "
            f"{q['restart_to_first_step_s']:.2f} s, no queue wait), {q['updates_lost']} updates "
            f"redone; pipeline with --elastic: refused (exit {e['pipeline_refused']['rc']})")


def verdicts(c: dict, pred: dict, a, elastic: list[dict] = ()) -> list[dict]:
    """For each row: the textbook claim, what this run measured, whether it holds here,
    and when it flips. ``c`` is :func:`cells`; judged at the largest P, by CPU time; row 3
    by the largest P of the elastic column (``elastic``)."""
    P = max(c)
    x, q = c[P], pred[max(pred)]
    dp, ps, asy, pipe, hyb = (x[k] for k in ("dp", "ps", "async", "pipeline", "hybrid"))
    cross = a.batch * dp["busiest_link_mib"] / pipe["busiest_link_mib"]
    fault_same = all(v["resumed_param_diff"] < 1e-9 for k, v in x.items() if k != "async")
    e = max(elastic, key=lambda r: r["P"]) if elastic else {"skipped": "not run"}
    rows = [
        ("1. Task split", "Data parallelism splits the data (every rank holds the whole model); "
         "model parallelism splits the model.",
         f"P={P}: params per rank dp {dp['param_mib']:.2f} MiB, pipeline max "
         f"{pipe['param_mib']:.2f} MiB; samples/step per rank dp {dp['samples_per_rank']}, "
         f"pipeline {pipe['samples_per_rank']} (every stage handles the whole batch)",
         pipe["param_mib"] < dp["param_mib"],
         "Holds by construction; the split is uneven when layers differ in size (the biggest "
         "layer bounds a stage)."),
        ("2. Communication cost", "Data parallelism has the larger communication overhead.",
         f"P={P}: sent+received per step per rank dp {dp['sent_mib'] + dp['recv_mib']:.1f} MiB, "
         f"pipeline {pipe['sent_mib'] + pipe['recv_mib']:.1f} MiB; comm time dp "
         f"{dp['comm_ms']:.1f} ms, pipeline {pipe['comm_ms']:.1f} ms (pipeline time is waiting)",
         dp["sent_mib"] > pipe["sent_mib"],
         f"Gradients scale with the model, activations with batch x width: at this model the "
         f"pipeline moves more than data parallelism from a global batch of ~{cross:.0f} "
         f"samples (or a model {a.batch / cross:.2g}x thinner)."),
        ("3. Fault tolerance", "Data parallelism tolerates node failure better.",
         f"P={P}: without --elastic one SIGKILLed rank ends every job (dp "
         f"{dp['kill_to_end_s']:.2f} s, pipeline {pipe['kill_to_end_s']:.2f} s after the "
         f"kill); steps lost dp {dp['steps_lost']}, pipeline {pipe['steps_lost']}, async "
         f"{asy['steps_lost']}; resumed = uninterrupted (max |dparam| < 1e-9) for all "
         f"synchronous columns: {fault_same}. {elastic_measured(e)}",
         elastic_holds(e),
         "It holds where the survivors can keep running (Open MPI's ULFM: every data-parallel "
         "replica has the whole state, a lost pipeline stage is lost, so --elastic refuses "
         "pipelines) and where the model does not fit on P-1 ranks; under an MPI that ends "
         "the whole job (MPICH) both resume from the last checkpoint, equally exactly."),
        ("4. Degree of parallelism", "Model parallelism has the lower parallelism.",
         f"P={P} (CPU time): speedup dp {dp['speedup_cpu']:.2f}, pipeline "
         f"{pipe['speedup_cpu']:.2f}, hybrid {hyb['speedup_cpu']:.2f}; idle share dp "
         f"{dp['idle_cpu']:.2f}, pipeline {pipe['idle_cpu']:.2f}. Cost model at P={max(pred)}: "
         f"dp {q['dp']['speedup']:.1f}, pipeline {q['pipeline']['speedup']:.1f}",
         pipe["speedup_cpu"] < dp["speedup_cpu"],
         "The bubble (P-1)/(m+P-1) and stages no finer than a layer cap the pipeline; it "
         "flips when gradients cost more to exchange than the bubble costs (large models, "
         "slow links) or m >> P."),
        ("5. Transfer", "Model parallelism moves less data; a central server carries P-fold.",
         f"P={P}: busiest link per step dp {dp['busiest_link_mib']:.1f} MiB, sync ps "
         f"{ps['busiest_link_mib']:.1f}, async server {asy['busiest_link_mib']:.1f}, pipeline "
         f"{pipe['busiest_link_mib']:.1f}, hybrid {hyb['busiest_link_mib']:.1f}. At "
         f"P={max(pred)}: dp {q['dp']['busiest_link_mib']:.0f}, async "
         f"{q['async']['busiest_link_mib']:.0f}, pipeline {q['pipeline']['busiest_link_mib']:.0f}",
         pipe["busiest_link_mib"] < dp["busiest_link_mib"]
         and asy["busiest_link_mib"] > dp["busiest_link_mib"],
         "The central (async) server's link grows with P-1 workers; mpidp's synchronous server "
         "reduces and broadcasts (no P-fold link); a pipeline link carries activations, "
         "constant in P."),
        ("6. Dependence between ranks", "Model-parallel ranks depend on each other more.",
         f"P={P}: wait per step (worst rank) dp {dp['wait_ms']:.1f} ms, ps {ps['wait_ms']:.1f}, "
         f"async {asy['wait_ms']:.1f}, pipeline {pipe['wait_ms']:.1f}, hybrid "
         f"{hyb['wait_ms']:.1f} ms",
         pipe["wait_ms"] > dp["wait_ms"],
         "Each stage waits for its neighbour every micro-batch; data parallelism waits once "
         "per step, for the slowest rank; the async server removes the wait between workers "
         "at the price of staleness."),
        ("7. Load balance", "Model parallelism balances load worse.",
         f"P={P}: compute max/mean default / balanced: dp {dp['balance_default']:.2f} / "
         f"{dp['balance_balanced']:.2f}, pipeline {pipe['balance_default']:.2f} / "
         f"{pipe['balance_balanced']:.2f}, ps {ps['balance_default']:.2f} (the server only "
         f"updates)", pipe["balance_default"] > dp["balance_default"],
         "Stages are whole layers: 3 layers of unequal cost cannot be split evenly into 4 "
         "stages; with many equal layers per stage they balance as well as samples do."),
        ("8. Convergence", "Model parallelism converges faster: more frequent updates.",
         f"P={P}: time to loss {a.target}: dp {dp['time_to_target_s']:.1f} s, pipeline "
         f"{pipe['time_to_target_s']:.1f} s, async {_fmt(asy['time_to_target_s'], '.1f')} "
         f"(final loss {asy['final_loss']:.3f}) "
         f"(staleness mean {asy['staleness_mean']:.2f}, max {asy['staleness_max']}); samples "
         f"to target dp {dp['samples_to_target']}, pipeline {pipe['samples_to_target']}",
         pipe["time_to_target_s"] < dp["time_to_target_s"],
         "Per sample the synchronous columns take identical updates (one per global batch), "
         "so only throughput differs; only the async server updates more often, and its "
         f"staleness grows with the workers (~{q['async']['staleness_mean']} at "
         f"P={max(pred)}, beyond max-staleness {a.max_staleness}: pushes dropped)."),
    ]
    return [{"row": r, "claim": cl, "measured": m, "holds": bool(h), "flips_when": f}
            for r, cl, m, h, f in rows]


# --- Markdown, JSON, plot ---------------------------------------------------------------

FIGURES = [  # (row, key, label, format)
    ("1", "param_mib", "params MiB/rank (max)", ".2f"), ("1", "grad_mib", "grads MiB/rank", ".2f"),
    ("1", "opt_mib", "optimizer state MiB/rank", ".2f"), ("1", "act_mib", "activations MiB/rank", ".2f"),
    ("1", "samples_per_rank", "samples/step per rank", ""),
    ("2", "sent_mib", "sent MiB/step/rank (max)", ".2f"), ("2", "recv_mib", "received MiB/step/rank", ".2f"),
    ("2", "comm_ms", "comm ms/step (mean rank)", ".1f"),
    ("3", "kill_to_end_s", "kill -> job ended, s", ".2f"), ("3", "steps_lost", "steps lost", "d"),
    ("3", "continues", "continues", ""),
    ("3", "resumed_param_diff", "max abs(dparam) vs uninterrupted", ".1e"),
    ("3", "recovery_overhead_s", "extra wall s (kill+resume)", ".1f"),
    ("4", "samples_s", "samples/s (wall)", ".0f"), ("4", "speedup_wall", "speedup vs 1 proc (wall)", ".2f"),
    ("4", "speedup_cpu", "speedup vs 1 proc (CPU time)", ".2f"), ("4", "idle_cpu", "idle share (CPU)", ".2f"),
    ("5", "busiest_link_mib", "busiest link MiB/step", ".1f"),
    ("6", "wait_ms", "wait for others ms/step (worst)", ".1f"),
    ("7", "balance_default", "compute max/mean, default", ".2f"),
    ("7", "balance_balanced", "compute max/mean, balanced", ".2f"),
    ("8", "time_to_target_s", "time to target s", ".1f"),
    ("8", "samples_to_target", "samples to target", ".0f"),
    ("8", "final_loss", "loss at the end of the run", ".3f"),
    ("8", "staleness_mean", "staleness mean (async)", ".2f"),
]
COLS = ("dp", "ps", "async", "pipeline", "hybrid")


def _fmt(v, spec: str) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float) and math.isnan(v):  # measured: the target was not reached
        return "not reached"
    return str(v) if not spec else format(v, spec)


def table(c: dict, P: int) -> list[str]:
    head = "| row | figure | " + " | ".join(LABEL[k] for k in COLS) + " |"
    lines = [head, "|---|---|" + "---|" * len(COLS)]
    for row, key, label, spec in FIGURES:
        vals = [_fmt(c[P][k].get(key), spec) for k in COLS]
        lines.append(f"| {row} | {label} | " + " | ".join(vals) + " |")
    return lines


ELASTIC_FIGURES = [  # (label, elastic key, requeue key, format)
    ("kill -> next completed step, s", "kill_to_next_step_s", "kill_to_next_step_s", ".2f"),
    ("updates lost (done again)", "updates_lost", "updates_lost", "d"),
    ("steps recomputed (in flight)", "steps_recomputed", None, "d"),
    ("survivors regroup (after noticing), s", "seconds_to_recover", None, ".2f"),
    ("job ended after the kill, s", None, "kill_to_job_end_s", ".2f"),
    ("checkpoint write, s (mean)", None, "checkpoint_write_s", ".3f"),
    ("restart + resume to first step, s", None, "restart_to_first_step_s", ".2f"),
    ("samples/s before the loss", "samples_s_before", "samples_s_before", ".0f"),
    ("samples/s after the loss", "samples_s_after", "samples_s_after", ".0f"),
    ("max abs(dparam) vs uninterrupted", "max_param_diff", "max_param_diff", ".1e"),
]


def elastic_table(elastic: list[dict]) -> list[str]:
    """Row 3's fault column: elastic data parallelism vs checkpoint and requeue, per P."""
    lines = []
    for e in elastic:
        lines += [f"## Row 3, a lost rank: elastic data parallelism vs checkpoint and requeue, "
                  f"P = {e['P']}", ""]
        if "skipped" in e:
            lines += [e["skipped"], ""]
            continue
        q = e["requeue"]
        lines += [f"{e['P']} ranks, rank {e['killed_rank']} SIGKILLed from outside after "
                  f"step {e['steps_done_at_kill']} of {e['steps_total']}; the elastic job went "
                  f"on from step {e['went_on_from_step']} on {e['survivors']} ranks (exit "
                  f"{e['rc']}); the requeued one resumed from its checkpoint of step "
                  f"{q['last_checkpoint_step']} on {e['survivors']} ranks (the wait in a "
                  f"scheduler's queue is not included). `--elastic --parallel pipeline`: "
                  f"exit {e['pipeline_refused']['rc']}, \"{e['pipeline_refused']['line']}\"", "",
                  "| figure | data parallel, --elastic | data parallel, checkpoint + requeue |",
                  "|---|---|---|"]
        for label, ek, qk, spec in ELASTIC_FIGURES:
            lines.append(f"| {label} | {_fmt(e.get(ek), spec)} | {_fmt(q.get(qk), spec)} |")
        lines.append("")
    return lines


def prediction_table(pred: dict) -> list[str]:
    lines = ["| P | figure | " + " | ".join(LABEL[k] for k in COLS) + " |",
             "|---|---|" + "---|" * len(COLS)]
    for P, by in pred.items():
        for key, label in (("busiest_link_mib", "busiest link MiB/step (4)"),
                           ("speedup", "speedup (5)"), ("wait_ms", "wait ms/step (6)"),
                           ("idle", "idle share (4)"), ("staleness_mean", "staleness (8)")):
            if any(key in by[k] for k in COLS):
                lines.append(f"| {P} | {label} | " + " | ".join(
                    _fmt(by[k].get(key), ".2f") for k in COLS) + " |")
    return lines


def plot(path: Path, res: dict, c: dict, a) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.5))
    for conv in res["conv"]:
        tr = np.array([row[:3] for row in conv["trace"]], np.float64)
        k = max(1, round(4 * a.batch / np.median(tr[:, 2])))
        smooth = np.convolve(tr[:, 1], np.ones(k), "valid") / np.convolve(tr[:, 2], np.ones(k), "valid")
        style = "-" if conv["P"] == max(c) else ":"
        lbl = f"P={conv['P']} {conv['column']}"
        axes[0].plot(tr[k - 1:, 0], smooth, style, label=lbl)
        axes[1].plot(np.cumsum(tr[:, 2])[k - 1:], smooth, style, label=lbl)
    for ax, xl in ((axes[0], "wall seconds"), (axes[1], "samples seen")):
        ax.axhline(a.target, color="k", lw=0.8, ls="--")
        ax.set(xlabel=xl, ylabel=f"training loss (last {4 * a.batch} samples)",
               title="8. convergence (target dashed)")
        ax.legend(fontsize=6)
    x = np.arange(len(COLS))
    for i, P in enumerate(sorted(c)):
        axes[2].bar(x + 0.4 * i, [c[P][k]["busiest_link_mib"] for k in COLS], 0.4, label=f"P={P}")
        axes[3].bar(x + 0.4 * i, [c[P][k]["speedup_cpu"] for k in COLS], 0.4, label=f"P={P}")
    for ax, t in ((axes[2], "5. busiest link MiB/step"), (axes[3], "4. speedup (CPU time)")):
        ax.set_xticks(x + 0.2, COLS)
        ax.set(title=t)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_reports(a, res: dict) -> None:
    c = cells(res, a)
    pred = predictions(res, a)
    res["cells"] = {str(P): v for P, v in c.items()}
    res["predictions"] = {str(P): v for P, v in pred.items()}
    res["verdicts"] = verdicts(c, pred, a, res.get("elastic", []))
    env = res["env"]
    md = ["# Data parallel vs parameter servers vs model parallel: eight properties", "",
          f"Command: `{env['command']}` ({env['seconds']:.0f} s). Commit {env['commit']}, "
          f"{env['date']}. Machine: {env['cpus']} CPUs ({env['processor']}), python "
          f"{env['python']}, numpy {env['numpy']}, {env['mpiexec']}, BLAS {env['blas']}; one "
          "BLAS thread per rank. P = 4 runs 4 ranks on 2 cores: its wall-clock figures include "
          "waiting for a core, so P = 4 is judged by CPU time (speedup, idle share).", "",
          f"Settings: {json.dumps(env['settings'])}", ""]
    if "elastic_env" in res:  # row 3's elastic column measured in a run of its own
        e = res["elastic_env"]
        md += [f"Row 3's elastic column: `{e['command']}` ({e['seconds']:.0f} s). Commit "
               f"{e['commit']}, {e['date']}, {e['elastic_mpiexec']}, load average "
               f"{e['load']} as it ended; the other figures come from the run above.", ""]
    for P in sorted(c):
        md += [f"## P = {P}", "", *table(c, P), ""]
    md += elastic_table(res.get("elastic", []))
    md += ["## Cost-model predictions (not measured)", "", *prediction_table(pred), "",
           "## Verdicts", ""]
    for v in res["verdicts"]:
        md += [f"**{v['row']}.** Claim: {v['claim']} Measured: {v['measured']}. "
               f"Holds here: **{'yes' if v['holds'] else 'no'}**. {v['flips_when']}", ""]
    out = Path(a.out)
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=float))
    plot(out.with_suffix(".png"), res, c, a)
    print("\n".join(md))
