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

import numpy as np
import pytest
from helpers import ROOT

import benchmarks.bench_network as B
from benchmarks.cluster import Cluster, LinkBytes, limits_available, tbf_args

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
                              "repeats": reps("auto", [0.1], M / 2, "compressed")},
                     "compute-only": {"bytes_per_step": 0.0, "comm_share": 0.0,
                                      "repeats": reps("compute-only", [0.09, 0.05, 0.07], 0.0)}}}
    zero = [LinkBytes(0, 0), LinkBytes(0, 0)]
    marks = {}
    for mode, per_step in (("allreduce", [7.5e6, 7.6e6, 7.4e6]), ("compressed", [3.8e6]),
                           ("auto", [3.8e6]), ("compute-only", [1e3, 1e3, 1e3])):
        for i, b in enumerate(per_step):
            n = int(b * 4)
            marks[f"{mode} {i}"] = {"start": zero, "stop": [LinkBytes(n, n - 8), LinkBytes(n - 8, n)]}
    return job, marks


def test_rows_from_a_job_and_its_marks():
    job, marks = _job()
    rows = B.rows_of(job, marks, 1e9, hosts=2)
    ar, cz, auto, ps = rows  # compute-only is the model's input, not a row
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


def test_an_auto_row_that_chose_differently_is_named_after_its_usual_choice():
    job, marks = _job()
    picks = ["overlapped", "compressed", "compressed"]
    job["modes"]["auto"]["repeats"] = [
        {"step_s": 0.1, "mark": f"auto {i}", "sync": p,
         "rank_bytes_per_step": [M / 2 if p == "compressed" else M, 0]}
        for i, p in enumerate(picks)]
    for i in range(3):
        marks[f"auto {i}"] = marks["auto 0"]
    auto = next(r for r in B.rows_of(job, marks, 1e9, hosts=2) if r["mode"] == "auto")
    assert auto["sync"] == "compressed" and auto["chosen"] == {"compressed": 2, "overlapped": 1}
    assert auto["expected_link_bytes"] == M / 2  # compressed's, the usual choice
    line = next(x for x in B.table([auto]) if "auto" in x)
    assert "auto (compressed 2/3, overlapped 1/3)" in line


FIT = {"alpha": 50e-6, "beta": 8e-9, "gamma": 3e-11}  # s, s/B, s/B
LOCAL = {"m": M, "batch": 256, "reps": 7, "bucket_bytes": 1 << 20, "first_bucket_layer": 2,
         "forward_s": 0.02, "backward_s": 0.04, "update_s": 0.001, "backward": 0.6,
         "first_bucket": 0.7, "codec_s": 0.006, "codec_share": 0.1, "codec_how": "Codec",
         "gamma": 3e-11, "cpu_per_byte": 5e-10}


def _ring(P: int, m: float) -> float:
    """A ring allreduce of ``m`` bytes over ``P`` ranks on FIT, by hand."""
    return 2 * (P - 1) * 50e-6 + 2 * (P - 1) / P * m * 8e-9 + (P - 1) / P * m * 3e-11


def _row(mode: str, ranks: int, steps_per_s: float, sync: str | None = None) -> dict:
    return {"rate_gbit": 1.0, "ranks": ranks, "hosts": 2, "mode": mode, "sync": sync or mode,
            "steps_per_s": {"median": steps_per_s, "min": steps_per_s, "max": steps_per_s,
                            "spread": 0.0}}


