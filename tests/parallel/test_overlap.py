"""Overlapped gradient sums: the bucket layout (pure), the strategy's settings, and real
jobs under ``mpiexec`` (each with a timeout) in which the communication path fails on one
rank: an exception, a killed process, a hang. Every one ends the whole job."""

from __future__ import annotations

import re
import textwrap
import time

import numpy as np
import pytest
from helpers import run_mpi

from mpidp.parallel.modes import PROGRESS
from mpidp.parallel.overlap import Overlapped, layer_buckets
from mpidp.parallel.sync import Sync


@pytest.mark.parametrize("bucket_bytes", [1, 8, 100, 10**9])
def test_buckets_tile_the_buffer_last_layers_first(bucket_bytes):
    ranges = [(0, 0), (0, 84), (84, 84), (84, 188), (188, 188), (188, 215)]  # gate, mlp
    size = 215 + 5  # the extras after the parameters
    buckets = layer_buckets(ranges, size, 8, bucket_bytes)
    assert buckets[0][2] == size and buckets[-1][1] == 0  # extras first; ends at 0
    assert all(a[1] == b[2] for a, b in zip(buckets, buckets[1:]))  # contiguous, no overlap
    assert all(lo < hi for _, lo, hi in buckets)  # none empty
    assert [b[0] for b in buckets] == sorted((b[0] for b in buckets), reverse=True)
    starts = {lo for lo, _ in ranges}
    assert all(lo in starts for _, lo, _ in buckets)  # whole layers
    if bucket_bytes <= 8:
        assert [b[0] for b in buckets] == [5, 3, 1]  # a bucket per layer with parameters
    if bucket_bytes == 10**9:
        assert buckets == [(0, 0, size)]


def test_settings_are_checked_and_named():
    from mpidp.parallel.auto import Auto
    from mpidp.parallel.compress import Compressed
    for make in (Overlapped, Auto, lambda b: Compressed(bucket_bytes=b)):
        for bad in (0, -1, 0.5, 1.5, float("nan"), float("inf"), 2.0**62, 10**400, "1", True,
                    None):
            with pytest.raises(Exception, match=r"bucket_bytes must be .*got " + re.escape(repr(bad))):
                make(bad)
        assert make(1e6).bucket_bytes == 1000000 and make(np.int64(7)).bucket_bytes == 7
    with pytest.raises(Exception, match="unknown overlap progress 'fast'"):
        Auto(progress="fast")
    with pytest.raises(Exception, match="unknown overlap progress 'fast'"):
        Overlapped(progress="fast")
    s = Overlapped(1 << 20)
    assert isinstance(s, Sync) and s.name == "overlapped" and s.progress in PROGRESS
    assert s.at_boundary() and s.reduced == 0


def test_make_sync_builds_this_strategy():
    from mpidp.parallel.modes import make_sync
    s = make_sync("overlapped", bucket_bytes=4096)
    assert type(s) is Overlapped and s.bucket_bytes == 4096



class _ScriptedSums:
    """Started sums whose completions are scripted: starting sum ``i`` completes the sums
    ``completes[i]`` (as the Testsome inside a real start can). ``wait_any`` stands for a
    blocking wait, which on a real job hangs when the other ranks wait on this one."""

    def __init__(self, completes: dict[int, list[int]]) -> None:
        self.completes, self.left, self.waits = completes, [], 0

    @property
    def live(self) -> int:
        return sum(self.left)

    def start(self, lo: int, hi: int) -> int:
        self.left.append(1)
        i = len(self.left) - 1
        for k in self.completes.get(i, []):
            self.left[k] = 0
        return i

    def advance(self) -> None:
        pass

    def done(self, i: int) -> bool:
        return self.left[i] == 0

    def wait_any(self) -> None:
        self.waits += 1
        raise AssertionError("blocked in a wait though the awaited sum was complete")


