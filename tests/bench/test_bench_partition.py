"""The target checks of ``make bench-partition`` (benchmarks/bench_partition.py) on made-up
figures: which ideal the straggler targets use, and that P = 4 map/reduce is judged by CPU."""

from __future__ import annotations

from benchmarks import bench_partition as bench


def _row(P, workload, strategy, **kw):
    return {"P": P, "workload": workload, "strategy": strategy, "imbalance": 1.0,
            "imbalance_cpu": 1.0, **kw}


def _checks(eq_ideal, eq_att, ad_ideal, ad_att, mr):
    rows = [_row(2, "bow-sorted", "block", imbalance=2.0, imbalance_cpu=2.0),
            _row(2, "bow-sorted", "cost"),
            _row(2, "straggler-2x", "block", eff_vs_ideal_by_epoch=[eq_ideal] * 3,
                 eff_vs_attainable_by_epoch=[eq_att] * 3),
            _row(2, "straggler-2x", "adaptive", eff_vs_ideal_by_epoch=[0.6, ad_ideal, 0.99],
                 eff_vs_attainable_by_epoch=[0.6, ad_att, 0.99])]
    return {c["target"]: c for c in bench.targets(rows, mr)}


def _mr(dyn_wall, dyn_cpu):
    static = {"seconds": 1.0, "cpu_makespan": 0.5}
    return {"block": {"seconds": 3.0, "cpu_makespan": 1.5}, "cyclic": static, "cost": static,
            "dynamic": {"seconds": dyn_wall, "cpu_makespan": dyn_cpu}}


def test_straggler_targets_use_epoch_2_against_both_ideals():
    checks = _checks(0.66, 0.70, 0.93, 0.96, {2: _mr(1.0, 0.5)})
    assert all(c["pass"] for c in checks.values())
    straggler = {t: c for t, c in checks.items() if "straggler" in t}
    assert len(straggler) == 4 and all(c["headline"] for c in straggler.values())
    checks = _checks(0.66, 0.70, 0.85, 0.92, {2: _mr(1.0, 0.5)})  # epoch 2, not epoch 3
    bad = [t for t, c in checks.items() if not c["pass"]]
    assert bad == ["straggler 2x P=2: adaptive >= 90% of ideal (sum of speeds) by epoch 2"]
    checks = _checks(0.78, 0.70, 0.95, 0.95, {2: _mr(1.0, 0.5)})
    assert [t for t, c in checks.items() if not c["pass"]] == [
        "straggler 2x P=2: equal split <= 75% of ideal (sum of speeds)"]


def test_mapreduce_reports_wall_and_cpu_and_p4_headline_is_cpu():
    checks = _checks(0.66, 0.70, 0.93, 0.96, {2: _mr(1.05, 0.52), 4: _mr(1.3, 0.53)})
    wall4 = checks["map/reduce P=4: dynamic within 10% of best static (wall)"]
    cpu4 = checks["map/reduce P=4: dynamic within 10% of best static (CPU)"]
    assert not wall4["pass"] and not wall4["headline"] and wall4["value"] == 1.3
    assert cpu4["pass"] and cpu4["headline"] and cpu4["value"] == 1.06
    wall2 = checks["map/reduce P=2: dynamic within 10% of best static (wall)"]
    assert wall2["pass"] and wall2["headline"]
    checks = _checks(0.66, 0.70, 0.93, 0.96, {2: _mr(1.2, 0.5)})
    assert not checks["map/reduce P=2: dynamic within 10% of best static (wall)"]["pass"]