def test_each_mode_is_compared_with_the_loop_repeat_by_repeat():
    job, marks = _job()
    # repeat r of every mode ran in the same pass: the loop fast in pass 1, slow in pass 2
    job["modes"]["handwritten"] = {"bytes_per_step": M / 2, "comm_share": 0.5, "repeats": [
        {"step_s": s, "mark": f"allreduce {i}", "sync": "handwritten", "rank_bytes_per_step": [M, 0]}
        for i, s in enumerate([0.2, 0.08, 0.3])]}
    rows = {r["mode"]: r for r in B.rows_of(job, marks, 1e9, hosts=2)}
    x = rows["allreduce"]["vs_loop"]  # allreduce took 0.2, 0.1, 0.25 s per step
    assert (x["min"], x["median"], x["max"]) == pytest.approx((0.8, 1.0, 1.2))
    # the ratio of the medians would say 5.0 / 5.0 = 1 too, but not the range; one repeat
    # of compressed beside three of the loop cannot be paired: no ratio
    assert rows["compressed"]["vs_loop"] is None
    assert rows["handwritten"]["vs_loop"]["median"] == 1.0
    lines = B.table(list(rows.values()))
    assert "| allreduce | 5.00 ±60% | 1.00 (0.80-1.20) |" in lines[2]
    assert "| handwritten | 5.00 ±" in lines[-2] and " | 1 | " in lines[-2]


def test_compute_input_is_the_median_of_the_compute_only_repeats():
    job, _ = _job()
    assert B.compute_seconds(job) == pytest.approx(0.07)
    del job["modes"]["compute-only"]
    assert B.compute_seconds(job) is None


def test_link_fit_recovers_alpha_and_beta_from_pingpong_times():
    pp = {m: 40e-6 + m * 8.5e-9 for m in B.PING_SIZES}
    fit = B.link_fit(pp, gamma=2e-11)
    # alpha: the small messages' mean (their bytes count a little); beta: the large ones' slope
    assert fit["alpha"] == pytest.approx(40e-6 + 8.5e-9 * (8 + 512 + 4096) / 3)
    assert fit["beta"] == pytest.approx(8.5e-9, rel=1e-3) and fit["gamma"] == 2e-11


def test_predictions_against_a_hand_computation():
    c1, c2 = 0.07, 0.05  # compute at 2 x 1 and 2 x 2
    rows = [_row("allreduce", 2, 7.0), _row("handwritten", 2, 8.0), _row("overlapped", 2, 9.0),
            _row("compressed", 2, 10.0), _row("auto", 2, 9.0, "overlapped"),
            _row("allreduce-flat", 4, 6.0), _row("allreduce-node", 4, 7.0),
            _row("per-layer", 2, 8.0), {"rate_gbit": 1.0, "ranks": 2, "hosts": 2, "mode": "ps",
                                        "skipped": "no such mode"}]
    got = B.with_predictions(rows, FIT, {1: c1, 2: c2}, LOCAL)
    ar, hw, ov, cz, auto, flat, node, pl, ps = got
    t_ar = c1 + 2 * 50e-6 + M * 8e-9 + M / 2 * 3e-11
    assert _ring(2, M) == pytest.approx(t_ar - c1)
    b = 0.6 * c1  # backward; the exchange starts 70% into it and outlasts the rest of it
    t_ov = 0.4 * c1 + max(b + 5e-10 * M, 0.7 * b + t_ar - c1)
    assert t_ov == pytest.approx(0.4 * c1 + 0.7 * b + _ring(2, M))
    # compressed: half the bytes, overlapped alike, plus the codec's share of the compute
    t_cz = 0.4 * c1 + max(b + 5e-10 * M / 2, 0.7 * b + _ring(2, M / 2)) + 0.1 * c1
    assert t_cz == pytest.approx(0.4 * c1 + 0.7 * b + _ring(2, M / 2) + 0.1 * c1)  # the wire's
    t_flat = c2 + 6 * 50e-6 + 1.5 * M * 8e-9 + 0.75 * M * 3e-11  # a ring of 4 ranks
    t_node = c2 + _ring(2, M)  # a ring of the 2 hosts' leaders
    for row, mode, t, measured in ((ar, "allreduce", t_ar, 7.0), (hw, "allreduce", t_ar, 8.0),
                                   (ov, "overlapped", t_ov, 9.0), (cz, "compressed", t_cz, 10.0),
                                   (auto, "overlapped", t_ov, 9.0), (flat, "allreduce", t_flat, 6.0),
                                   (node, "node-aware", t_node, 7.0)):
        assert row["model_mode"] == mode, row["mode"]
        assert row["predicted_steps_per_s"] == pytest.approx(1 / t), row["mode"]
        assert row["prediction_error"] == pytest.approx(1 / t / measured - 1), row["mode"]
    assert 1 / t_ar == pytest.approx(7.70, abs=0.01)  # 129.8 ms a step
    # the sign: a prediction above the measurement is positive, below it negative
    assert ar["prediction_error"] == pytest.approx(7.70 / 7.0 - 1, abs=2e-3) and ar["prediction_error"] > 0
    assert hw["prediction_error"] == pytest.approx(7.70 / 8.0 - 1, abs=2e-3) and hw["prediction_error"] < 0
    assert pl["model_mode"] is pl["predicted_steps_per_s"] is pl["prediction_error"] is None
    assert ps == rows[-1]  # skipped rows as they were
    assert ar["steps_per_s"] == rows[0]["steps_per_s"] and "model_mode" not in rows[0]
    # no compute-only measurement at a layout: no prediction there
    none = B.with_predictions(rows[:1], FIT, {2: c2}, LOCAL)[0]
    assert none["predicted_steps_per_s"] is None and none["prediction_error"] is None


