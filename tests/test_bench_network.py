"""``make bench-network``'s arithmetic and report, and (as root) that a rate-limited test
host link really runs at its rate and that its byte counters count what crossed it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "multihost"))
import bench_network as B  # noqa: E402
from cluster import Cluster, LinkBytes, limits_available, tbf_args  # noqa: E402

MPIEXEC = Path(sys.executable).parent / "mpiexec"
M = 4 * (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10)  # float32 gradients, bytes


def test_host_bytes_and_limits():
    assert B.host_bytes(M, 2, 2) == M  # ring at P = 2: 2 (P-1)/P m = m
    assert B.host_bytes(M / 2, 2, 2, gather=True) == M / 2  # bf16 codes allgathered: half
    assert B.host_bytes(M, 4, 2) == M  # 2 hosts x 2 ranks: the hosts' ring
    assert B.host_bytes(M, 8, 4) == pytest.approx(1.5 * M)
    assert B.host_bytes(100, 4, 2, gather=True) == 200  # two ranks' codes to the other host
    assert B.host_bytes(M, 4, 1) == 0.0
    # 1 Gbit/s = 125 MB/s over 7.45 MB: 16.8 steps/s; 10 Gbit/s: ten times that
    assert B.limit_steps_per_s(1e9, M) == pytest.approx(125e6 / M) == pytest.approx(16.77, abs=0.01)
    assert B.limit_steps_per_s(10e9, M / 2) == pytest.approx(2 * 1250e6 / M)
    assert B.limit_steps_per_s(1e9, 0.0) is None


def test_link_counter_deltas_per_step():
    start = [LinkBytes(1000, 50), LinkBytes(20, 900)]
    stop = [LinkBytes(1000 + 10 * 700, 50 + 10 * 690), LinkBytes(20 + 10 * 695, 900 + 10 * 702)]
    d = B.link_per_step(start, stop, 10)
    assert d == {"sent": [700, 695], "received": [690, 702], "busiest": 702}
    assert stop[0] - start[0] == LinkBytes(7000, 6900)
    with pytest.raises(ValueError, match="backwards"):
        B.link_per_step(stop, start, 10)
    with pytest.raises(ValueError, match="steps"):
        B.link_per_step(start, stop, 0)


def test_spread():
    assert B.spread([2.0, 4.0, 3.0]) == {"median": 3.0, "min": 2.0, "max": 4.0, "spread": 2 / 3}


def _job() -> tuple[dict, dict]:
    """A bench_sync.py JSON of three modes at 2 x 1 (auto chose compressed) and the counter
    readings at its marks."""
    reps = lambda mode, steps_s, sent, sync=None: [
        {"step_s": s, "mark": f"{mode} {i}", "sync": sync or mode, "rank_bytes_per_step": [sent, 0]}
        for i, s in enumerate(steps_s)]
    job = {"world_size": 2, "steps": 4, "skipped": {"ps": "MpidpError: no such mode"},
           "modes": {"allreduce": {"bytes_per_step": M / 2, "comm_share": 0.5,
                                   "repeats": reps("allreduce", [0.2, 0.1, 0.25], M)},
                     "compressed": {"bytes_per_step": M / 4, "comm_share": 0.3,
                                    "repeats": reps("compressed", [0.1], M / 2)},
                     "auto": {"bytes_per_step": M / 4, "comm_share": 0.3,
                              "repeats": reps("auto", [0.1], M / 2, "compressed")}}}
    zero = [LinkBytes(0, 0), LinkBytes(0, 0)]
    marks = {}
    for mode, per_step in (("allreduce", [7.5e6, 7.6e6, 7.4e6]), ("compressed", [3.8e6]),
                           ("auto", [3.8e6])):
        for i, b in enumerate(per_step):
            n = int(b * 4)
            marks[f"{mode} {i}"] = {"start": zero, "stop": [LinkBytes(n, n - 8), LinkBytes(n - 8, n)]}
    return job, marks


def test_rows_from_a_job_and_its_marks():
    job, marks = _job()
    rows = B.rows_of(job, marks, 1e9, hosts=2)
    ar, cz, auto, ps = rows
    assert ar["steps_per_s"]["median"] == pytest.approx(5.0)  # 1 / 0.2
    assert ar["steps_per_s"]["min"] == pytest.approx(4.0) and ar["steps_per_s"]["max"] == 10.0
    # the most one rank sends counts (a node-aware reduction's leaders send, others not)
    assert ar["payload_bytes"] == M
    assert ar["expected_link_bytes"] == M and ar["limit_steps_per_s"] == pytest.approx(125e6 / M)
    assert ar["of_limit"] == pytest.approx(5.0 / (125e6 / M))
    assert ar["link_bytes_per_step"] == pytest.approx(7.5e6)  # median of the repeats' busiest
    assert cz["expected_link_bytes"] == M / 2 and cz["limit_steps_per_s"] == pytest.approx(250e6 / M)
    assert auto["sync"] == "compressed" and auto["expected_link_bytes"] == M / 2
    assert ps == {"rate_gbit": 1.0, "ranks": 2, "hosts": 2, "mode": "ps",
                  "skipped": "MpidpError: no such mode"}


def test_table_and_report():
    job, marks = _job()
    rows = B.rows_of(job, marks, 1e9, hosts=2)
    lines = B.table(rows)
    assert lines[0].count("|") == lines[1].count("|") == 9
    assert lines[2] == ("| 1 Gbit/s | 2 x 1 | allreduce | 5.00 ±60% | 16.77 | 30% | 7.50 | 7.45 |")
    assert lines[3].startswith("| 1 Gbit/s | 2 x 1 | compressed | 10.00 ±0% | 33.54 | 30% | 3.80 |")
    assert lines[4].startswith("| 1 Gbit/s | 2 x 1 | auto (compressed) | 10.00 ±0% | 33.54 |")
    assert lines[5] == "| 1 Gbit/s | 2 x 1 | ps | skipped: MpidpError: no such mode | | | | |"
    report = {"rows": rows, "probes": [{"rate_gbit": 1.0, "MB_per_s": 119.4}], "probe_mb": 50,
              "steps": 4, "warmup": 2, "repeats": 3, "seed": 0, "tbf": "1 Gbit/s: `tbf ...`",
              "blas": "BLAS: openblas", "job_env": [], "machine": "cpu", "cores": 2,
              "commit": "abc1234", "date": "today", "command": "python benchmarks/bench_network.py"}
    md = B.markdown(report)
    for part in ("| 1 Gbit/s | 2 x 1 | allreduce |", "1 Gbit/s: 119 MB/s", "share this machine's CPUs",
                 "BLAS: openblas", "commit abc1234", "`python benchmarks/bench_network.py`"):
        assert part in md, part


def test_token_bucket_arguments():
    one, ten = tbf_args(1e9), tbf_args(10e9)
    assert one[:3] == ["tbf", "rate", "1000000000bit"] and ten[2] == "10000000000bit"
    assert int(one[one.index("burst") + 1]) == 128 * 1024  # the floor: 400 us is only 50 KB
    assert int(ten[ten.index("burst") + 1]) == 500_000  # 400 us at 1.25 GB/s
    assert one[-2:] == ["latency", "5000us"]
    with pytest.raises(ValueError, match="rate"):
        tbf_args(0)


def test_marks_answer_each_line_after_reading(tmp_path):
    """The job's side of --marks (bench_sync.py) against the reader: every line waits for
    its reading, in order."""
    readings = iter(range(100))
    marks = B.Marks(tmp_path / "m", lambda: next(readings))
    got = []

    def job():
        with open(tmp_path / "m" / "req", "w", buffering=1) as req, open(tmp_path / "m" / "ack") as ack:
            for line in ("start a 0", "stop a 0", "start b 0", "stop b 0"):
                req.write(line + "\n")
                got.append(ack.readline())
    t = threading.Thread(target=job)
    t.start()
    t.join(timeout=10)
    marks.close()
    assert got == ["ok\n"] * 4
    assert marks.seen == {"a 0": {"start": 0, "stop": 1}, "b 0": {"start": 2, "stop": 3}}


def test_arguments_are_checked():
    assert B.parse_args(["--rates", "1,10"]).rates == [1e9, 10e9]
    assert B.parse_args(["--node-modes", ""]).node_modes == []
    for bad in (["--rates", "fast"], ["--rates", "0"], ["--steps", "0"], ["--job-env", "X"]):
        with pytest.raises(SystemExit):
            B.parse_args(bad)


def test_without_test_hosts_it_says_why_and_succeeds(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(B, "limits_available", lambda: "needs root (network namespaces)")
    assert B.main(["--results", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "bench-network skipped: needs root (network namespaces)\n"
    assert list(tmp_path.iterdir()) == []


needs_hosts = pytest.mark.skipif(limits_available() is not None, reason=str(limits_available()))


@needs_hosts
def test_rate_limit_limits_and_counters_count():
    n = 5_000_000
    with Cluster(2, rate_bits=100e6) as c:
        for dev in ([c.veths[0]], ["-n", c.names[0], "eth0"]):
            shown = subprocess.run(["tc", *dev[:-1], "qdisc", "show", "dev", dev[-1]],
                                   capture_output=True, text=True).stdout
            assert "tbf" in shown and "rate 100Mbit" in shown, shown
        before = c.link_bytes()
        seconds = c.transfer(0, 1, n)
        d0, d1 = (b - a for a, b in zip(before, c.link_bytes()))
        assert 0.7 * 12.5e6 < n / seconds < 1.1 * 12.5e6  # 100 Mbit/s = 12.5 MB/s
        # the payload plus headers, as many bytes into host 1 as out of host 0
        assert n <= d0.sent <= 1.08 * n and n <= d1.received <= 1.08 * n
        assert d0.received < 0.1 * n  # acknowledgements only
        c.limit(200e6)  # changed between runs
        assert 0.7 * 25e6 < n / c.transfer(1, 0, n) < 1.1 * 25e6
        c.limit(None)
        assert n / c.transfer(0, 1, n) > 3 * 25e6
        names = c.names
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
    assert not Path(f"/sys/class/net/{c.veths[0]}").exists() and not c.root.exists()


@needs_hosts
def test_bench_network_runs_and_its_bytes_add_up(tmp_path):
    """The whole benchmark, tiny: one rate, fused allreduce and the hand-written loop."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_network.py"), "--rates", "1",
                    "--steps", "3", "--warmup", "1", "--repeats", "1", "--probe-mb", "5",
                    "--modes", "allreduce,handwritten", "--node-modes", "",
                    "--results", str(tmp_path)], env=env, check=True, timeout=120,
                   stdout=subprocess.DEVNULL)
    report = json.loads((tmp_path / "network.json").read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"allreduce", "handwritten"}
    for r in rows.values():  # the counters saw the gradients cross, plus a few % of headers
        assert r["expected_link_bytes"] == pytest.approx(M, rel=1e-4)
        assert 1.0 <= r["link_bytes_per_step"] / r["expected_link_bytes"] < 1.08
        assert 0 < r["of_limit"] <= 1.05
    assert "| 1 Gbit/s | 2 x 1 | allreduce |" in (tmp_path / "network.md").read_text()



