"""The benchmark drivers end to end on tiny configurations, so an API change that breaks
``make bench-parallel`` or ``make bench-sync`` fails here, not at measuring time. Each test
checks figures the benchmark computes exactly (bytes), not just that it ran."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT

from mpidp.parallel import buffer

MPIEXEC = Path(sys.executable).parent / "mpiexec"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "PYTHONPATH": str(ROOT)}

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not in the environment")


def _run(args: list[str], timeout: float = 240) -> None:
    subprocess.run(args, cwd=ROOT, env=ENV, check=True, timeout=timeout,
                   stdout=subprocess.DEVNULL)


def test_bench_parallel_small(tmp_path):
    out = tmp_path / "parallel"
    _run([sys.executable, "-m", "benchmarks.bench_parallel", "--out", str(out), "--ranks", "2",
          "--models", "64x4", "--sweep-model", "32x4", "--sweep", "1,2", "--steps", "1",
          "--warmup", "0", "--repeats", "1", "--bubble-reps", "2", "--budget-mib", "4",
          "--mpiexec", str(MPIEXEC)])
    res = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".md").exists()
    n_params = 4 * (64 * 64 + 64)  # four Dense 64 x 64 layers with biases
    runs = {r["mode"]: r["ranks"] for r in res["runs"]}
    assert set(runs) == {"data", "gpipe", "1f1b"}
    # data parallel: params + (grads, loss, count, correct, stop, early) in float32 on every rank
    extras = buffer.N_EXTRA
    assert extras == 5
    assert [r["param_bytes"] for r in runs["data"]] == [4 * (2 * n_params + extras)] * 2
    for mode in ("gpipe", "1f1b"):  # two stages of two layers each
        assert [r["param_bytes"] for r in runs[mode]] == [4 * (n_params + extras)] * 2
        # each stage sends 512 rows of 64 float32 one way per step
        assert [r["comm_bytes"] for r in runs[mode]] == [512 * 64 * 4] * 2
    assert res["targets"]["pipeline_params_le_share_plus_imbalance"] is True
    for sweep in res["sweeps"]:
        assert sweep["n_in"] == 48  # 1.5 x the sweep model's width
        for rows in sweep["by_m"]:
            busy = rows[0]["stage_busy_s"]
            assert len(busy) == 2 and rows[0]["makespan_s"] >= max(busy) > 0
            # every rank reports its own idle share of the same replayed makespan
            idle = [1 - b / rows[0]["makespan_s"] for b in busy]
            assert np.allclose(sorted(idle), sorted(r["idle_replay"] for r in rows))


def test_bench_sync_small(tmp_path):
    out = tmp_path / "sync.json"
    _run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "benchmarks.bench_sync", "--out", str(out),
          "--modes", "allreduce,ps,compute-only", "--steps", "2", "--warmup", "1",
          "--repeats", "1", "--pair-repeats", "3", "--n-samples", "2048"])
    res = json.loads(out.read_text())
    modes = res["modes"]
    ar, hw = modes["allreduce"]["repeats"], modes["handwritten"]["repeats"]
    assert len(ar) == len(hw) == 3 and len(modes["ps"]["repeats"]) == 1
    assert modes["allreduce"]["paired_ratio_to_handwritten"] == pytest.approx(
        float(np.median([a["step_s"] / h["step_s"] for a, h in zip(ar, hw)])))
    n_params = 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
    buf = 4 * (n_params + buffer.N_EXTRA)  # gradients and the extras (loss, counts, ...)
    assert modes["allreduce"]["bytes_per_step"] == buf
    # mean over the ranks: the worker sends its buffer, the server broadcasts the parameters
    assert modes["ps"]["bytes_per_step"] == (buf + 4 * n_params) / 2
    assert modes["compute-only"]["bytes_per_step"] == 0
    assert all(m["step_ms"] > 0 for m in modes.values())


def test_bench_sync_validation_rescales_compute_to_the_run():
    """bench-sync's cost-model check: compute is rescaled so that the model's P = 1 step
    equals the measured one, then predicted at P = 2, 3, 4 (on this machine's cores)."""
    from benchmarks.run_sync_bench import predictions
    from mpidp.scale import costmodel as M
    fit = {"alpha": 2e-6, "beta": 1e-10, "gamma": 2e-10}
    compute = {"per_sample": 6e-5, "overhead": 2e-3, "contention": 1.05, "jitter": 0.03}
    model = {"fit": fit, "compute": compute, "standard_model_params": 1000}
    strong = {P: {"modes": {"allreduce": {"step_ms": ms}}} for P, ms in
              ((1, 40.0), (2, 22.0), (3, 30.0), (4, 35.0))}
    rows = predictions(model, strong)
    c = M.Compute(**compute)
    c = c.scaled(0.040 / (c.overhead + c.per_sample * 512))
    assert M.step_time(1, 4000, 512, c, M.Fit(**fit)) == pytest.approx(0.040)
    for r in rows:
        want = M.step_time(r["P"], 4000, 512, c, M.Fit(**fit), cores=os.cpu_count()) * 1e3
        assert r["predicted_ms"] == pytest.approx(want)
        assert r["error"] == pytest.approx(want / strong[r["P"]]["modes"]["allreduce"]["step_ms"] - 1)
        assert r["ideal_ms"] < r["predicted_ms"]  # no fixed part, contention or wait
    assert [r["P"] for r in rows] == [2, 3, 4]


def test_bench_sync_targets_are_decided_from_the_run():
    """Each target row is met exactly when its figure passes its threshold."""
    from benchmarks.run_sync_bench import targets

    def run(ratio, ps_ms, compressed_bytes):
        one = {"allreduce": {"step_ms": 44.0}, "handwritten": {"step_ms": 40.0},
               "compute-only": {"step_ms": 44.0}}
        two = {"allreduce": {"step_ms": 25.0, "paired_ratio_to_handwritten": ratio,
                             "bytes_per_step": 100},
               "handwritten": {"step_ms": 24.0}, "ps": {"step_ms": ps_ms},
               "compressed": {"step_ms": 40.0, "bytes_per_step": compressed_bytes},
               "compute-only": {"step_ms": 20.0}}
        return {t["target"].split()[0] + " " + t["target"].split()[1]: t["met"]
                for t in targets({1: {"modes": one}, 2: {"modes": two}}, {2: 48.0})}

    good = run(1.049, 23.0, 50)  # ps: 23 ms < hand-written 24, efficiency 44 / 46 = 0.96
    assert good == {"fused allreduce": True, "best variant": True, "synchronous parameter": True,
                    "compression halves": True, "mpidp >=": False}  # 48 / 25 = 1.92x
    bad = run(1.051, 27.6, 51)  # ps 10.4% slower; the best mode is allreduce, not faster
    assert bad == {"fused allreduce": False, "best variant": False,
                   "synchronous parameter": False, "compression halves": False, "mpidp >=": False}


def test_bench_async_small(tmp_path):
    """Sync and async dedicated-server runs, with and without a straggler, on 3 ranks: every
    sample is in each trace, and the report's summary reads them."""
    from benchmarks.run_sync_bench import async_markdown, async_summary
    out = tmp_path / "async.json"
    _run([str(MPIEXEC), "-n", "3", sys.executable, "-m", "benchmarks.bench_async", "--out", str(out),
          "--epochs", "1", "--n-samples", "2000", "--batch-size", "256"])
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"sync-equal", "async-equal", "sync-straggler", "async-straggler"}
    for r in res["runs"].values():
        assert sum(row[2] for row in r["trace"]) == 1800  # the training rows (10% are test)
    a = res["runs"]["async-straggler"]
    assert a["applied"] + a["dropped"] == len(a["pushes"]) == 2 * 8  # 2 workers x 8 batches
    summary = async_summary(res, window=256)
    assert summary["runs"]["sync-equal"]["seconds_to"]["end"] is not None
    assert "async-straggler" in "\n".join(async_markdown(summary, res))


def test_smoothed_loss_is_the_mean_over_the_last_window_of_samples():
    from benchmarks.run_sync_bench import smoothed
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 50, 40).astype(float)
    losses = rng.random(40) * counts
    trace = np.column_stack([np.arange(40.0), losses, counts])
    got = smoothed(trace.tolist(), 100)
    for i in range(40):  # rows whose samples all lie within the last 100 seen at row i
        seen = np.cumsum(counts)
        keep = [j for j in range(i + 1) if seen[i] - seen[j] + counts[j] <= 100] or [i]
        assert got[i, 2] == pytest.approx(losses[keep].sum() / counts[keep].sum())
        assert got[i, 1] == seen[i] and got[i, 0] == i
