"""Pipeline planning without MPI: stage split, micro-batches, schedules and their bubble."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT

from mpidp import nn
from mpidp.parallel import stages as St

PKG = ROOT / "mpidp"


def _brute_force_best(costs, P):
    """Smallest possible largest stage cost, by trying every way to cut."""
    L, best = len(costs), float("inf")
    for cuts in itertools.combinations(range(1, L), P - 1):
        b = [0, *cuts, L]
        best = min(best, max(sum(costs[b[s]:b[s + 1]]) for s in range(P)))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_split_is_optimal_and_contiguous(seed):
    rng = np.random.default_rng(seed)
    L = int(rng.integers(1, 9))
    P = int(rng.integers(1, L + 1))
    costs = rng.integers(0, 20, L).astype(float).tolist()
    b = St.split_stages(costs, P)
    assert b[0] == 0 and b[-1] == L and len(b) == P + 1
    assert all(b[s] < b[s + 1] for s in range(P)), "every stage holds at least one layer"
    worst = max(sum(costs[b[s]:b[s + 1]]) for s in range(P))
    assert worst == pytest.approx(_brute_force_best(costs, P))


def test_split_of_an_mlp_by_parameters():
    layers = nn.presets.mlp_layers(10, (100, 10), 10)  # Dense 1100, ReLU, Dense 1010, ReLU, Dense 110
    assert St.param_counts(layers) == [1100, 0, 1010, 0, 110]
    b = St.split_stages(St.param_counts(layers), 2)
    assert b in ([0, 1, 5], [0, 2, 5])  # the biggest layer alone; the rest together (1120)


def test_more_stages_than_layers_is_a_clear_error():
    with pytest.raises(ValueError, match=r"more pipeline stages \(4\) than layers \(3\)"):
        St.split_stages([1, 2, 3], 4)


def test_plan_widths_and_the_layer_that_breaks_the_chain():
    layers = [nn.Dense(5, 4), nn.ReLU(), nn.Dense(4, 3)]
    assert St.plan_stages(layers, 5, 1, 1, 1, "gpipe", "params", None).widths == [5, 4, 4, 3]
    bad = [nn.Dense(5, 4), nn.ReLU(), nn.Dense(6, 3)]
    with pytest.raises(ValueError, match=r"do not chain: layer 2 \(Dense\(6, 3\)\) gets 4 features"):
        St.plan_stages(bad, 5, 1, 1, 1, "gpipe", "params", None)


@pytest.mark.parametrize("n,m", [(10, 3), (7, 7), (100, 8), (5, 1)])
def test_micro_batches_differ_by_at_most_one(n, m):
    sizes = St.micro_batch_sizes(n, m)
    assert len(sizes) == m and sizes.sum() == n and sizes.max() - sizes.min() <= 1 and sizes.min() >= 1


def test_more_micro_batches_than_samples_is_a_clear_error():
    with pytest.raises(ValueError, match=r"more micro-batches \(5\) than samples in a batch \(4\)"):
        St.micro_batch_sizes(4, 5)


@pytest.mark.parametrize("name", St.SCHEDULES)
@pytest.mark.parametrize("P,m", [(1, 1), (2, 1), (2, 4), (3, 2), (4, 8), (4, 3), (5, 16)])
def test_schedule_runs_each_op_once_in_order(name, P, m):
    for s in range(P):
        ops = St.schedule(name, P, s, m)
        assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
        assert all(ops.index(("F", i)) < ops.index(("B", i)) for i in range(m))
        expected = m if name == "gpipe" else min(P - s, m)
        assert St.max_in_flight(ops) == expected


@pytest.mark.parametrize("name", St.SCHEDULES)
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_replay_with_equal_stages_gives_the_textbook_bubble(name, P, m):
    """Forward 1 unit, backward 2 units on every stage: idle share = (P-1)/(m+P-1) on each."""
    scheds = [St.schedule(name, P, s, m) for s in range(P)]
    durations = [[1.0 if k == "F" else 2.0 for k, _ in ops] for ops in scheds]
    busy, makespan = St.replay(scheds, durations)
    assert makespan == pytest.approx(3 * (m + P - 1))
    np.testing.assert_allclose(1 - busy / makespan, (P - 1) / (m + P - 1), rtol=1e-12)


def test_replay_detects_a_deadlocking_order():
    scheds = [[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]]  # stage 0 waits for a gradient first
    with pytest.raises(ValueError, match="deadlock"):
        St.replay(scheds, [[1, 1], [1, 1]])


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        St.schedule("zigzag", 2, 0, 2)


def test_measured_costs_follow_layer_size_and_leave_layers_unbound():
    layers = [nn.Dense(256, 512), nn.ReLU(), nn.Dense(512, 8)]
    costs = St.measure_costs(layers, 256, n_samples=128, repeats=5)
    assert len(costs) == 3 and all(c > 0 for c in costs)
    # a 256x512 matmul pair takes ~10x a ReLU's time: a median of 5 keeps that on a busy machine
    assert costs[0] > costs[1]
    assert all(not layer.params for layer in layers), "probes must not bind the caller's layers"


def test_planning_module_imports_no_mpi():
    code = f"""
import sys, types
sys.modules["mpi4py"] = None
for name, path in (("mpidp", {str(PKG)!r}), ("mpidp.parallel", {str(PKG / "parallel")!r})):
    pkg = types.ModuleType(name); pkg.__path__ = [path]; sys.modules[name] = pkg
import mpidp.parallel.stages as St
assert St.split_stages([1, 1, 1, 1], 2) == [0, 2, 4]
assert "mpidp.comm" not in sys.modules
print("ok")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr
