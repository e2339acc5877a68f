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

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "PYTHONPATH": str(REPO)}

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not in the environment")


def _run(args: list[str], timeout: float = 240) -> None:
    subprocess.run(args, cwd=BENCH, env=ENV, check=True, timeout=timeout,
                   stdout=subprocess.DEVNULL)


def test_bench_parallel_small(tmp_path):
    out = tmp_path / "parallel"
    _run([sys.executable, "bench_parallel.py", "--out", str(out), "--ranks", "2",
          "--models", "64x4", "--sweep-model", "32x4", "--sweep", "1,2", "--steps", "1",
          "--warmup", "0", "--repeats", "1", "--bubble-reps", "2", "--budget-mib", "4",
          "--mpiexec", str(MPIEXEC)])
    res = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".md").exists()
    n_params = 4 * (64 * 64 + 64)  # four Dense 64 x 64 layers with biases
    runs = {r["mode"]: r["ranks"] for r in res["runs"]}
    assert set(runs) == {"data", "gpipe", "1f1b"}
    # data parallel: params + (grads, loss, count, correct) in float32 on every rank
    assert [r["param_bytes"] for r in runs["data"]] == [4 * (2 * n_params + 3)] * 2
    for mode in ("gpipe", "1f1b"):  # two stages of two layers each
        assert [r["param_bytes"] for r in runs[mode]] == [4 * (n_params + 3)] * 2
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
    _run([str(MPIEXEC), "-n", "2", sys.executable, "bench_sync.py", "--out", str(out),
          "--modes", "allreduce,ps,compute-only", "--steps", "2", "--warmup", "1",
          "--repeats", "1", "--n-samples", "2048"])
    res = json.loads(out.read_text())
    modes = res["modes"]
    n_params = 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
    buf = 4 * (n_params + 3)  # gradients, loss, count, correct
    assert modes["allreduce"]["bytes_per_step"] == buf
    # mean over the ranks: the worker sends its buffer, the server broadcasts the parameters
    assert modes["ps"]["bytes_per_step"] == (buf + 4 * n_params) / 2
    assert modes["compute-only"]["bytes_per_step"] == 0
    assert all(m["step_ms"] > 0 for m in modes.values())