def test_table_and_report():
    job, marks = _job()
    rows = B.rows_of(job, marks, 1e9, hosts=2)
    lines = B.table(rows)
    assert lines[0].count("|") == lines[1].count("|") == 12
    assert "| x loop (range) | predicted steps/s | error |" in lines[0]
    assert lines[2] == "| 1 Gbit/s | 2 x 1 | allreduce | 5.00 ±60% | – | – | – | 16.77 | 30% | 7.50 | 7.45 |"
    lines = B.table(B.with_predictions(rows, FIT, {1: B.compute_seconds(job)}, LOCAL))
    t_ar = 0.07 + _ring(2, M)  # compute 70 ms; compressed: backward 42 ms, codec 7 ms
    t_cz = 0.028 + 0.7 * 0.042 + _ring(2, M / 2) + 0.007
    assert f"{1 / t_ar:.2f} | {1 / t_ar / 5 - 1:+.0%}" == "7.70 | +54%"
    assert f"{1 / t_cz:.2f} | {1 / t_cz / 10 - 1:+.0%}" == "10.60 | +6%"
    assert lines[2] == ("| 1 Gbit/s | 2 x 1 | allreduce | 5.00 ±60% | – | 7.70 | +54% | 16.77 "
                        "| 30% | 7.50 | 7.45 |")
    assert lines[3].startswith("| 1 Gbit/s | 2 x 1 | compressed | 10.00 ±0% | – | 10.60 | +6% "
                               "| 33.54 | 30% | 3.80 |")
    assert lines[4].startswith("| 1 Gbit/s | 2 x 1 | auto (compressed) | 10.00 ±0% | – | 10.60 "
                               "| +6% |")
    assert lines[5] == "| 1 Gbit/s | 2 x 1 | ps | skipped: MpidpError: no such mode | | | | | | | |"
    assert all(line.count("|") == 12 for line in lines)
    report = {"rows": rows, "probes": [{"rate_gbit": 1.0, "MB_per_s": 119.4}], "probe_mb": 50,
              "steps": 4, "warmup": 2, "repeats": 3, "seed": 0, "tbf": "1 Gbit/s: `tbf ...`",
              "blas": "BLAS: openblas", "job_env": [], "machine": "cpu", "cores": 2,
              "commit": "abc1234", "date": "today", "command": "python benchmarks/bench_network.py"}
    md = B.markdown(report)
    for part in ("| 1 Gbit/s | 2 x 1 | allreduce |", "1 Gbit/s: 119 MB/s", "share this machine's CPUs",
                 "BLAS: openblas", "commit abc1234", "`python benchmarks/bench_network.py`"):
        assert part in md, part
    assert "mode_step_time" not in md  # no model inputs: no notes about them
    assert "MTU 1500 bytes" in md and "MTU 65535 bytes" in B.markdown({**report, "mtu": 65535})
    report["model"] = {"local": LOCAL, "links": [{"rate_gbit": 1.0, "fit": FIT, "compute": {1: 0.07, 2: 0.05},
                                                  "pingpong": {}}]}
    md = B.markdown(report)
    for part in ("`mpidp.scale.costmodel.mode_step_time`", "error: predicted / measured - 1",
                 "at 1 Gbit/s: alpha 50 us, beta 8.00 ns/B (125 MB/s)", "`mpidp.comm.exchange_time`",
                 "compute 70.0 ms per step at 2 x 1, 50.0 ms per step at 2 x 2", "`compute-only`",
                 "backward 60% of forward + backward + update (20.0 + 40.0 + 1.0 ms)",
                 "first bucket (1 MiB, from layer 2 on", "final after 70% of backward",
                 "codec: one rank's CPU work at P = 2 (Codec), 6.0 ms", "10% of the step's time",
                 "gamma 0.030 ns/B"):
        assert part in md, part
    assert "the last bucket" not in md and "node-aware adds" not in md  # not measured: not said
    report["model"]["local"] = {**LOCAL, "last_bucket": 0.43}
    report["model"]["links"][0]["node"] = {"node_s": 0.0009, "whole_s": 0.0037, "leaders_s": 0.0028,
                                           "ranks": 4, "per_node": 2}
    md = B.markdown(report)
    for part in ("the first layer's gradients (43% of them)", "median of the repeats; node-aware "
                 "adds 0.9 ms", "at 2 x 2 on the hosts at this rate (3.7 ms",
                 "the leaders' exchange inside each (2.8 ms), medians (`--node-inputs`)."):
        assert part in md, part


