"""Ranks on different hosts that talk over a real (veth + bridge, TCP) network.

The hosts are network namespaces made by benchmarks/cluster.py; these tests need root
and iproute2 and skip with the reason otherwise. CI runs them (.ci/run installs iproute2).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "multihost"))
from helpers import ROOT, mpiexec, run_mpi  # noqa: E402

from benchmarks.cluster import Cluster, available  # noqa: E402


def _hydra() -> bool:
    """The test hosts are driven through MPICH's launcher (Hydra's host and interface
    options); Open MPI's launcher takes others."""
    import subprocess
    out = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True).stdout
    return "HYDRA" in out


pytestmark = [pytest.mark.skipif(available() is not None, reason=str(available())),
              pytest.mark.skipif(not _hydra(), reason="the multi-host tests drive MPICH's "
                                 "Hydra launcher")]
PY = sys.executable
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
ARGS = ["-m", "mpidp", "train", "--epochs", "2", "--batch-size", "16", "--dtype", "float64",
        "--hidden", "8", "--optimizer", "adam", "--lr", "0.01", "--no-progress"]


@pytest.fixture(scope="module")
def cluster():
    with Cluster(2) as c:
        yield c


def _run(cmd, timeout=120):
    r = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    return r


def _params(out):
    return np.load(Path(out) / "model.npz")["params"]


def test_ranks_see_separate_hosts_and_traffic_takes_tcp(cluster):
    r = _run(cluster.mpiexec(2, 1, "-genv", "UCX_PROTO_INFO", "y", PY,
                             str(ROOT / "tests/multihost/latency.py")))
    assert r.returncode == 0, r.stderr
    tcp = json.loads(r.stdout.strip().splitlines()[-1])
    assert tcp["hosts"] == sorted(cluster.names)  # one rank per host, each its own hostname
    report = r.stdout + r.stderr  # UCX's own table of the transports each protocol uses
    assert "tcp/eth0" in report and not any(t in report for t in ("posix/", "sysv/", "cma/"))
    local = json.loads(run_mpi(2, str(ROOT / "tests/multihost/latency.py"), module=False).stdout)
    # 16 MB through veth, a bridge and TCP is measurably slower than shared memory (~3x here)
    assert tcp["16000000"] > 1.5 * local["16000000"], (tcp, local)


@pytest.fixture(scope="module")
def dataset(cluster, tmp_path_factory):
    """The same .npz file, in the reference folder and (for now) on host 0 only."""
    rng = np.random.default_rng(0)
    ref = tmp_path_factory.mktemp("ref") / "d.npz"
    np.savez(ref, X=rng.standard_normal((150, 5)), y=rng.integers(0, 3, 150))
    shutil.copy(ref, cluster.host_dir(0) / "d.npz")
    single = tmp_path_factory.mktemp("single")
    r = run_mpi(1, *ARGS[2:], "--dataset", str(ref), "--out", str(single))
    assert r.returncode == 0, r.stderr
    return _params(single)


