"""``make bench-network``: data parallelism over a slow link between two test hosts.

Two test hosts made from network namespaces (benchmarks/cluster.py), each link limited
to a rate (``--rates``, Gbit/s; a token bucket on both directions). On each rate, one rank
per host runs the hand-written loop and mpidp's ``allreduce``, ``overlapped``,
``compressed`` and ``auto`` on the standard workload (global batch 512), ``--repeats``
times in a seeded shuffled order; then 2 hosts x 2 ranks run fused allreduce with
node-aware reduction off and on. Each figure: steps/s (median of the repeats and their
spread), its ratio to the loop's in the same repeat, the link-bound limit (rate / bytes
each host must send per step), the share of it reached, and the bytes that crossed the
host link per timed step, read from the bridge-side veth counters around exactly the
timed steps (``bench_sync.py --marks``); and the cost
model's prediction (:func:`mpidp.scale.costmodel.mode_step_time`) with its error, from
inputs measured in the same run: the link's alpha and beta (an MPI ping-pong between the
hosts), compute (``compute-only`` beside the modes: ranks that exchange nothing but wait for
each other once a step), node-aware reduction's own share at 2 x 2 on the hosts, and,
measured here once, gamma, the backward pass's share and the first bucket's, and the
codec's seconds. Needs root; writes benchmarks/results/network.{json,md}.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from benchmarks.harness import bench_env, command, cpu_model, git_commit, quick_defaults, write
from benchmarks.sync_modes import EXTRA_MODES, MODES

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
from benchmarks.cluster import Cluster, LinkBytes, limits_available, tbf_args  # noqa: E402
from mpidp.scale.costmodel import Fit, fit_alpha_beta, mode_step_time  # noqa: E402 (no MPI)

PAIR_MODES = ("handwritten", "allreduce", "overlapped", "overlapped-forward", "compressed",
              "compressed-numpy", "compressed-int8", "auto")
NODE_MODES = ("allreduce-flat", "allreduce-node")  # 2 hosts x 2 ranks
# codes Allgathered: each rank sends (P-1) x its codes
GATHER = ("compressed", "compressed-numpy", "compressed-int8")
COMPUTE = "compute-only"  # run beside the modes in every job: the model's compute input
LOOP = "handwritten"  # the reference every mode is compared with, repeat by repeat
#: bench_sync.py's mode (or the strategy auto chose) -> the cost model's mode
MODEL_MODES = {"handwritten": "allreduce", "allreduce": "allreduce", "allreduce-flat": "allreduce",
               "overlapped": "overlapped", "overlapped-forward": "overlapped-forward",
               "compressed": "compressed", "compressed-numpy": "compressed",
               "compressed-int8": "compressed", "allreduce-node": "node-aware"}
#: the share of float32's bytes that a compressed mode's codes take
WIRE_SHARE = {"compressed": 0.5, "compressed-numpy": 0.5, "compressed-int8": (1 + 4 / 256) / 4}
#: a compressed mode -> the key of its codec's share of compute in the local inputs
CODEC_SHARE = {"compressed": "codec_share", "compressed-numpy": "codec_numpy_share",
               "compressed-int8": "codec_int8_share"}
BUCKET_BYTES = 1 << 20  # bench_sync.py's overlapped buckets
PING_SIZES = {8: 30, 512: 30, 4096: 30, 1 << 20: 8, 4 << 20: 5, 8 << 20: 5}  # bytes: round trips


# --- arithmetic -------------------------------------------------------------------------

def host_bytes(payload: float, ranks: int, hosts: int, gather: bool = False) -> float:
    """The least bytes each host must send over its link per step to combine ``payload``
    bytes from each of ``ranks`` ranks spread evenly over ``hosts`` hosts.

    An allreduce sends ``2 (H-1)/H * payload`` per host (what a ring of the ``H`` hosts
    sends; sums inside a host cost the link nothing); an allgather (``gather``) sends the
    host's ``ranks / H`` payloads to the ``H - 1`` others. At one rank per host and ``P``
    ranks: ``2 (P-1)/P * payload``, and ``(P-1) * payload``. 0 on one host.
    """
    if hosts < 2:
        return 0.0
    return (hosts - 1) * ranks / hosts * payload if gather else 2 * (hosts - 1) / hosts * payload


def limit_steps_per_s(rate_bits: float, link_bytes: float) -> float | None:
    """Steps/s a link of ``rate_bits`` bits/s allows when a step sends ``link_bytes`` over it
    (None when a step sends nothing)."""
    return rate_bits / 8 / link_bytes if link_bytes > 0 else None


def link_per_step(start: Sequence[LinkBytes], stop: Sequence[LinkBytes], steps: int) -> dict:
    """Counter readings of every host's link before and after ``steps`` steps -> bytes per
    step each host sent and received, and the busiest direction of any host's link."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    deltas = [b - a for a, b in zip(start, stop)]
    if any(d.sent < 0 or d.received < 0 for d in deltas):
        raise ValueError("a link counter went backwards: were the hosts rebuilt between readings?")
    sent, received = [d.sent / steps for d in deltas], [d.received / steps for d in deltas]
    return {"sent": sent, "received": received, "busiest": max(sent + received)}


def spread(values: Sequence[float]) -> dict:
    """Median, min, max and (max - min) / median of ``values``."""
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / med if med else 0.0}