def test_local_inputs_are_measured_in_a_process_of_their_own(tmp_path):
    """``--local-inputs``: the standard MLP's parts, the first bucket and the codec, timed."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "benchmarks.bench_network", "--local-inputs",
                    str(tmp_path / "l.json")], env=env, check=True, timeout=120)
    got = json.loads((tmp_path / "l.json").read_text())
    assert got["m"] == M and got["batch"] == 256 and got["bucket_bytes"] == 1 << 20
    # 784-1024-1024-10 (Dense, ReLU, Dense, ReLU, Dense): 1 MiB closes at the middle Dense
    assert got["first_bucket_layer"] == 2
    assert got["last_bucket"] == pytest.approx((784 * 1024 + 1024) / (M / 4))  # the first Dense
    # the middle Dense announces its gradients before its input gradient: well before the end
    assert 0.3 < got["backward"] < 0.9 and 0.1 < got["first_bucket"] < 0.8
    assert got["forward_s"] > 0 and got["update_s"] > 0 and got["codec_s"] > 0
    assert got["codec_share"] == pytest.approx(got["codec_s"] / (got["forward_s"] + got["backward_s"]
                                                                  + got["update_s"]), rel=0.8)
    assert got["codec_how"].startswith("codecs.Codec") and 0 < got["gamma"] < 1e-8


@pytest.mark.slow
def test_node_inputs_time_the_in_node_share_on_the_hosts_layout(tmp_path):
    """``--node-inputs``: 4 ranks here in nodes of 2 (as on the test hosts), node-aware
    reductions timed whole and their leaders' exchanges inside them."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MPIDP_RANKS_PER_NODE": "2"}
    subprocess.run([MPIEXEC, "-n", "4", sys.executable, "-m", "benchmarks.bench_network",
                    "--node-inputs", str(tmp_path / "node.json")], env=env, check=True, timeout=120,
                   stdin=subprocess.DEVNULL)
    got = json.loads((tmp_path / "node.json").read_text())
    assert got["ranks"] == 4 and got["per_node"] == 2 and got["leaders_s"] > 0
    # per repeat the slowest rank's time holds a leader's exchange: the medians keep that
    assert got["whole_s"] >= got["leaders_s"] and 0 <= got["node_s"] <= got["whole_s"]


