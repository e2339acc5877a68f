"""``make bench-compare`` end to end in a tiny configuration: every cell of the table is a
measured number (finite, not a placeholder), the fault row really killed a rank and
resumed, and every row has its verdict."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from mpidp.parallel import buffer

MPIEXEC = Path(sys.executable).parent / "mpiexec"
COLUMNS = ("dp", "ps", "async", "pipeline", "hybrid")

pytestmark = pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not in the environment")


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("compare") / "compare"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "benchmarks.bench_compare", "--out", str(out), "--ranks",
                    "2", "--batch", "128", "--micro", "4", "--steps", "1", "--repeats", "1",
                    "--warmup", "1", "--bubble-reps", "1", "--epochs", "1", "--n-conv", "1024",
                    "--target", "100", "--n-fault", "1664", "--fault-batch", "128",
                    "--kill-step", "6", "--ckpt-every", "4", "--mpiexec", str(MPIEXEC)],
                   cwd=ROOT, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
    return json.loads(out.with_suffix(".json").read_text()), out


def test_every_cell_is_a_measured_number(result):
    from benchmarks.bench_compare_report import FIGURES
    res, out = result
    cells = res["cells"]["2"]
    assert set(cells) == set(COLUMNS)
    for column in COLUMNS:
        for _, key, label, _ in FIGURES:
            if key == "staleness_mean" and column != "async":
                continue
            value = cells[column][key]
            if key == "continues":
                assert isinstance(value, str) and "step" in value, (column, label)
            elif key == "samples_per_rank":
                assert len(value) == 2 and all(isinstance(v, int) for v in value)
            else:
                assert isinstance(value, (int, float)) and math.isfinite(value), (column, label)
    for path in (out.with_suffix(".md"), out.with_suffix(".png")):
        assert path.stat().st_size > 0


def test_fault_row_killed_and_resumed(result):
    res, _ = result
    for f in res["fault"]:
        assert f["killed"] and f["rc"] != 0 and f["steps_done_at_kill"] >= 6
        assert 0 <= f["steps_lost"] <= f["steps_done_at_kill"]
        if f["checkpoints"]:  # 4 | last checkpoint <= kill step; same result as uninterrupted
            assert f["last_checkpoint_step"] % 4 == 0 and f["steps_lost"] < 4 + 2
            assert f["max_param_diff"] < 1e-9
    by = {f["column"]: f for f in res["fault"]}
    assert by["dp"]["checkpoints"] and by["pipeline"]["checkpoints"]


def test_bytes_match_the_model(result):
    """Data parallel: one Allreduce of the float32 gradient buffer (params + its extras),
    2(P-1)/P of it each way per rank at P = 2; a pipeline stage of 2 sends one way the
    activations of the batch (128 x 1024 float32)."""
    res, _ = result
    runs = {(s["column"], s["split"]): s["ranks"] for s in res["speed"]}
    n_params = 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10
    assert [r["sent"] for r in runs[("dp", "default")]] == [4.0 * (n_params + buffer.N_EXTRA)] * 2
    assert runs[("pipeline", "default")][0]["sent"] == 128 * 1024 * 4


def test_verdicts(result):
    res, _ = result
    verdicts = res["verdicts"]
    assert [v["row"].split(".")[0] for v in verdicts] == [str(i) for i in range(1, 9)]
    for v in verdicts:
        assert v["claim"] and v["measured"] and v["flips_when"]
        assert isinstance(v["holds"], bool)
    for P in ("64", "1024"):
        assert all(math.isfinite(res["predictions"][P][c]["speedup"]) for c in COLUMNS)