def vs_loop(mode: dict, loop: dict | None) -> dict | None:
    """A mode's steps/s over the hand-written loop's, repeat by repeat (repeat ``r`` of
    every mode runs in the same pass of the job, so each ratio is measured side by side):
    :func:`spread` of the ratios; None without the loop's repeats beside them."""
    if not loop or len(loop["repeats"]) != len(mode["repeats"]):
        return None
    return spread([h["step_s"] / r["step_s"] for r, h in zip(mode["repeats"], loop["repeats"])])


def rows_of(job: dict, marks: dict, rate_bits: float, hosts: int) -> list[dict]:
    """One row per mode of a bench_sync.py ``job`` (its JSON) and the counter readings at
    its ``marks`` (label -> {"start": [...], "stop": [...]})."""
    ranks, steps, rows = job["world_size"], job["steps"], []
    loop = job["modes"].get(LOOP)
    for mode, m in job["modes"].items():
        if mode == COMPUTE:  # an input of the model, not a row
            continue
        # auto may choose differently in each repeat: the row is named after its most
        # frequent choice, and counts every choice
        chosen = collections.Counter(r.get("sync", mode) for r in m["repeats"])
        sync = chosen.most_common(1)[0][0]
        first = next(r for r in m["repeats"] if r.get("sync", mode) == sync)  # one that chose it
        link = [link_per_step(marks[r["mark"]]["start"], marks[r["mark"]]["stop"], steps)
                for r in m["repeats"]]
        # the most one rank contributes (a node-aware reduction's leaders send, others not)
        payload = max(first.get("rank_bytes_per_step") or [m.get("bytes_per_step") or 0.0])
        need = host_bytes(payload, ranks, hosts, gather=mode in GATHER or sync in GATHER)
        sps = spread([1 / r["step_s"] for r in m["repeats"]])
        limit = limit_steps_per_s(rate_bits, need)
        rows.append({"rate_gbit": rate_bits / 1e9, "ranks": ranks, "hosts": hosts, "mode": mode,
                     "sync": sync, "steps_per_s": sps, "payload_bytes": payload,
                     "expected_link_bytes": need, "limit_steps_per_s": limit,
                     "of_limit": sps["median"] / limit if limit else None,
                     "link_bytes_per_step": statistics.median(x["busiest"] for x in link),
                     "link": link, "comm_share": m["comm_share"], "chosen": dict(chosen),
                     "sync_report": first.get("sync_report"), "vs_loop": vs_loop(m, loop)})
    rows += [{"rate_gbit": rate_bits / 1e9, "ranks": ranks, "hosts": hosts, "mode": mode,
              "skipped": why} for mode, why in job.get("skipped", {}).items()]
    return rows


# --- the cost model's prediction --------------------------------------------------------

def compute_seconds(job: dict) -> float | None:
    """Seconds per step of a job's ``compute-only`` runs (median of the repeats; None when
    it did not run)."""
    m = job["modes"].get(COMPUTE)
    return statistics.median(r["step_s"] for r in m["repeats"]) if m else None


def link_fit(pingpong: dict[int, float], gamma: float) -> dict:
    """alpha (s) and beta (s/B) fitted to one-way ping-pong times (``{bytes: seconds}``) by
    :func:`mpidp.scale.costmodel.fit_alpha_beta`, with ``gamma`` (s/B) beside them."""
    sizes = sorted(pingpong)
    alpha, beta = fit_alpha_beta(np.array(sizes, float), np.array([pingpong[k] for k in sizes]))
    return {"alpha": alpha, "beta": beta, "gamma": gamma}


def predicted_step_s(row: dict, fit: dict, compute: float, local: dict) -> tuple[str, float] | None:
    """The cost model's mode for ``row`` (an auto row: the strategy it chose) and its step
    seconds, from the link's ``fit`` (alpha, beta, gamma), ``compute`` (s per step of
    forward + backward + update at this layout) and the ``local`` inputs (``m`` gradient
    bytes, ``backward`` and ``first_bucket`` shares, ``codec_share``: the codec's seconds
    per second of compute, so ``codec = codec_share * compute``; ``cpu_per_byte``: beta of
    the link without a limit, where the cores, not the wire, set the pace; ``cores``: the
    cores every rank of the test hosts shares); None for a mode the model does not cover."""
    mode = MODEL_MODES.get(row["mode"]) if row["mode"] != "auto" else MODEL_MODES.get(row["sync"])
    if mode is None:
        return None
    coded = next((m for m in (row["mode"], row.get("sync")) if m in CODEC_SHARE), "compressed")
    share = local.get(CODEC_SHARE[coded], local["codec_share"])
    t = mode_step_time(mode, row["ranks"], local["m"], compute, Fit(**fit),
                       backward=local["backward"], first_bucket=local["first_bucket"],
                       codec=share * compute, per_node=row["ranks"] // row["hosts"],
                       wire_share=WIRE_SHARE[coded],
                       cpu_per_byte=local.get("cpu_per_byte", 0.0),
                       link_hops=row["ranks"] // row["hosts"] if row.get("placement") == "cyclic" else 1,
                       cores=local.get("cores"), last_bucket=local.get("last_bucket", 0.0),
                       node=local.get("node", {}).get("node_s", 0.0))
    return mode, t