@pytest.mark.parametrize("codec", ["bfloat16", "int8"])
def test_codec_work_is_a_compressed_step_of_one_rank(codec):
    """What the codec timing runs: this rank's codes of gradient + residual, its chunk
    summed from every rank's codes and encoded again, every code decoded; checked against
    the reference codec segment by segment from the same start."""
    from mpidp.parallel import codecs as Z
    n = 3 * Z.BLOCK + 1001
    kernel, how = B.codec_work(n, codec=codec)
    assert how.startswith("codecs.Codec")
    v = dict(zip(kernel.__code__.co_freevars, (c.cell_contents for c in kernel.__closure__)))
    g0, h = v["g"].copy(), -(-n // 2)
    kernel()
    mine = np.empty(n, np.float32)  # what this rank's own codes decode to
    for lo, hi in ((0, h), (h, n)):  # the two chunks, each encoded in blocks from its start
        for a, b, _, _ in Z.segments(lo, hi, 0, codec):
            mine[a:b] = Z.decode(Z.encode(g0[a:b], codec), codec, b - a)
    want = mine.copy()
    for a, b, ca, cb in Z.segments(0, h, 0, codec):  # chunk 0: rank order, encoded again
        total = mine[a:b] + Z.decode(v["recv"][ca:cb], codec, b - a)
        want[a:b] = Z.decode(Z.encode(total, codec), codec, b - a)
        assert np.array_equal(v["cnxt"][a:b], total - want[a:b])
    assert np.array_equal(v["g"], want)
    assert np.array_equal(v["nxt"], g0 - mine)  # the residual of this rank's encoding


def test_token_bucket_arguments():
    one, ten = tbf_args(1e9), tbf_args(10e9)
    assert one[:3] == ["tbf", "rate", "1000000000bit"] and ten[2] == "10000000000bit"
    assert int(one[one.index("burst") + 1]) == 128 * 1024  # the floor: 400 us is only 50 KB
    assert int(ten[ten.index("burst") + 1]) == 500_000  # 400 us at 1.25 GB/s
    assert one[-2:] == ["latency", "5000us"]
    for bad in (0, 0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="rate must be a finite number of bits/s >= 1"):
            tbf_args(bad)


def test_clusters_of_one_process_have_names_of_their_own_and_a_bad_call_gets_a_usage():
    from benchmarks import cluster
    a, b = Cluster(2), Cluster(2)  # nothing is made before entering
    assert a.bridge != b.bridge and set(a.names).isdisjoint(b.names) and a.ips != b.ips
    for argv in ([], ["two", "--", "x"], ["2", "x"], ["2", "--"]):
        assert cluster.main(argv) == 2


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
    assert B.parse_args([]).mtu is None and B.parse_args(["--mtu", "65535"]).mtu == 65535
    assert B.parse_args(["--modes", " allreduce, handwritten "]).modes == ["allreduce", "handwritten"]
    for bad in (["--rates", "fast"], ["--rates", "0"], ["--steps", "0"], ["--job-env", "X"],
                ["--mtu", "67"], ["--mtu", "65536"], ["--mtu", "jumbo"], ["--rates", "nan"],
                ["--rates", "inf"], ["--rates", "1e-10"], ["--timeout", "0"], ["--timeout", "nan"],
                ["--probe-mb", "0"], ["--probe-mb", "-1"], ["--probe-mb", "1e-7"],
                ["--rates", "1,1"], ["--rates", "1,1.0000001"], ["--modes", "bogus"],
                ["--node-modes", "allreduce-node,bogus"], ["--modes", "allreduce,allreduce"],
                ["--modes", "compute-only"], ["--placement", "cyclic", "--node-modes", ""]):
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
        c.set_mtu(9000)  # every end of every host's link, and the bridge
        for args in (["link", "show", c.veths[1]], ["-n", c.names[1], "link", "show", "eth0"],
                     ["link", "show", c.bridge]):
            shown = subprocess.run(["ip", *args], capture_output=True, text=True).stdout
            assert " mtu 9000 " in shown, shown
        assert n / c.transfer(1, 0, n) > 3 * 25e6  # still carries
        with pytest.raises(ValueError, match="MTU"):
            c.set_mtu(70000)
        names = c.names
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in names)
    assert not Path(f"/sys/class/net/{c.veths[0]}").exists() and not c.root.exists()


