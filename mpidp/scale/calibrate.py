"""``mpidp model``: measure this machine's network and compute, fit the cost model, and
predict step time and efficiency up to 1,024 ranks and 10**9 parameters."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict

import numpy as np

from .. import comm as C
from .. import nn
from . import costmodel as M

SIZES = [2**k for k in range(3, 25, 3)]  # 8 B .. 16 MiB
EVICT_BYTES = 32 << 20  # read before each timed Allreduce: past the L2 and most L3 caches
STANDARD_MLP = (784, (1024, 1024), 10)  # the float32 MLP whose steps are timed: nn.mlp's layout


def _alternate(batches: list[int], repeats: int, before=None) -> list[list[float]]:
    """Seconds of ``repeats`` forward+backward+update steps of ONE standard MLP on each of
    ``batches`` rows (one warm-up each), taken in turns so that a slower moment hits every
    size alike; ``before()`` first."""
    model = nn.mlp(*STANDARD_MLP, dtype=np.float32).init_(0)
    loss, opt = nn.SoftmaxCrossEntropy(), nn.SGD(0.05)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((max(batches), 784)).astype(np.float32)
    y = rng.integers(0, 10, max(batches))

    def step(batch: int) -> None:
        loss.forward(model.forward(X[:batch]), y[:batch])
        model.backward(loss.backward(), input_grad=False)
        opt.step_(model.params, model.grads, scale=1 / batch)

    for batch in batches:
        step(batch)
    times: list[list[float]] = [[] for _ in batches]
    for _ in range(repeats):
        for batch, out in zip(batches, times):
            if before is not None:
                before()
            t = time.perf_counter()
            step(batch)
            out.append(time.perf_counter() - t)
    return times


def measure_compute(comm: C.Comm, batch: int = 512, repeats: int = 15) -> M.Compute | None:
    """The standard MLP's :class:`costmodel.Compute` here, on rank 0 (None elsewhere).
    Collective. All ranks step on ``batch // P`` rows at once: their spread gives ``jitter``,
    against rank 0 alone ``contention``; rank 0 at two sizes, the fixed and per-sample parts."""
    local = max(1, batch // comm.size)
    together = _alternate([local], repeats, before=lambda: C.barrier(comm))[0]
    steps = np.array(C.gather_obj(comm, together, 0) or [[0.0]])  # (ranks, repeats)
    if comm.rank != 0:  # rank 0 times compute alone, as one rank of a quiet node would run
        C.agree(comm, None)
        return None
    small, full = (float(np.median(t)) for t in _alternate([local, batch], repeats))
    C.agree(comm, None)
    per_sample = (full - small) / (batch - local) if batch > local else full / batch
    if per_sample <= 0:  # noise swamped the difference: no fixed part
        per_sample, small = full / batch, local * full / batch
    overhead = max(small - per_sample * local, 0.0)
    jitter = float(np.mean(steps.std(axis=0)) / steps.mean())  # spread within a step
    return M.Compute(per_sample, overhead, float(np.median(steps)) / small, jitter)


def calibrate(comm: C.Comm, batch: int = 512) -> dict:
    """Measure (collective: ping-pong between ranks 0 and 1, an Allreduce sweep and compute on
    all) and fit: the fit, the samples and predictions (meaningful on rank 0)."""
    if comm.size < 2:
        raise C.MpidpError("mpidp model measures the network: run it with at least 2 ranks")
    pp = [C.pingpong(comm, s) for s in SIZES]
    scratch = np.ones(EVICT_BYTES // 4, np.float32)
    ar = [C.time_allreduce(comm, s // 4, evict=scratch) for s in SIZES]
    del scratch
    compute = measure_compute(comm, batch)
    if compute is None:
        return {}
    n_params = nn.mlp(*STANDARD_MLP).n_params
    alpha, beta = M.fit_alpha_beta(np.array(SIZES), np.array(pp))
    gamma = M.fit_gamma(comm.size, np.array(SIZES), np.array(ar), alpha, beta)
    fit = M.Fit(alpha, beta, gamma)
    per_param = compute.scaled(1 / n_params)
    return {"world_size": comm.size, "fit": asdict(fit), "batch": batch,
            "compute_per_sample_s": compute.per_sample + compute.overhead / batch,
            "compute": asdict(compute), "standard_model_params": n_params,
            "pingpong": dict(zip(SIZES, pp)), "allreduce": dict(zip(SIZES, ar)),
            "allreduce_predicted": dict(zip(SIZES, M.allreduce_time(
                comm.size, np.array(SIZES), fit).tolist())),
            "ps_stops_scaling_at": {int(n): M.ps_limit(4 * n, batch, per_param.scaled(n), fit)
                                    for n in (1e4, 1e5, 1e6, 1e7, 1e8, 1e9)},
            "table": M.prediction_table(fit, per_param, batch)}


PS = (2, 4, 16, 64, 256, 1024)  # the report's columns


def format_report(r: dict) -> str:
    """Markdown: the fit, the ping-pong/allreduce check, efficiency by P and size, PS limit."""
    f, c = r["fit"], r["compute"]
    lines = [f"fit on {r['world_size']} ranks: alpha {f['alpha'] * 1e6:.2f} us, "
             f"beta {f['beta'] * 1e9:.3f} ns/B ({1 / max(f['beta'], 1e-30) / 1e9:.2f} GB/s), "
             f"gamma {f['gamma'] * 1e9:.3f} ns/B; compute {r['compute_per_sample_s'] * 1e6:.1f} "
             f"us/sample for the {r['standard_model_params']:,}-parameter standard MLP "
             f"({c['overhead'] * 1e3:.2f} ms per step + {c['per_sample'] * 1e6:.1f} us per sample; "
             f"x{c['contention']:.2f} with every rank computing at once; step-time spread "
             f"{c['jitter']:.1%})", "",
             "| params | algorithm | " + " | ".join(f"P={p}" for p in PS) + " |",
             "|---|---|" + "---:|" * 6]
    for n in (1e4, 1e6, 1e8, 1e9):
        for alg in M.ALGORITHMS:
            effs = {row["P"]: row["efficiency"] for row in r["table"]
                    if row["params"] == int(n) and row["algorithm"] == alg}
            lines.append(f"| {n:.0e} | {alg} | " + " | ".join(f"{effs[p]:.2f}" for p in PS) + " |")
    lines += ["", f"Parallel efficiency at a fixed global batch of {r['batch']} (strong "
              "scaling); compute per sample scales with the parameter count.",
              "", "A central parameter server is fastest at (beyond this, more ranks make steps "
              "slower): " + ", ".join(f"{int(n):.0e} params: P={p}"
                                      for n, p in r["ps_stops_scaling_at"].items()),
              "", "mpidp's `ps` between nodes is `reduce-broadcast` (reduce-scatter, gather to the "
              "server, scatter + allgather broadcast): twice a ring's bytes, but no link carries "
              "more than 2 m, so it keeps scaling where the central server stops."]
    return "\n".join(lines)


def save(r: dict, out: str) -> list[str]:
    """Write ``model.json``, ``model.md`` and (if matplotlib is installed) ``model.png``."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, name) for name in ("model.json", "model.md", "model.png")]
    for path, text in zip(paths, (json.dumps(r, indent=2), format_report(r) + "\n")):
        with open(path, "w") as f:
            f.write(text)
    return paths if plot(r, paths[2]) else paths[:2]


