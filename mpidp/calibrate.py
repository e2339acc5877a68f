"""``mpidp model``: measure this machine's network and compute, fit the cost model, and
predict step time and efficiency up to 1,024 ranks and 10**9 parameters."""

from __future__ import annotations

import json
import os
import time

import numpy as np

from . import comm as C
from . import costmodel as M
from . import nn

SIZES = [2**k for k in range(3, 25, 3)]  # 8 B .. 16 MiB


def compute_per_sample(batch: int = 512, repeats: int = 5) -> tuple[float, int]:
    """Seconds per sample of forward+backward+update of the standard MLP (784-1024-1024-10,
    float32) on this process, and its parameter count."""
    model = nn.mlp(784, (1024, 1024), 10, dtype=np.float32).init_(0)
    loss, opt = nn.SoftmaxCrossEntropy(), nn.SGD(0.05)
    rng = np.random.default_rng(0)
    X = rng.standard_normal((batch, 784)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    times = []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        loss.forward(model.forward(X), y)
        model.backward(loss.backward(), input_grad=False)
        opt.step_(model.params, model.grads, scale=1 / batch)
        times.append(time.perf_counter() - t)
    return float(np.median(times[1:])) / batch, model.n_params


def calibrate(comm: C.Comm, batch: int = 512) -> dict:
    """Measure (collective: ping-pong between ranks 0 and 1, Allreduce sweep on all) and
    fit. Returns the fit, the samples, and predictions (meaningful on rank 0)."""
    if comm.size < 2:
        raise C.MpidpError("mpidp model measures the network: run it with at least 2 ranks")
    pp = [C.pingpong(comm, s) for s in SIZES]
    ar = [C.time_allreduce(comm, s // 4) for s in SIZES]
    if comm.rank != 0:  # rank 0 times compute alone, as one rank of a quiet node would run
        C.agree(comm, None)
        return {}
    c, n_params = compute_per_sample(batch)
    C.agree(comm, None)
    alpha, beta = M.fit_alpha_beta(np.array(SIZES), np.array(pp))
    gamma = M.fit_gamma(comm.size, np.array(SIZES), np.array(ar), alpha, beta)
    fit = M.Fit(alpha, beta, gamma)
    c_per_param = c / n_params
    return {"world_size": comm.size, "fit": fit.as_dict(), "batch": batch,
            "compute_per_sample_s": c, "standard_model_params": n_params,
            "pingpong": dict(zip(SIZES, pp)), "allreduce": dict(zip(SIZES, ar)),
            "allreduce_predicted": dict(zip(SIZES, M.allreduce_time(
                comm.size, np.array(SIZES), fit).tolist())),
            "ps_stops_scaling_at": {int(n): M.ps_limit(4 * n, batch, c_per_param * n, fit)
                                    for n in (1e4, 1e5, 1e6, 1e7, 1e8, 1e9)},
            "table": M.prediction_table(fit, c_per_param, batch)}


def format_report(r: dict) -> str:
    """Markdown: the fit, the ping-pong/allreduce check, efficiency by P and size, PS limit."""
    f = r["fit"]
    lines = [f"fit on {r['world_size']} ranks: alpha {f['alpha'] * 1e6:.2f} us, "
             f"beta {f['beta'] * 1e9:.3f} ns/B ({1 / max(f['beta'], 1e-30) / 1e9:.2f} GB/s), "
             f"gamma {f['gamma'] * 1e9:.3f} ns/B; compute {r['compute_per_sample_s'] * 1e6:.1f} "
             f"us/sample for the {r['standard_model_params']:,}-parameter standard MLP", "",
             "| params | algorithm | " + " | ".join(f"P={p}" for p in (2, 4, 16, 64, 256, 1024)) + " |",
             "|---|---|" + "---:|" * 6]
    for n in (1e4, 1e6, 1e8, 1e9):
        for alg in M.ALGORITHMS:
            effs = {row["P"]: row["efficiency"] for row in r["table"]
                    if row["params"] == int(n) and row["algorithm"] == alg}
            lines.append(f"| {n:.0e} | {alg} | " + " | ".join(f"{effs[p]:.2f}" for p in
                                                             (2, 4, 16, 64, 256, 1024)) + " |")
    lines += ["", "Parallel efficiency at a fixed global batch of "
              f"{r['batch']} (strong scaling); compute per sample scales with the parameter count.",
              "", "A central parameter server is fastest at (beyond this, more ranks make steps slower): "
              + ", ".join(f"{int(n):.0e} params: P={p}" for n, p in r["ps_stops_scaling_at"].items())]
    return "\n".join(lines)


def save(r: dict, out: str) -> list[str]:
    """Write ``model.json``, ``model.md`` and (if matplotlib is installed) ``model.png``."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, "model.json"), os.path.join(out, "model.md")]
    with open(paths[0], "w") as f:
        json.dump(r, f, indent=2)
    with open(paths[1], "w") as f:
        f.write(format_report(r) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, style in ((1e6, "-"), (1e8, "--")):
        for alg, color in zip(M.ALGORITHMS, ("C0", "C1", "C3")):
            rows = [x for x in r["table"] if x["params"] == int(n) and x["algorithm"] == alg]
            ax.plot([x["P"] for x in rows], [x["efficiency"] for x in rows], style, color=color,
                    label=f"{alg}, {n:.0e} params")
    ax.set(xscale="log", xlabel="ranks P", ylabel="parallel efficiency (fixed global batch)",
           title="Cost-model predictions", ylim=(0, 1.05))
    ax.legend(fontsize=7)
    paths.append(os.path.join(out, "model.png"))
    fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
    return paths