def with_predictions(rows: Sequence[dict], fit: dict, compute: dict, local: dict) -> list[dict]:
    """``rows`` with ``model_mode``, ``predicted_steps_per_s`` and ``prediction_error``
    (predicted / measured - 1) added; ``compute`` maps ranks per host to the seconds of
    compute at that layout. Skipped rows, and modes without a prediction, get None."""
    out = []
    for r in rows:
        if "skipped" in r:
            out.append(r)
            continue
        c = compute.get(r["ranks"] // r["hosts"])
        got = predicted_step_s(r, fit, c, local) if c is not None else None
        pred, measured = (1 / got[1] if got else None), r["steps_per_s"]["median"]
        out.append({**r, "model_mode": got[0] if got else None, "predicted_steps_per_s": pred,
                    "prediction_error": pred / measured - 1 if pred and measured else None})
    return out


# --- measuring the model's inputs -------------------------------------------------------
# measure_local and pingpong_job import mpidp.comm (which starts MPI): each runs in a
# process of its own (``--local-inputs``, ``--pingpong``), never in the one that holds the hosts

def _median_s(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def codec_work(n: int, P: int = 2, codec: str = "bfloat16",
               jit: bool | None = None) -> tuple[Callable[[], None], str]:
    """One step's CPU work of the ``compressed`` strategy (``codec``) on one of ``P`` ranks
    for ``n`` float32 gradients, without the exchanges, and what it runs: the strategy's
    own :class:`mpidp.parallel.codecs.Codec` calls with the kernels it picks here (numba's
    for bfloat16 where numba is installed): per block, the gradient plus its residual
    encoded with error feedback; this rank's chunk (``n / P``) summed from ``P`` ranks'
    codes, plus the chunk residual, checked and encoded with error feedback; every code
    decoded. ``jit``: numba's kernels (True), NumPy's passes (False), or as the strategy
    picks (None)."""
    from mpidp.parallel import codecs as K
    from mpidp.parallel import compress as Z
    rng = np.random.default_rng(0)
    g = rng.standard_normal(n).astype(np.float32) * np.float32(1e-3)
    res, nxt = np.zeros(n, np.float32), np.zeros(n, np.float32)
    piece = Z._Piece(0, n, P, 0, 0, 0, codec)  # rank 0's layout: chunk 0 is summed here
    whole = [seg for lo, hi, at in piece.runs for seg in K.segments(lo, hi, at, codec)]
    chunk = K.segments(0, piece.m, 0, codec)  # offsets in the chunk and its codes
    if jit is None:
        jit = codec in K.JIT_CODECS and K.numba_available()
    k, h, own = K.Codec(codec, jit=jit), piece.m, piece.own
    codes = np.zeros(piece.end, np.uint16)
    recv = np.zeros((P - 1) * piece.mu, np.uint16)  # the other ranks' codes of this chunk
    for r in range(P - 1):
        for a, b, ca, cb in chunk:
            at = r * piece.mu
            recv[at + ca:at + cb] = K.encode(rng.standard_normal(b - a).astype(np.float32)
                                             * np.float32(1e-3), codec)
    cres, cnxt = np.zeros(h, np.float32), np.zeros(h, np.float32)
    starts = np.arange(-1, P - 1, dtype=np.int64) * piece.mu  # rank 0: its own codes

    def kernel() -> None:
        for a, b, ca, cb in whole:
            k.encode_sum_(g[a:b], codes[ca:cb], res[a:b], nxt[a:b])
        for a, b, ca, cb in chunk:
            starts[1:] = np.arange(P - 1) * piece.mu + ca
            k.sum_encode_(codes[own + ca:own + cb], recv, starts, b - a, cres[a:b], cnxt[a:b])
        for a, b, ca, cb in whole:
            k.decode_(codes[ca:cb], g[a:b])
    how = "numba's kernels" if jit else "NumPy's passes"
    return kernel, f"codecs.Codec, {how}: encode with error feedback, chunk sums, decode"


def measure_local(reps: int = 7, batch: int = 256) -> dict:
    """The model's inputs that do not depend on the link, measured in this process, medians
    of ``reps``: one rank's standard MLP (float32) on ``batch`` rows timed in parts (forward
    with the loss, backward, update); the share of backward done when the layer that closes
    the first overlapped bucket (:data:`BUCKET_BYTES`) reports its gradients final; the
    codec's seconds (:func:`codec_work`, P = 2) and their ratio to the step's, each codec
    pass right after a step (so that both see the same load of a shared machine); gamma,
    the seconds per byte of an in-memory float32 sum of the gradient vector."""
    from mpidp import nn
    from mpidp.parallel.buffer import N_EXTRA
    from mpidp.parallel.overlap import layer_buckets
    model = nn.mlp(784, (1024, 1024), 10, dtype=np.float32).init_(0)
    loss, opt = nn.SoftmaxCrossEntropy(), nn.SGD(0.05)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    n = model.n_params
    buckets = layer_buckets(model.layer_ranges, n + N_EXTRA, 4, BUCKET_BYTES)
    first = buckets[0][0]
    last = (buckets[-1][2] - buckets[-1][1]) / n  # the first layer's: final when backward ends
    work, how = codec_work(n)
    work8, _ = codec_work(n, codec="int8")
    work_np, _ = codec_work(n, jit=False)
    keys = ("forward_s", "backward_s", "update_s", "first_bucket", "codec_s", "codec_share",
            "codec_int8_s", "codec_int8_share", "codec_numpy_s", "codec_numpy_share")
    parts: dict[str, list[float]] = {k: [] for k in keys}
    done: list[float] = []  # when backward reported the first bucket's layer final

    def hook(j: int) -> None:
        if j == first:
            done.append(time.perf_counter())
    for i in range(reps + 1):  # the first is a warm-up
        done.clear()
        t0 = time.perf_counter()
        loss.forward(model.forward(X), y)
        dy = loss.backward()
        t1 = time.perf_counter()
        model.backward(dy, input_grad=False, on_layer_done=hook)
        t2 = time.perf_counter()
        opt.step_(model.params, model.grads, scale=1 / batch)
        t3 = time.perf_counter()
        work()
        t4 = time.perf_counter()
        work8()
        t5 = time.perf_counter()
        work_np()
        t6 = time.perf_counter()
        step = t3 - t0
        got = (t1 - t0, t2 - t1, t3 - t2, (done[0] - t1) / (t2 - t1), t4 - t3, (t4 - t3) / step,
               t5 - t4, (t5 - t4) / step, t6 - t5, (t6 - t5) / step)
        for key, v in zip(keys, got if i else ()):
            parts[key].append(v)
    med = {k: statistics.median(v) for k, v in parts.items()}
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    return {"m": 4 * n, "batch": batch, "reps": reps, "bucket_bytes": BUCKET_BYTES,
            "first_bucket_layer": first, "last_bucket": last, **med, "codec_how": how,
            "backward": med["backward_s"] / (med["forward_s"] + med["backward_s"] + med["update_s"]),
            "gamma": _median_s(lambda: np.add(a, b, out=a), reps) / (4 * n)}


def pingpong_job(out: str) -> None:
    """Under ``mpiexec -n 2``: times of :data:`PING_SIZES` between ranks 0 and 1 with both
    directions busy (:func:`mpidp.comm.exchange_time`: each sends the other the size at once,
    as an allreduce's steps do; a one-way ping-pong overstates the link's speed under load);
    rank 0 writes ``out``."""
    from mpi4py import MPI

    from mpidp import comm as C
    comm = MPI.COMM_WORLD
    got = {size: C.exchange_time(comm, size, reps) for size, reps in PING_SIZES.items()}
    if comm.rank == 0:
        Path(out).write_text(json.dumps(got))


def node_job(out: str, reps: int = 30) -> None:
    """Under ``mpiexec -n P`` over several nodes (the test hosts; on one machine, nodes of
    ``MPIDP_RANKS_PER_NODE`` ranks): the seconds a node-aware reduction of the standard
    gradient (:class:`mpidp.comm.NodeAllreduce`) takes beyond its leaders' exchange, i.e.
    the sums in shared memory, the wait for the leader and the copies back: per repeat,
    the slowest rank's time less the slowest leader's meeting and exchange inside it
    (``exchange_s``, so that the link's ups and downs cancel), the median of ``reps``.
    Before each, the ranks meet in a barrier that they wait in asleep, as a node's ranks
    wait for their leader. Rank 0 writes ``out``."""
    from mpi4py import MPI

    from mpidp import comm as C
    from mpidp import nn
    from mpidp.comm import shm as H
    from mpidp.comm.progress import wait_yielding
    from mpidp.parallel.buffer import N_EXTRA
    comm = MPI.COMM_WORLD
    n = nn.mlp(784, (1024, 1024), 10, dtype=np.float32).n_params + N_EXTRA  # its buffer
    node = C.NodeAllreduce(comm, n, np.float32)
    whole, leaders = np.zeros(reps + 1), np.zeros(reps + 1)
    for i in range(reps + 1):  # the first is a warm-up
        node.array[...] = 1
        wait_yielding(comm.Ibarrier(), H.LONGEST_SLEEP)  # no rank spinning on the cores
        t = time.perf_counter()
        node.allreduce()
        whole[i], leaders[i] = time.perf_counter() - t, node.exchange_s
    for x in (whole, leaders):
        comm.Allreduce(MPI.IN_PLACE, x, op=MPI.MAX)
    node.free()
    if comm.rank == 0:
        Path(out).write_text(json.dumps({
            "node_s": max(float(np.median(whole[1:] - leaders[1:])), 0.0),
            "whole_s": float(np.median(whole[1:])), "leaders_s": float(np.median(leaders[1:])),
            "ranks": comm.size, "per_node": node.node.size}))


def measure_node_on_hosts(c: Cluster, env: dict, tmp: Path, name: str, timeout: float) -> dict:
    """:func:`node_job` with 2 ranks on each test host, on the link as it is set now: the
    leaders' exchange takes the link's time, and the other ranks of each host wait for it
    (asleep) and copy its result back as they do inside a step."""
    out = tmp / f"{name}.json"
    cmd = c.mpiexec(4, 2, sys.executable, "-m", "benchmarks.bench_network", "--node-inputs",
                    str(out))
    subprocess.run(cmd, env=env, cwd=REPO, check=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return json.loads(out.read_text())


# --- report -----------------------------------------------------------------------------

def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def table(rows: Sequence[dict]) -> list[str]:
    """The Markdown table of ``rows`` (from :func:`rows_of`)."""
    out = ["| link | hosts x ranks | mode | steps/s (median, spread) | x loop (range) "
           "| predicted steps/s | error | link-bound limit | % of limit "
           "| host-link MB/step (veth) | expected MB/step |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        where = (f"| {r['rate_gbit']:g} Gbit/s | {r['hosts']} x {r['ranks'] // r['hosts']}"
                 f"{' cyclic' if r.get('placement') == 'cyclic' else ''} ")
        if "skipped" in r:
            out.append(where + f"| {r['mode']} | skipped: {r['skipped']} | | | | | | | |")
            continue
        s, mode = r["steps_per_s"], r["mode"]
        chosen = r.get("chosen") or {r["sync"]: 1}
        if len(chosen) > 1:  # auto chose differently in some repeats
            n = sum(chosen.values())
            mode += " (" + ", ".join(f"{k} {v}/{n}" for k, v in
                                     sorted(chosen.items(), key=lambda kv: -kv[1])) + ")"
        elif r["sync"] not in (mode, "allreduce") and not mode.startswith(r["sync"] + "-"):
            mode += f" ({r['sync']})"  # what auto chose (not a variant's own strategy name)
        x = r.get("vs_loop")
        ratio = "–" if x is None else (
            f"{x['median']:.2f} ({x['min']:.2f}-{x['max']:.2f})" if r["mode"] != LOOP else "1")
        out.append(where + f"| {mode} | {s['median']:.2f} ±{s['spread'] / 2:.0%} | {ratio} | "
                   f"{_fmt(r.get('predicted_steps_per_s'), '.2f')} | "
                   f"{_fmt(r.get('prediction_error'), '+.0%')} | "
                   f"{_fmt(r['limit_steps_per_s'], '.2f')} | {_fmt(r['of_limit'], '.0%')} | "
                   f"{r['link_bytes_per_step'] / 1e6:.2f} | {r['expected_link_bytes'] / 1e6:.2f} |")
    return out


def blas_line(env: dict) -> str:
    """The ranks' BLAS kernel (threadpoolctl) and MPI library, from a job's ``environment``."""
    blas = env.get("blas")
    kern = ", ".join(f"{b['internal_api']} {b['version']} {b['architecture']} kernel, "
                     f"{b['num_threads']} thread(s)" for b in blas) if isinstance(blas, list) else blas
    mpi = " ".join(str(env.get("mpi_library")).split())
    return f"BLAS: {kern}; {mpi}; numpy {env.get('numpy')}"


def model_lines(model: dict) -> list[str]:
    """How the prediction was made and each of its inputs measured, with their values
    (``model``: the report's ``model``, :func:`measure_local`'s and each link's inputs)."""
    loc = model["local"]
    lines = [
        "- predicted steps/s: 1 / `mpidp.scale.costmodel.mode_step_time` of the row's mode at "
        "P ranks for m = the float32 gradients' bytes: handwritten, allreduce and allreduce-flat "
        "as `allreduce` (a ring over the P ranks), allreduce-node as `node-aware` (a ring of "
        "the hosts' leaders), auto as the strategy it chose; error: predicted / measured - 1. "
        "Its inputs, all measured in this run:"]
    for k in model["links"]:
        f, c = k["fit"], k["compute"]
        lines.append(
            f"  - at {k['rate_gbit']:g} Gbit/s: alpha {f['alpha'] * 1e6:.0f} us, beta "
            f"{f['beta'] * 1e9:.2f} ns/B ({1 / f['beta'] / 1e6 if f['beta'] else float('inf'):.0f} "
            "MB/s) from MPI exchanges between the hosts after the limit was set (one rank "
            "each sending the other 8 B to 8 MiB at once, `mpidp.comm.exchange_time`, "
            "medians), fitted "
            "by `costmodel.fit_alpha_beta` (alpha: the mean up to 4 KiB; beta: the slope from "
            "256 KiB); compute " + ", ".join(f"{s * 1e3:.1f} ms per step at 2 x {per}"
                                              for per, s in sorted(c.items()))
            + ": bench_sync.py's `compute-only` (forward, backward and update of each rank's "
            "rows, then one Barrier: the ranks exchange nothing but wait for the slowest, as a "
            "synchronous step does) in the same jobs as the modes, shuffled among them, median "
            "of the repeats" + (f"; node-aware adds {k['node']['node_s'] * 1e3:.1f} ms for the "
                                "sums inside the hosts, the wait for the leader and the copies "
                                "back: node-aware reductions of the gradient at 2 x "
                                f"{k['node'].get('per_node', 2)} on the hosts at this rate "
                                f"({k['node']['whole_s'] * 1e3:.1f} ms, slowest rank) less "
                                "the leaders' exchange inside each "
                                f"({k['node']['leaders_s'] * 1e3:.1f} ms), medians "
                                "(`--node-inputs`)" if "node" in k else "") + ".")
    lines.append(
        f"  - here, once (one process, BLAS on 1 thread, {loc['batch']} rows, medians of "
        f"{loc['reps']}): backward {loc['backward']:.0%} of forward + backward + update "
        f"({loc['forward_s'] * 1e3:.1f} + {loc['backward_s'] * 1e3:.1f} + "
        f"{loc['update_s'] * 1e3:.1f} ms); first bucket ({loc['bucket_bytes'] / 2**20:g} MiB, "
        f"from layer {loc['first_bucket_layer']} on: the bucket sizes are the layer sizes) "
        f"final after {loc['first_bucket']:.0%} of backward, the time at which backward "
        f"reports that layer done; codec: one rank's CPU work at P = 2 ({loc['codec_how']}), "
        f"{loc['codec_s'] * 1e3:.1f} ms"
        + (f" (int8: {loc['codec_int8_s'] * 1e3:.1f} ms)" if "codec_int8_s" in loc else "")
        + (f" (bfloat16 by NumPy's passes, mode compressed-numpy: {loc['codec_numpy_s'] * 1e3:.1f} ms)"
           if "codec_numpy_s" in loc else "")
        + f", timed right after each step: {loc['codec_share']:.0%} "
        "of the step's time, the share of the measured compute the model adds to a compressed "
        "step (so that a busier moment here or on the hosts scales both alike); gamma "
        f"{loc['gamma'] * 1e9:.3f} ns/B, an in-memory float32 sum of the gradient vector "
        "(`np.add`).")
    if "cpu_per_byte" in loc:
        lines.append(
            f"  - the exchange's cost to the cores, {loc['cpu_per_byte'] * 1e9:.2f} ns per byte "
            "sent: beta of the same MPI exchanges on the hosts' link without a limit, where "
            "the cores (the network stack and MPI's copies), not the wire, set the pace; "
            "overlapped and compressed steps add it to the backward pass they hide behind; "
            f"where more ranks exchange at once than the {loc.get('cores', '?')} cores (flat "
            "allreduce at 2 x 2: 4 ranks; node-aware: its 2 leaders), each core's work per "
            "byte is shared among them, and a flat or leaders' allreduce moves a byte at the "
            "slower of the link's beta and that shared cost.")
    if "last_bucket" in loc:
        lines.append(
            f"  - the last bucket, the first layer's gradients ({loc['last_bucket']:.0%} of them), "
            "is final only when backward ends: overlapped, overlapped-forward and compressed "
            "steps add its exchange (its share of the ring, of the wire's bytes) after backward "
            "and that CPU work.")
    return lines


def markdown(report: dict) -> str:
    """The report as Markdown: the table, how each column was measured, where and how."""
    probes = "; ".join(f"{p['rate_gbit']:g} Gbit/s: {p['MB_per_s']:.0f} MB/s"
                       for p in report["probes"])
    lines = [
        "# Data parallelism over a slow link (two test hosts)", "",
        "Standard workload (784-1024-1024-10 MLP, float32, 7.45 MB of gradients, global batch "
        f"512); {report['steps']} timed steps after {report['warmup']} warm-up steps, "
        f"{report['repeats']} repeat(s), each in a shuffled order (seed {report['seed']}).", "",
        *table(report["rows"]), "",
        "- steps/s: the slowest rank's, median of the repeats; ± half their range.",
        "- x loop: steps/s over the hand-written loop's in the same repeat (each repeat runs "
        "every mode of a job once, one after another, so each ratio is taken side by side); "
        "median of the repeats and their range.",
        "- link-bound limit: rate / the least bytes each host must send per step (expected "
        "MB/step): an allreduce of m bytes per rank over H hosts 2(H-1)/H m (a ring of the "
        "hosts; at 2 x 1: m), an allgather (compressed: 16-bit codes) (H-1) k m with k ranks "
        "per host. m is the most one rank contributes per step (its strategy's `bytes_sent`: "
        "float32 gradients plus extras; about half that in bfloat16).",
        "- host-link MB/step: the bridge-side veths' byte counters (frames: payload plus "
        "TCP/IP/Ethernet headers, GSO packets counted once) read just before and after the "
        "timed steps of each run (the job waits at each mark while they are read), the "
        "busiest direction of any host, divided by the steps; median of the repeats.",
        "- allreduce-flat is the MPI library's own Allreduce over all the ranks: its host-link "
        "bytes are those of whichever algorithm the library picks for this size and layout "
        "(`--job-env` can pick one); allreduce-node sums inside each host first, then only "
        "the hosts' leaders reduce over the link. `2 x 2 cyclic`: ranks dealt to the "
        "hosts in turn (0 and 2 on one, 1 and 3 on the other), as a round-robin placement "
        "does; else in blocks (0 and 1 on one).",
        f"- The link itself (one TCP stream between the hosts, {report['probe_mb']} MB): "
        f"{probes}.",
        *(model_lines(report["model"]) if report.get("model") else []),
        *(f"- At {r['rate_gbit']:g} Gbit/s, {r['hosts']} x {r['ranks'] // r['hosts']}: "
          f"{r['sync_report']}; the timed steps came after that choice"
          for r in report["rows"] if r.get("sync_report")), "",
        "## Where and how", "",
        f"- Machine: {report['machine']} ({report['cores']} cores). The test hosts share this "
        "machine's CPUs with their network stack (TCP, veth, bridge, token buckets run on the "
        "cores that compute), so a fast link costs compute time that a real NIC would not.",
        f"- Links: `tc qdisc ... tbf` on both directions of each host's link; {report['tbf']}; "
        f"MTU {report.get('mtu') or 1500} bytes.",
        f"- {report['blas']}",
        *([f"- Environment of the MPI jobs: `{' '.join(report['job_env'])}`"] if report["job_env"] else []),
        f"- Command: `{report['command']}`; commit {report['commit']}; {report['date']}"]
    return "\n".join(lines) + "\n"


# --- running ----------------------------------------------------------------------------

class Marks:
    """The FIFOs ``folder/req`` and ``folder/ack`` of ``bench_sync.py --marks folder``:
    each ``start LABEL`` / ``stop LABEL`` line the job writes is answered once ``read()``
    (the links' counters) has been taken; ``seen[LABEL]`` holds the readings."""

    def __init__(self, folder: Path, read: Callable[[], list[LinkBytes]]) -> None:
        folder.mkdir()
        for name in ("req", "ack"):
            os.mkfifo(folder / name)
        # read-write ends never block on open, and keep the FIFOs open for the job's opens
        self._req = os.open(folder / "req", os.O_RDWR)
        self._ack = os.open(folder / "ack", os.O_RDWR)
        self.read, self.seen = read, {}
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with open(self._req, closefd=False) as req:
            for line in req:
                what, _, label = line.strip().partition(" ")
                if what == "quit":
                    return
                self.seen.setdefault(label, {})[what] = self.read()
                os.write(self._ack, b"ok\n")

    def close(self) -> None:
        os.write(self._req, b"quit\n")
        self._thread.join(timeout=10)
        os.close(self._req)
        os.close(self._ack)


def run_job(c: Cluster, per_host: int, modes: Sequence[str], args, env: dict,
            tmp: Path, name: str, cyclic: bool = False) -> tuple[dict, dict]:
    """bench_sync.py on ``2 x per_host`` ranks with ``modes``; its JSON and its marks.
    ``cyclic``: ranks dealt to the hosts in turn (0, 2 on one host, 1, 3 on the other), as
    a launcher's round-robin placement does; else in blocks (0, 1 on one host)."""
    out = tmp / f"{name}.json"
    marks = Marks(tmp / f"{name}.marks", c.link_bytes)
    cmd = c.mpiexec(2 * per_host, 1 if cyclic else per_host, sys.executable, "-m", "benchmarks.bench_sync",
                    "--only", "--modes", ",".join(modes), "--steps", str(args.steps),
                    "--warmup", str(args.warmup), "--repeats", str(args.repeats),
                    "--shuffle", str(args.seed), "--marks", str(tmp / f"{name}.marks"),
                    "--out", str(out))
    print("$ " + " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, env=env, cwd=REPO, check=True, timeout=args.timeout,
                       stdin=subprocess.DEVNULL)
    finally:
        marks.close()
    return json.loads(out.read_text()), marks.seen


def measure_link(c: Cluster, env: dict, tmp: Path, name: str, timeout: float) -> dict[int, float]:
    """One-way ping-pong seconds by message bytes between the two hosts (one rank each,
    :func:`pingpong_job`)."""
    out = tmp / f"{name}.json"
    cmd = c.mpiexec(2, 1, sys.executable, "-m", "benchmarks.bench_network", "--pingpong", str(out))
    subprocess.run(cmd, env=env, cwd=REPO, check=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def measure_locally(env: dict, tmp: Path, timeout: float) -> dict:
    """:func:`measure_local` in a process of its own (MPI starts there, not here) with the
    ranks' environment (BLAS threads)."""
    out = tmp / "local.json"
    subprocess.run([sys.executable, "-m", "benchmarks.bench_network", "--local-inputs", str(out)],
                   env=env, cwd=REPO, check=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return json.loads(out.read_text())


def rate_tag(rate_bits: float) -> str:
    """The name of a rate's files (``1g`` for 1 Gbit/s): rates with one tag are one rate."""
    return f"{rate_bits / 1e9:g}g"


def measure_rate(c: Cluster, rate_bits: float, args, env: dict, tmp: Path,
                 local: dict) -> tuple[list, dict, dict, dict]:
    """Every figure on links of ``rate_bits``: rows (with the model's predictions from
    ``local`` and this link's inputs), the TCP probe, the last job's JSON and the link's
    inputs of the model."""
    c.limit(rate_bits)
    n = int(args.probe_mb * 1e6)
    probe = {"rate_gbit": rate_bits / 1e9, "MB_per_s": n / c.transfer(0, 1, n) / 1e6}
    print(f"link at {rate_bits / 1e9:g} Gbit/s: one TCP stream {probe['MB_per_s']:.0f} MB/s", flush=True)
    tag, rows, job, compute = rate_tag(rate_bits), [], None, {}
    t = time.perf_counter()
    pingpong = measure_link(c, env, tmp, f"pingpong-{tag}", args.timeout)
    fit = link_fit(pingpong, local["gamma"])
    print(f"ping-pong ({time.perf_counter() - t:.1f} s): alpha {fit['alpha'] * 1e6:.0f} us, "
          f"beta {fit['beta'] * 1e9:.2f} ns/B", flush=True)
    if args.modes:
        job, marks = run_job(c, 1, [*args.modes, COMPUTE], args, env, tmp, f"pair-{tag}")
        rows += rows_of(job, marks, rate_bits, 2)
        compute[1] = compute_seconds(job)
    if args.node_modes:
        t = time.perf_counter()
        local = {**local, "node": measure_node_on_hosts(c, env, tmp, f"node-inputs-{tag}",
                                                        args.timeout)}
        print(f"node-aware reduction at 2 x 2 ({time.perf_counter() - t:.1f} s): "
              f"{local['node']['node_s'] * 1e3:.1f} ms beyond its leaders' exchange", flush=True)
        cyclic = args.placement == "cyclic"
        job, marks = run_job(c, 2, [*args.node_modes, COMPUTE], args, env, tmp, f"node-{tag}",
                             cyclic)
        compute[2] = compute_seconds(job)
        if set(job["modes"]) <= {COMPUTE}:  # no node_aware in make_sync: plain allreduce at 2 x 2
            rows += rows_of(job, marks, rate_bits, 2)
            job, marks = run_job(c, 2, ["allreduce"], args, env, tmp, f"plain-{tag}", cyclic)
        rows += [{**r, "placement": args.placement} for r in rows_of(job, marks, rate_bits, 2)]
    inputs = {"rate_gbit": rate_bits / 1e9, "fit": fit, "pingpong": pingpong, "compute": compute,
              **({"node": local["node"]} if "node" in local else {})}
    return with_predictions(rows, fit, compute, local), probe, job, inputs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", default="1,10", help="link rates in Gbit/s, comma-separated")
    p.add_argument("--steps", type=int, default=40, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps before each run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode, each a shuffled order")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled orders")
    p.add_argument("--modes", default=",".join(PAIR_MODES), help="modes at 2 hosts x 1 rank")
    p.add_argument("--node-modes", default=",".join(NODE_MODES),
                   help="modes at 2 hosts x 2 ranks (empty: none)")
    p.add_argument("--placement", choices=("block", "cyclic"), default="block",
                   help="ranks of the 2 x 2 jobs: block (0, 1 on the first host) or cyclic "
                   "(0, 2 on the first host: every neighbour in rank order on the other host)")
    p.add_argument("--mtu", type=int, default=None, help="the host links' MTU in bytes, "
                   "68-65535 (default: the veths' own, 1500); 65535 leaves the stack little "
                   "per-packet work, as a network card's segmentation offload does")
    p.add_argument("--probe-mb", type=float, default=50,
                   help="MB of the TCP probe of each link (>= 1)")
    p.add_argument("--job-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the MPI jobs (repeatable), e.g. "
                   "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring with MPIR_CVAR_ALLREDUCE_COMPOSITION=3")
    p.add_argument("--timeout", type=float, default=1200, help="seconds allowed per MPI job")
    p.add_argument("--results", default=str(HERE / "results"))
    p.add_argument("--local-inputs", metavar="FILE", help="(internal) measure the model's "
                   "inputs that do not depend on the link into FILE, and exit")
    p.add_argument("--pingpong", metavar="FILE", help="(internal, under mpiexec -n 2) the "
                   "ping-pong of the link into FILE, and exit")
    p.add_argument("--node-inputs", metavar="FILE", help="(internal, under mpiexec over "
                   "several nodes) the in-node share of a node-aware reduction into FILE, "
                   "and exit")
    quick_defaults(p, rates="1", steps=3, warmup=1, repeats=1, probe_mb=5)
    args = p.parse_args(argv)
    rates_text = args.rates
    try:
        args.rates = [float(r) * 1e9 for r in args.rates.split(",") if r.strip()]
    except ValueError:
        p.error(f"--rates must be comma-separated Gbit/s like 1,10, got {args.rates!r}")
    if not args.rates or not all(math.isfinite(r) and r >= 1e6 for r in args.rates):
        p.error(f"--rates must be finite Gbit/s of at least 0.001 (1 Mbit/s), got {rates_text!r}")
    tags = [rate_tag(r) for r in args.rates]
    if len(set(tags)) < len(tags):
        p.error(f"--rates names a rate twice (to 6 significant digits), got {rates_text!r}")
    if min(args.steps, args.repeats) < 1 or args.warmup < 0:
        p.error("--steps and --repeats must be >= 1, --warmup >= 0")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        p.error(f"--timeout must be a finite number > 0, got {args.timeout}")
    if not (math.isfinite(args.probe_mb) and args.probe_mb >= 1):
        p.error(f"--probe-mb must be a finite number >= 1 (a probe of less measures start-up, "
                f"not the link), got {args.probe_mb}")
    if args.mtu is not None and not 68 <= args.mtu <= 65535:
        p.error(f"--mtu must be 68-65535 bytes, got {args.mtu}")
    if any("=" not in kv for kv in args.job_env):
        p.error(f"--job-env takes NAME=VALUE, got {args.job_env}")
    for name in ("modes", "node_modes"):
        listed = [m.strip() for m in getattr(args, name).split(",") if m.strip()]
        flag = "--" + name.replace("_", "-")
        unknown = sorted(set(listed) - set(MODES + EXTRA_MODES))
        if unknown:
            p.error(f"{flag}: unknown mode(s) {unknown}; choose from {MODES + EXTRA_MODES}")
        if len(set(listed)) < len(listed) or COMPUTE in listed:
            p.error(f"{flag} names a mode twice (or {COMPUTE}, which runs in every job)")
        setattr(args, name, listed)
    if not args.modes and not args.node_modes:
        p.error("--modes and --node-modes are both empty: nothing to run")
    if args.placement != "block" and not args.node_modes:
        p.error("--placement places the ranks of the 2 x 2 jobs, and --node-modes is empty")
    return args


def _terminate(signum, frame) -> None:
    sys.exit(128 + signum)  # unwinds the with-blocks: hosts, links and folders go


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.local_inputs:
        Path(args.local_inputs).write_text(json.dumps(measure_local()))
        return 0
    if args.pingpong:
        pingpong_job(args.pingpong)
        return 0
    if args.node_inputs:
        node_job(args.node_inputs)
        return 0
    reason = limits_available()
    if reason:
        print(f"bench-network skipped: {reason}")
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    env, _ = bench_env()
    env["PYTHONPATH"] = str(REPO)
    env.update(kv.split("=", 1) for kv in args.job_env)
    rows, probes, first, links = [], [], None, []
    with tempfile.TemporaryDirectory(prefix="mpidp-network-") as t, Cluster(2, mtu=args.mtu) as c:
        local = measure_locally(env, Path(t), args.timeout)
        c.limit(None)  # what a byte costs the cores: the link as fast as they can drive it
        free = measure_link(c, env, Path(t), "pingpong-unlimited", args.timeout)
        local["cpu_per_byte"] = link_fit(free, 0.0)["beta"]
        local["cores"] = len(os.sched_getaffinity(0))  # the test hosts' ranks share them
        local["unlimited_pingpong"] = free
        for rate in args.rates:
            r, probe, job, inputs = measure_rate(c, rate, args, env, Path(t), local)
            rows, probes, first, links = rows + r, probes + [probe], first or job, links + [inputs]
    report = {"rows": rows, "probes": probes, "probe_mb": args.probe_mb, "steps": args.steps,
              "model": {"local": local, "links": links},
              "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed,
              "job_env": args.job_env, "mtu": args.mtu,
              "tbf": "; ".join(f"{r / 1e9:g} Gbit/s: `{' '.join(tbf_args(r))}`" for r in args.rates),
              "blas": blas_line(first["environment"]), "environment": first["environment"],
              "machine": cpu_model(), "cores": os.cpu_count(), "commit": git_commit(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": command("bench_network", argv)}
    md = markdown(report)
    out = Path(args.results)
    write(out / "network", report, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
