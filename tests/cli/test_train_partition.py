"""End-to-end: ``mpidp train --partition ...`` (figures, timeline, straggler option),
``mpidp predict`` (outputs written by every rank), and bad partition input at the CLI."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from helpers import main_here, parser_refusal, run_here, run_mpi

from mpidp import nn
from mpidp.data.partition import train_test_split
from mpidp.data.sources import BowSource

BOW = ["--dataset", "bow", "--n-samples", "1500", "--n-features", "300", "--hidden", "16",
       "--batch-size", "128", "--no-progress"]


@pytest.fixture(scope="module")
def cost_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cost") / "out"
    r = run_mpi(2, "train", *BOW, "--epochs", "2", "--partition", "cost", "--slowdown", "1:1.5",
                "--trace", str(out / "trace.json"), "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    return r, out


def test_train_reports_load_balance_in_metrics_and_summary(cost_run):
    r, out = cost_run
    m = json.loads((out / "metrics.json").read_text())
    b = m["balance"]
    assert b["strategy"] == "cost" and 0 < b["efficiency"] <= 1 and b["imbalance"] >= 1
    assert {"imbalance_cpu", "efficiency_cpu", "slowest_rank", "per_rank"} <= set(b)
    per = b["per_rank"]
    assert [p["rank"] for p in per] == [0, 1] and sum(p["samples"] for p in per) == 1200
    costs = BowSource(1500, 300).costs()[train_test_split(1500, 0.2, 0)[0]]
    assert sum(p["cost"] for p in per) == pytest.approx(costs.sum())
    assert all(0 <= p["idle_fraction"] < 1 and p["wait_s"] >= 0 for p in per)
    assert all("balance" in h for h in m["history"])
    assert "load balance (cost): imbalance" in r.stdout and "slowest rank" in r.stdout


def test_trace_is_chrome_trace_json_with_every_rank(cost_run):
    _, out = cost_run
    trace = json.loads((out / "trace.json").read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == {0, 1}  # one process per rank
    assert {"compute", "allreduce", "update"} <= {e["name"] for e in events}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events)
    steps = 2 * -(-1200 // 128)
    for rank in (0, 1):  # one local forward/backward per step, with its step number
        mine = [e for e in events if e["pid"] == rank and e["name"] == "compute"]
        assert sorted(e["args"]["step"] for e in mine) == list(range(steps))


@pytest.mark.parametrize("dynamic", [False, True])
def test_predict_writes_the_models_outputs_for_every_row(cost_run, tmp_path, dynamic):
    _, out = cost_run
    pred = tmp_path / "p.npy"
    args = ["predict", "--model", str(out), "--dataset", "bow", "--n-samples", "1500",
            "--n-features", "300", "--rows", "test", "--out", str(pred)]
    r = run_mpi(3, *args, *(["--dynamic", "--chunk-size", "17"] if dynamic else
                            ["--partition", "cost"]))
    assert r.returncode == 0, r.stderr[-3000:]
    saved = np.load(out / "model.npz")
    model = nn.from_spec(json.loads(str(saved["spec"])), str(saved["dtype"]))
    model.params[...] = saved["params"]
    X, y = BowSource(1500, 300).read(train_test_split(1500, 0.2, 0)[1])
    want = model.forward(X.astype(model.dtype))
    np.testing.assert_allclose(np.load(pred), want, rtol=1e-5, atol=1e-6)
    acc = json.loads((out / "metrics.json").read_text())["test_accuracy"]
    assert f"accuracy {acc:.4f}" in r.stdout


def test_cli_strategies_give_the_same_float64_parameters(tmp_path):
    """block on one rank (in this process), cyclic on 3, adaptive and weighted on 2."""
    args = ["train", *BOW, "--epochs", "2", "--dtype", "float64", "--optimizer", "sgd"]
    assert main_here(*args, "--partition", "block", "--out", str(tmp_path / "block")) == 0
    runs = {"block": np.load(tmp_path / "block" / "model.npz")["params"]}
    for n, part in ((3, "cyclic"), (2, "adaptive"), (2, "weighted")):
        r = run_mpi(n, *args, "--partition", part, "--out", str(tmp_path / part),
                    *(["--adapt-every", "3"] if part == "adaptive" else []),
                    *(["--capacities", "2,1"] if part == "weighted" else []))
        assert r.returncode == 0, r.stderr[-3000:]
        runs[part] = np.load(tmp_path / part / "model.npz")["params"]
    for part in ("cyclic", "adaptive", "weighted"):
        np.testing.assert_allclose(runs[part], runs["block"], rtol=1e-9, atol=1e-11)


def _bad_costs(tmp_path):
    np.save(tmp_path / "c.npy", np.ones(5))
    return str(tmp_path / "c.npy")


BAD = {
    "unknown strategy": (lambda t: ["--partition", "zigzag"], "invalid choice: 'zigzag'"),
    "capacities length": (lambda t: ["--partition", "weighted", "--capacities", "1,2"],
                          "--capacities has 2 entries; give one per rank: 3"),
    "negative capacities": (lambda t: ["--partition", "weighted", "--capacities", "1,-1,1"],
                            "capacities must be >= 0"),
    "costs length": (lambda t: ["--partition", "cost", "--costs", _bad_costs(t)],
                     "costs must have 1500 entries"),
    "slowdown rank": (lambda t: ["--slowdown", "7:2"], "names rank 7"),
    "slowdown syntax": (lambda t: ["--slowdown", "fast"], "like 1:2, got 'fast'"),
    "adaptive n < P": (lambda t: ["--partition", "adaptive", "--n-samples", "2",
                                  "--test-fraction", "0"], "at least one sample per rank"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_partition_options_clear_error_every_rank(tmp_path, capsys, case):
    make, message = BAD[case]
    out = tmp_path / "out"
    argv = ["train", *BOW, *make(tmp_path), "--epochs", "1", "--out", str(out)]
    err = parser_refusal(capsys, *argv)
    if err is not None:  # refused by the parser (in this process), else by the job's ranks
        assert err.count(message) == 1 and "Traceback" not in err and not out.exists(), err
        return
    # refused whatever the ranks: as a job of one rank in this process; else by 3 ranks
    here = case in ("costs length", "slowdown rank")
    r = run_here(capsys, *argv) if here else run_mpi(3, *argv, timeout=60)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.count(message) == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not out.exists()


def test_a_resume_on_other_ranks_leaves_the_old_capacities_where_they_no_longer_apply(tmp_path):
    """Capacities recorded for 2 ranks: a resume on 3 ranks under --partition block drops
    them (it was refused for their count); under weighted it says they came from the run."""
    run = ["train", "--dataset", "synthetic", "--n-samples", "400", "--no-progress",
           "--checkpoint-dir", str(tmp_path / "ck")]
    r = run_mpi(2, *run, "--epochs", "1", "--partition", "weighted", "--capacities", "1,2",
                "--checkpoint-every", "2", "--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr[-2000:]
    shutil.copytree(tmp_path / "ck", tmp_path / "ck2")
    r = run_mpi(3, *run, "--epochs", "2", "--resume", "--partition", "block",
                "--out", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "capacities" not in (tmp_path / "b" / "config.toml").read_text()
    run[-1] = str(tmp_path / "ck2")
    r = run_mpi(3, *run, "--epochs", "2", "--resume", "--out", str(tmp_path / "c"))
    assert r.returncode == 2 and "the resumed run's capacities" in r.stderr, r.stderr[-2000:]


def test_a_resume_on_fewer_ranks_than_its_slowdown_names_says_where_it_came_from(tmp_path):
    """A --slowdown stored for rank 2 of 3, resumed on 2 ranks: refused before any work,
    saying the value is the resumed run's; 0:1 typed over it resumes."""
    run = ["train", "--dataset", "synthetic", "--n-samples", "400", "--no-progress", "-q",
           "--checkpoint-dir", str(tmp_path / "ck"), "--out", str(tmp_path / "o")]
    r = run_mpi(3, *run, "--epochs", "1", "--slowdown", "2:1.5")
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_mpi(2, *run, "--epochs", "2", "--resume")
    assert r.returncode == 2 and "--slowdown names rank 2 but there are 2 ranks (the resumed " \
        "run's --slowdown" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    r = run_mpi(2, *run, "--epochs", "2", "--resume", "--slowdown", "0:1")
    assert r.returncode == 0, r.stderr[-2000:]
