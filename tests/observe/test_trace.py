"""mpidp.observe.trace: the step window, the trace document's structure (one process per rank,
named tracks, no overlapping spans on a track, counts that match the steps run) and the
clock alignment, on 2 real ranks."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from helpers import ROOT, run_mpi
from tracecheck import overlaps

from mpidp.observe import trace as T


def test_window_keeps_only_steps_a_to_b_minus_1():
    tr = T.Tracer(0, "h", steps=(2, 4))
    with tr.span("setup", "init"):
        pass
    for k in range(6):
        tr.step = k
        with tr.span("fwd", "compute", samples=8):
            pass
        tr.add("allreduce", "comm", "comm", 1.0, 2.0, bytes=100)
    assert [(e[0], e[5]) for e in tr.events] == [("fwd", 2), ("allreduce", 2),
                                                 ("fwd", 3), ("allreduce", 3)]
    assert tr.events[0][8] == {"samples": 8} and tr.events[1][8] == {"bytes": 100}


def test_no_window_records_everything_with_epoch_and_step():
    tr = T.Tracer(1, "h")
    tr.add("pre", "init", "compute", 0.0, 0.1)
    tr.epoch, tr.step = 2, 7
    tr.add("fwd", "compute", "compute", 0.2, 0.3)
    assert [(e[5], e[6]) for e in tr.events] == [(-1, 0), (7, 2)]


@pytest.mark.parametrize("bad", ["5", "a:b", "3:3", "4:2", "-1:2"])
def test_parse_window_rejects_with_the_fix(bad):
    with pytest.raises(ValueError, match="A:B"):
        T.parse_window(bad)
    assert T.parse_window("10:20") == (10, 20) and T.parse_window(None) is None


def _part(rank, offset, events):
    return {"rank": rank, "host": f"node{rank}", "offset": offset, "uncertainty": 1e-6,
            "events": events}


def test_build_aligns_clocks_names_processes_and_tracks():
    # rank 1's clock runs 100 s ahead: its span at 100.5 is rank 0's 0.5
    ev0 = [("fwd", "compute", "compute", 0.5, 0.6, 0, 1, "m", None),
           ("ar", "comm", "comm", 0.6, 0.7, 0, 1, None, {"bytes": 8})]
    ev1 = [("recv", "comm", "comm", 100.65, 100.8, 0, 1, "m", None),
           ("ckpt", "io", "io", 100.9, 101.0, 0, 1, None, None)]
    doc = T.build([_part(0, 0.0, ev0), _part(1, 100.0, ev1)], window=(0, 1))
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    by = {e["name"]: e for e in spans}
    assert by["fwd"]["ts"] == 0.0 and by["recv"]["ts"] == pytest.approx(0.15e6)
    assert by["ar"]["args"] == {"epoch": 1, "step": 0, "bytes": 8}
    meta = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    names = {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "process_name"}
    assert names == {(0, "rank 0 (node0)"), (1, "rank 1 (node1)")}
    threads = {(e["pid"], e["tid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"}
    assert threads == {(0, 1, "compute"), (0, 2, "comm"), (1, 2, "comm"), (1, 5, "io")}
    flow = sorted((e["ph"], e["pid"]) for e in doc["traceEvents"] if e["ph"] in "sf")
    assert flow == [("f", 1), ("s", 0)]
    assert doc["otherData"]["steps"] == [0, 1]
    assert overlaps(doc) == []


def test_overlaps_finds_partial_overlap_but_accepts_nesting():
    nested = [("step", "c", "compute", 0.0, 1.0, 0, 0, None, None),
              ("fwd", "c", "compute", 0.1, 0.4, 0, 0, None, None),
              ("bwd", "c", "compute", 0.4, 0.9, 0, 0, None, None)]
    assert overlaps(T.build([_part(0, 0.0, nested)])) == []
    assert len(overlaps(T.build([_part(0, 0.0, nested)]), nested_ok=False)) == 2
    partial = nested + [("late", "c", "compute", 0.8, 1.2, 0, 0, None, None)]
    problems = overlaps(T.build([_part(0, 0.0, partial)]))
    assert len(problems) == 1 and "late" in problems[0]


def test_importing_trace_history_plot_starts_no_mpi():
    code = ("import sys, mpidp.observe.trace, mpidp.observe.history, mpidp.observe.plot; "
            "assert 'mpi4py' not in sys.modules, 'mpi4py imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr


SCRIPT = textwrap.dedent("""
    import socket, sys
    import numpy as np
    from mpidp import comm as C
    from mpidp.observe.trace import Tracer, write
    comm = C.world()
    tr = Tracer(comm.rank, socket.gethostname(), steps=(1, 4))
    buf = np.ones(1000, np.float32)
    for step in range(6):
        tr.step, tr.epoch = step, step // 3
        with tr.span("forward/backward", "compute", samples=16):
            np.dot(np.ones((50, 50)), np.ones((50, 50)))
        with tr.span("allreduce", "comm", "comm", bytes=buf.nbytes):
            C.allreduce_sum_(comm, buf)
        if comm.rank == 0:
            with tr.span("send", "comm", "comm", flow=("msg", step), bytes=8):
                C.send(comm, buf[:2], 1, 3)
        else:
            with tr.span("recv", "comm", "comm", flow=("msg", step), bytes=8):
                C.recv_(comm, buf[:2], 0, 3)
        if step % 3 == 2:  # end of an epoch: steps 2 (in the window) and 5 (after it)
            with tr.span("evaluate", "eval", "eval"):
                pass
    n = write(comm, tr, sys.argv[1])
    if comm.rank == 0:
        print("spans", n)