@needs_hosts
def test_a_cluster_whose_network_is_taken_moves_to_a_free_one():
    with Cluster(2) as a:
        b = Cluster(2)
        b._set_net(a.net)  # as if its process number matched a's modulo 250
        with b:
            assert b.gateway != a.gateway and b.ips[0] != a.ips[0]
            assert a.transfer(0, 1, 10**6) > 0 and b.transfer(1, 0, 10**6) > 0
        assert Path(f"/sys/class/net/{a.bridge}").exists()  # b's end left a's alone


@needs_hosts
def test_bench_network_runs_and_its_bytes_add_up(tmp_path):
    """The whole benchmark, tiny: one rate, fused allreduce and the hand-written loop."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, "-m", "benchmarks.bench_network", "--rates", "1",
                    "--steps", "3", "--warmup", "1", "--repeats", "1", "--probe-mb", "5",
                    "--modes", "allreduce,handwritten", "--node-modes", "",
                    "--results", str(tmp_path)], env=env, check=True, timeout=120,
                   stdout=subprocess.DEVNULL)
    report = json.loads((tmp_path / "network.json").read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"allreduce", "handwritten"}  # compute-only ran, as an input
    for r in rows.values():  # the counters saw the gradients cross, plus a few % of headers
        assert r["expected_link_bytes"] == pytest.approx(M, rel=1e-4)
        assert 1.0 <= r["link_bytes_per_step"] / r["expected_link_bytes"] < 1.08
        assert 0 < r["of_limit"] <= 1.05
        assert r["model_mode"] == "allreduce" and r["predicted_steps_per_s"] > 0
        assert r["prediction_error"] == pytest.approx(
            r["predicted_steps_per_s"] / r["steps_per_s"]["median"] - 1)
    (link,) = report["model"]["links"]
    assert 6e-9 < link["fit"]["beta"] < 20e-9  # 1 Gbit/s: 8 ns/B, with headers and TCP's pace
    assert 0 < link["fit"]["alpha"] < 5e-3 and set(link["compute"]) == {"1"}
    # compute alone is faster than a step that also sends 7.45 MB over 1 Gbit/s
    assert link["compute"]["1"] < 1 / rows["allreduce"]["steps_per_s"]["median"]
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
        subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "benchmarks.bench_sync",
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


@needs_hosts
def test_node_inputs_are_measured_on_the_test_hosts_at_the_rate_set(tmp_path):
    """The model's in-node share of a node-aware reduction, measured with 2 ranks on each
    test host over their limited link: the leaders' exchange inside takes the link's time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    with Cluster(2) as c:
        c.limit(1e9)
        got = B.measure_node_on_hosts(c, env, tmp_path, "node", timeout=120)
    assert got["ranks"] == 4 and got["per_node"] == 2  # the hosts are the nodes
    # the leaders send the 7.45 MB gradient each way at most at the 1 Gbit/s wire's speed
    assert got["leaders_s"] > M / 125e6
    assert got["whole_s"] >= got["leaders_s"] and 0 <= got["node_s"] <= got["whole_s"] - M / 125e6