def test_a_sum_completed_while_others_start_counts_before_any_wait():
    """finish "forward": a sum that completes inside a later sum's start is complete when
    the strategy next decides whether to wait; else it would block on the later sums,
    which other ranks (waiting on this one in another trainer's sums) may never let
    complete."""
    from mpidp.parallel.overlap import _Stretch
    sync = Overlapped(256, finish="forward")
    sync.sums, sync.n, sync.apply = _ScriptedSums({1: [0]}), 100, None
    first, second = _Stretch(0, 50), _Stretch(50, 100)
    sync.stretches, sync.queue = [first, second], [first, second]
    sync._advance()  # starts both sums; starting the second completes the first
    assert first.index == 0 and second.index == 1  # both started: room in the window
    assert sync._arrived(first) and not sync._arrived(second)  # 0 ended in 1's start
    sync._complete(lambda: sync._arrived(first))  # must not wait
    assert sync.sums.waits == 0

# --- failures in the communication path, in real jobs ----------------------------------

JOB = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    from mpi4py import MPI
    import mpidp
    from mpidp import nn
    from mpidp.comm import progress
    from mpidp.parallel.overlap import Overlapped

    kind, comm = sys.argv[1], MPI.COMM_WORLD
    real, calls = progress._sum_in_place, [0]

    def faulty(c, buf):  # rank 1's communication thread fails in its 7th sum (step 3)
        calls[0] += 1
        if c.rank == 1 and calls[0] == 7:
            if kind == "raise":
                raise RuntimeError("injected failure in the communication thread")
            if kind == "kill":
                os.kill(os.getpid(), 9)
            if kind == "hang":
                time.sleep(3600)
        real(c, buf)

    progress._sum_in_place = faulty
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((160, 6)), rng.integers(0, 3, 160)
    rows = np.array_split(np.arange(160), comm.size)[comm.rank]
    shard = mpidp.shard_from_arrays(comm, X[rows], y[rows])
    model = nn.mlp(6, (12, 8), 3, dtype=np.float64).init_(4)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                            sync=Overlapped(200, progress="thread"),
                            watchdog=2.0 if kind == "hang" else None)
    mpidp.fit(dp, shard, 3, 16, seed=2)
    import threading
    left = [t.name for t in threading.enumerate() if t.name == "mpidp-overlapped"]
    print(f"rank {comm.rank} finished; communication threads left: {left}", flush=True)
""")


def _job(tmp_path, kind, timeout=60):
    script = tmp_path / "job.py"
    script.write_text(JOB)
    t = time.monotonic()
    r = run_mpi(2, str(script), kind, module=False, timeout=timeout)
    r.elapsed = time.monotonic() - t
    return r


def test_a_healthy_job_ends_with_no_thread_left(tmp_path):
    r = _job(tmp_path, "none")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("communication threads left: []") == 2, r.stdout


def test_an_exception_in_the_communication_thread_ends_the_job(tmp_path):
    r = _job(tmp_path, "raise")
    assert r.returncode != 0 and r.elapsed < 30, (r.returncode, r.elapsed)
    assert "rank 1/2 failed" in r.stderr, r.stderr[-2000:]
    assert "injected failure in the communication thread" in r.stderr
    assert "finished" not in r.stdout


def test_a_rank_killed_inside_the_communication_thread_ends_the_job(tmp_path):
    r = _job(tmp_path, "kill")
    assert r.returncode != 0 and r.elapsed < 30, (r.returncode, r.elapsed, r.stderr[-2000:])
    assert "finished" not in r.stdout


def test_a_communication_thread_that_hangs_is_ended_by_the_watchdog(tmp_path):
    r = _job(tmp_path, "hang", timeout=90)
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert "an Allreduce (on the communication thread)" in r.stderr, r.stderr[-2000:]
    assert r.elapsed < 45


ARGS = ["train", "--dataset", "synthetic", "--n-samples", "480", "--n-features", "8",
        "--dtype", "float64", "--epochs", "2", "--batch-size", "32", "--hidden", "12,8",
        "--no-progress", "--sync", "overlapped", "--bucket-mb", "0.0001"]


@pytest.mark.parametrize("fault", ["kill@1:3", "raise@0:4"])
def test_a_failed_rank_ends_an_overlapped_training_run(tmp_path, fault):
    t = time.monotonic()
    r = run_mpi(2, *ARGS, "--out", str(tmp_path / "out"), env={"MPIDP_FAULT": fault}, timeout=90)
    assert r.returncode != 0 and time.monotonic() - t < 30, (r.returncode, r.stderr[-2000:])
    assert not (tmp_path / "out" / "model.npz").exists()