""")


@pytest.fixture(scope="module")
def two_rank_trace(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trace")
    script, out = tmp / "job.py", tmp / "sub" / "trace.json"
    script.write_text(SCRIPT)
    r = run_mpi(2, str(script), str(out), module=False, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text()), r.stdout


def test_trace_of_two_ranks_has_one_process_per_rank_and_counts_per_step(two_rank_trace):
    doc, stdout = two_rank_trace
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1}
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert names[0].startswith("rank 0 (") and names[1].startswith("rank 1 (")
    for pid in (0, 1):
        mine = [e for e in spans if e["pid"] == pid]
        steps = sorted(e["args"]["step"] for e in mine if e["name"] == "forward/backward")
        assert steps == [1, 2, 3]  # window 1:4 of 6 steps
        assert sum(e["name"] == "allreduce" for e in mine) == 3
        assert all(e["args"]["bytes"] == 4000 for e in mine if e["name"] == "allreduce")
        assert [e["args"]["step"] for e in mine if e["name"] == "evaluate"] == [2]
        assert {e["args"]["epoch"] for e in mine if e["name"] == "forward/backward"} == {0, 1}
    assert len(spans) == int(stdout.split("spans")[1]) == 2 * (3 * 3 + 1)
    assert overlaps(doc, nested_ok=False) == []
    assert sum(e["ph"] == "s" for e in doc["traceEvents"]) == 3


def test_trace_clocks_aligned_within_the_stated_uncertainty(two_rank_trace):
    doc, _ = two_rank_trace
    sync = doc["otherData"]["clock_sync"]
    assert sync["offsets_us"][0] == 0.0 and sync["uncertainty_us"][0] == 0.0
    # both ranks read the same system-wide monotonic clock: the true offset is 0, and the
    # estimate is off by at most half the shortest round trip
    assert abs(sync["offsets_us"][1]) <= sync["uncertainty_us"][1] + 1e-3
    assert 0 < sync["uncertainty_us"][1]
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    for step in (1, 2, 3):  # a receive cannot end before its send began
        send = next(e for e in spans if e["name"] == "send" and e["args"]["step"] == step)
        recv = next(e for e in spans if e["name"] == "recv" and e["args"]["step"] == step)
        assert recv["ts"] + recv["dur"] >= send["ts"] - sync["uncertainty_us"][1]