@pytest.mark.skipif(not MPIEXEC.exists(), reason="mpiexec not in the environment")
def test_bench_sync_times_only_the_modes_asked_in_seeded_orders(tmp_path):
    """bench_sync.py --only --shuffle --marks on 2 local ranks: each repeat runs every mode
    once, in the order drawn from the seed and the repeat, each between its two marks."""
    readings = iter(range(1000))
    marks = B.Marks(tmp_path / "m", lambda: next(readings))
    modes = ["handwritten", "allreduce", "compressed"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, str(ROOT / "benchmarks" / "bench_sync.py"),
                        "--only", "--modes", ",".join(modes), "--shuffle", "3", "--repeats", "3",
                        "--steps", "2", "--warmup", "1", "--n-samples", "2048",
                        "--marks", str(tmp_path / "m"), "--out", str(tmp_path / "s.json")],
                       env=env, check=True, timeout=120, stdout=subprocess.DEVNULL)
    finally:
        marks.close()
    want = []
    for r in range(3):
        order = list(modes)
        random.Random(f"3:{r}").shuffle(order)
        want += [f"{m} {r}" for m in order]
    assert list(marks.seen) == want and len(set(map(tuple, (want[:3], want[3:6], want[6:])))) > 1
    assert all(v["stop"] == v["start"] + 1 for v in marks.seen.values())
    res = json.loads((tmp_path / "s.json").read_text())
    assert set(res["modes"]) == set(modes) and res["skipped"] == {}
    assert all(len(m["repeats"]) == 3 for m in res["modes"].values())
    assert "paired_ratio_to_handwritten" not in res["modes"]["allreduce"]
    assert res["modes"]["handwritten"]["repeats"][0]["rank_bytes_per_step"] == [M + 8] * 2