def plot(r: dict, path: str) -> bool:
    """``model.png``: predicted efficiency against P, and the Allreduce time against message
    size (the fit as lines, the measurements as points); False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for n, style in ((1e6, "-"), (1e8, "--")):
        for alg, color in zip(M.ALGORITHMS, ("C0", "C1", "C3", "C2")):
            rows = [x for x in r["table"] if x["params"] == int(n) and x["algorithm"] == alg]
            ax.plot([x["P"] for x in rows], [x["efficiency"] for x in rows], style, color=color,
                    label=f"{alg}, {n:.0e} params")
    ax.set(xscale="log", xlabel="ranks P", ylabel="parallel efficiency (fixed global batch)",
           title="Cost-model predictions", ylim=(0, 1.05))
    ax.legend(fontsize=7, loc="upper right")  # the curves fall away from that corner
    for key, style, color, label in (
            ("allreduce", "o", "C0", "Allreduce, measured"),
            ("pingpong", "o", "C1", "ping-pong, measured"),
            ("allreduce_predicted", "-", "C0", "Allreduce, model (alpha, beta, gamma fit)")):
        got = {int(b): t for b, t in (r.get(key) or {}).items()}
        if got:
            b = sorted(got)
            bx.plot(b, [got[k] * 1e6 for k in b], style, color=color, label=label,
                    **({"ms": 6, "zorder": 3} if style == "o" else {"lw": 1.5, "zorder": 1}))
    bx.set(xscale="log", yscale="log", xlabel="message bytes", ylabel="microseconds",
           title=f"Model vs measurement, P = {r.get('world_size', '?')}")
    bx.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return True