@pytest.mark.parametrize("n,per_host", [(2, 1)])
def test_scatter_across_hosts_when_only_rank_0s_host_has_the_file(cluster, dataset, n, per_host):
    """One rank per host; two per host: test_node_aware_allreduce_across_hosts[4-2]."""
    assert not (cluster.host_dir(1) / "d.npz").exists()
    out = cluster.root / f"scatter{n}"
    r = _run(cluster.mpiexec(n, per_host, PY, *ARGS, "--dataset", str(cluster.data / "d.npz"),
                             "--distribute", "scatter", "--out", str(out)))
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(_params(out), dataset, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("n,per_host", [(2, 1), (4, 2), (3, 2)])
def test_parameter_server_across_hosts(cluster, dataset, n, per_host):
    """One rank per host: the server sends by MPI. Two (or two and one): each host sums its
    gradients in shared memory, the host leaders reduce over TCP, the server ships each
    updated piece to the other leader (Ibcast), whose host copies it from its memory.
    Every layout trains exactly as one process does, with the update shipped in pieces."""
    out = cluster.root / f"ps{n}"
    r = _run(cluster.mpiexec(n, per_host, PY, *ARGS, "--dataset", str(cluster.data / "d.npz"),
                             "--distribute", "scatter", "--sync", "ps", "--ps-chunk-mb", "0.0002",
                             "--out", str(out)))  # 209-byte pieces: the model ships in several
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(_params(out), dataset, rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("n,per_host", [(4, 2), (3, 2)])
def test_node_aware_allreduce_across_hosts(cluster, dataset, n, per_host):
    """Two ranks on a host: the default allreduce sums each host's gradients in shared
    memory and only the host leaders talk over TCP; exactly one process' model, as is the
    flat allreduce it replaces (``--node-aware off``). The data are scattered from rank 0's
    host, the only one with the file: the default run is the scatter test's at 4 ranks."""
    assert not (cluster.host_dir(1) / "d.npz").exists()
    for mode in ("auto", "off"):
        out = cluster.root / f"node-aware-{mode}{n}"
        r = _run(cluster.mpiexec(n, per_host, PY, *ARGS, "--dataset", str(cluster.data / "d.npz"),
                                 "--distribute", "scatter", "--node-aware", mode, "--out", str(out)))
        assert r.returncode == 0, r.stderr[-3000:]
        said = "node-aware reduction: 2 node(s), up to 2 ranks each" in r.stdout
        assert said == (mode == "auto"), r.stdout
        np.testing.assert_allclose(_params(out), dataset, rtol=1e-9, atol=1e-11)


def test_local_reads_need_and_use_each_hosts_own_copy(cluster, dataset):
    out = cluster.root / "local"
    cmd = cluster.mpiexec(4, 2, PY, *ARGS, "--dataset", str(cluster.data / "d.npz"),
                          "--distribute", "local", "--out", str(out))
    (cluster.host_dir(1) / "d.npz").unlink(missing_ok=True)
    r = _run(cmd)
    assert r.returncode == 2 and "dataset not found" in r.stderr  # host 1 has no copy
    shutil.copy(cluster.host_dir(0) / "d.npz", cluster.host_dir(1) / "d.npz")
    r = _run(cmd)
    assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(_params(out), dataset, rtol=1e-9, atol=1e-11)


LONG = ["-m", "mpidp", "train", "--dataset", "synthetic", "--n-samples", "20000",
        "--n-features", "100", "--dtype", "float64", "--epochs", "40", "--batch-size", "64",
        "--hidden", "32", "--lr", "0.05", "--no-progress"]


def _cut_after(cluster, cmd, host: int, ready, timeout: float = 120):
    """Start ``cmd``, cut ``host``'s link once ``ready()`` is true (polled); return (rc,
    output, seconds from the cut to the end of the job)."""
    p = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True, stdin=subprocess.DEVNULL)
    start = time.monotonic()
    while not ready() and p.poll() is None and time.monotonic() - start < timeout:
        time.sleep(0.05)
    cluster.link(host, False)
    t = time.monotonic()
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        return None, out, None
    finally:
        cluster.link(host, True)
    return p.returncode, out, time.monotonic() - t


def test_link_down_ends_the_job_names_the_lost_ranks_and_it_resumes_on_the_remaining_host(
        cluster, tmp_path):
    """Host 1's link is cut once two checkpoints say training is under way: the job ends
    within the watchdog's reach naming rank 1; host 1 lost for good, the job resumes on
    host 0 alone and ends with the model of an uninterrupted run."""
    ck, base = cluster.root / "ck", [*LONG, "--epochs", "4"]
    args = [*base, "--checkpoint-every", "50"]
    ref = tmp_path / "ref"
    r = run_mpi(2, *base[2:], "--out", str(ref))  # uninterrupted, on one host
    assert r.returncode == 0, r.stderr
    cmd = cluster.mpiexec(2, 1, PY, *args, "--watchdog", "5", "--watchdog-grace", "2",
                          "--checkpoint-dir", str(ck), "--out", str(cluster.root / "lost"))
    rc, out, after = _cut_after(cluster, cmd, 1, lambda: len(list(ck.glob("ckpt-*.npz"))) >= 2)
    assert rc not in (None, 0) and list(ck.glob("ckpt-*.npz")), out[-3000:]
    assert after < 45, f"job took {after:.0f} s to end after the link went down"
    assert "stalled rank(s) [1]: [1] did not answer within 2s" in out, out[-3000:]
    done = cluster.root / "resumed"
    r = _run(cluster.mpiexec(2, 2, PY, *args, "--checkpoint-dir", str(ck), "--resume",
                             "--out", str(done), hosts=[0]))
    assert r.returncode == 0 and "resumed from" in r.stdout, r.stderr[-3000:]
    np.testing.assert_allclose(_params(done), _params(ref), rtol=1e-9, atol=1e-11)
