"""The watchdog's roll call itself: ranks whose roll calls overlap keep watching, a rank
that ends its watch during a roll call ends it without a verdict, a root's work for a
decision is judged as the work around it (excused, or computing), not as waiting in MPI, and
an MPI call in an excused span has its ten timeouts."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import run_mpi

# Rank 0 makes progress for 5 s; ranks 1 and 2 wait for it in MPI past the timeout, so
# both hold roll calls, answering each other's; rank 0 answers 0.3 s late, so they overlap.
OVERLAPPING = """\
import time
from mpi4py import MPI
from mpidp.comm.runtime import COMPUTING, IN_MPI, MARK
from mpidp.comm.watchdog import Watchdog
comm = MPI.COMM_WORLD
if comm.rank == 0:
    plain = Watchdog._answer
    def slow(self, listen, call, replies):
        if listen.Get_status():
            time.sleep(0.3)
        return plain(self, listen, call, replies)
    Watchdog._answer = slow
wd = Watchdog(comm, 1.0).start()
t0 = time.monotonic()
if comm.rank == 0:
    while time.monotonic() - t0 < 5:
        MARK.state, MARK.since = COMPUTING, time.monotonic()
        time.sleep(0.1)
else:
    MARK.state, MARK.since = IN_MPI, time.monotonic()
req = comm.Ibarrier()
while not req.Test():
    time.sleep(0.01)
MARK.state, MARK.since = COMPUTING, time.monotonic()
alive = comm.gather(wd._thread.is_alive())
wd.stop()
if comm.rank == 0:
    print("watchdogs alive", alive, flush=True)
"""

# Rank 1 has finished watching; rank 0 has waited past the timeout, so its roll call is
# under way (rank 1 will not answer) when its own run ends and stops the watch.
STOPPED_DURING = """\
import time
from mpi4py import MPI
from mpidp.comm.runtime import COMPUTING, IN_MPI, MARK
from mpidp.comm.watchdog import Watchdog
comm = MPI.COMM_WORLD
wd = Watchdog(comm, 1.0).start()
if comm.rank == 1:
    wd.stop()
    time.sleep(4)
else:
    MARK.state, MARK.since = IN_MPI, time.monotonic()
    time.sleep(1.5)
    MARK.state, MARK.since = COMPUTING, time.monotonic()
    t = time.monotonic()
    wd.stop()
    print(f"stop took {time.monotonic() - t:.2f}s", flush=True)
"""

# Rank 0 decides for 3 s, three timeouts: inside an excused span (loading the data) the
# others wait for it without a verdict; outside one, rank 0 is named, as computing.
ROOT_DECIDES = """\
import sys, time
from mpi4py import MPI
from mpidp.comm import excused, root_decides
from mpidp.comm.watchdog import Watchdog
comm = MPI.COMM_WORLD
wd = Watchdog(comm, 1.0).start()
def slow():
    time.sleep(3)
    return "decided"
if sys.argv[1] == "excused":
    with excused("loading the data"):
        print(root_decides(comm, slow), flush=True)
else:
    print(root_decides(comm, slow), flush=True)
wd.stop()
"""

# Every rank is in one MPI call for 3 s, three timeouts (a large transfer): inside an
# excused span it may last ten timeouts; outside one, the collectives look mismatched.
SPANNED_CALL = """\
import sys, time
from mpi4py import MPI
from mpidp.comm import excused
from mpidp.comm.runtime import watched
from mpidp.comm.watchdog import Watchdog
comm = MPI.COMM_WORLD
wd = Watchdog(comm, 1.0).start()
@watched("a long transfer")
def transfer():
    time.sleep(3)
    return comm.allreduce(1)
if sys.argv[1] == "excused":
    with excused("loading the data"):
        print(f"transferred {transfer()}", flush=True)
else:
    print(f"transferred {transfer()}", flush=True)
wd.stop()
"""

@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict:
    """Both scripts' jobs, run side by side (each mostly waits): name -> future of its result."""
    def run(name, ranks, text, *args):
        script = tmp_path_factory.mktemp(name) / f"{name}.py"
        script.write_text(text)
        return run_mpi(ranks, str(script), *args, module=False, timeout=60)

    with ThreadPoolExecutor(6) as pool:
        yield {"overlap": pool.submit(run, "overlap", 3, OVERLAPPING),
               "stop": pool.submit(run, "stop", 2, STOPPED_DURING),
               "excused": pool.submit(run, "excused", 2, ROOT_DECIDES, "excused"),
               "computing": pool.submit(run, "computing", 2, ROOT_DECIDES, "computing"),
               "spanned": pool.submit(run, "spanned", 2, SPANNED_CALL, "excused"),
               "mismatched": pool.submit(run, "mismatched", 2, SPANNED_CALL, "plain")}


def test_overlapping_roll_calls_leave_every_watchdog_running(ran):
    r = ran["overlap"].result()
    assert r.returncode == 0, r.stderr[-2000:]
    assert "watchdogs alive [True, True, True]" in r.stdout, (r.stdout, r.stderr[-2000:])
    assert "stalled" not in r.stderr, r.stderr[-2000:]


def test_stopping_during_a_roll_call_ends_it_without_a_verdict(ran):
    r = ran["stop"].result()
    assert r.returncode == 0 and "stalled" not in r.stderr, (r.returncode, r.stderr[-2000:])
    took = float(re.search(r"stop took ([0-9.]+)s", r.stdout).group(1))
    assert took < 1.0, took  # not the grace (6 s) spent waiting for rank 1


def test_a_root_deciding_in_an_excused_span_is_waited_for(ran):
    """Rank 0 reading a file for every rank while the data load: ten timeouts allowed."""
    r = ran["excused"].result()
    assert r.returncode == 0 and "stalled" not in r.stderr, (r.returncode, r.stderr[-2000:])
    assert r.stdout.count("decided") == 2, r.stdout


def test_a_root_deciding_for_too_long_is_named_as_computing(ran):
    r = ran["computing"].result()
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert "stalled rank(s) [0]" in r.stderr and "rank 0: computing" in r.stderr, r.stderr[-2000:]


def test_an_mpi_call_in_an_excused_span_may_outlast_the_timeout(ran):
    r = ran["spanned"].result()
    assert r.returncode == 0 and "stalled" not in r.stderr, (r.returncode, r.stderr[-2000:])
    assert r.stdout.count("transferred 2") == 2, r.stdout


def test_every_rank_waiting_in_mpi_past_the_timeout_ends_the_job(ran):
    """Outside an excused span, the same call is a mismatch: every rank's call is named."""
    r = ran["mismatched"].result()
    assert r.returncode == 3, (r.returncode, r.stderr[-2000:])
    assert "every rank has waited in MPI for over 1.0s" in r.stderr, r.stderr[-2000:]
    assert r.stderr.count("waiting in MPI in a long transfer") >= 2, r.stderr[-2000:]
