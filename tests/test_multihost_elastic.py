"""An elastic run (``--elastic``) that loses a whole test host: both ranks of host 1
SIGKILLed mid-epoch, the two ranks of host 0 finish with the uninterrupted run's model
(float64, 1e-10) and metrics.json names the lost ranks and their host.

Open MPI's ULFM only (MPICH refuses ``--elastic``); the hosts are network namespaces
(benchmarks/cluster.py: root and iproute2), reached by Open MPI's launcher through the
cluster's ssh stand-in. Every job runs under a timeout and is killed by its process id if it
outlives it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, mpiexec

from benchmarks.cluster import Cluster, available

ULFM = Path(sys.executable).parent / "ompi_info"
pytestmark = [pytest.mark.skipif(available() is not None, reason=str(available())),
              pytest.mark.skipif(not ULFM.exists(), reason="surviving a lost host needs Open "
                                 "MPI's ULFM (MPICH refuses --elastic)")]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMPI_ALLOW_RUN_AS_ROOT": "1",
       "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
#: ULFM over TCP; across hosts also no Open MPI "han" collectives (they do not survive a
#: failure: the survivors' replicas part). --elastic takes the node-aware reduction off.
FT = ("--with-ft", "ulfm", "--mca", "btl", "tcp,self", "--mca", "coll", "^han")
TRAIN = ("-m", "mpidp", "train", "--dataset", "digits", "--model", "mlp", "--epochs", "2",
         "--batch-size", "64", "--dtype", "float64", "--no-progress", "--seed", "3",
         "--elastic", "--distribute", "local")


def _params(out: Path) -> np.ndarray:
    with np.load(out / "model.npz") as z:
        return np.concatenate([z[k].ravel() for k in sorted(z.files) if k != "meta"
                               and z[k].dtype.kind == "f"])


def _ranks_on(cluster: Cluster, host: int) -> list[int]:
    """The process ids of the mpidp ranks on ``host`` (not Open MPI's daemon)."""
    pids = subprocess.run(["ip", "netns", "pids", cluster.names[host]], capture_output=True,
                          text=True).stdout.split()
    def is_rank(pid: str) -> bool:
        try:
            return b"\0-m\0mpidp\0train\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False
    return [int(p) for p in pids if is_rank(p)]


def test_han_collectives_across_hosts_are_refused_before_any_work():
    with Cluster(2) as cluster:
        got = subprocess.run(cluster.prterun(4, 2, *FT[:-2], "-x", "PYTHONPATH", sys.executable,
                                             *TRAIN, "--out", str(cluster.root / "out")),
                             env=ENV, capture_output=True, text=True, timeout=240,
                             stdin=subprocess.DEVNULL)
    assert got.returncode == 2, got.stderr[-3000:]
    assert "--mca coll ^han" in got.stderr and "epoch" not in got.stdout, got.stderr[-3000:]


def test_the_ranks_of_one_host_die_the_other_hosts_ranks_finish(tmp_path):
    ref = tmp_path / "ref"
    whole = subprocess.run(
        [mpiexec(), *FT, "-n", "4", sys.executable, *TRAIN, "--out", str(ref)], env={
            **ENV, "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"},
        capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert whole.returncode == 0, whole.stderr[-3000:]  # uninterrupted, on this host
    with Cluster(2) as cluster:
        out, ck = cluster.root / "out", cluster.root / "ck"
        cmd = cluster.prterun(4, 2, *FT, "-x", "PYTHONPATH", sys.executable, *TRAIN,
                              "--checkpoint-dir", str(ck), "--checkpoint-every", "5",
                              "--out", str(out))
        with subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, stdin=subprocess.DEVNULL) as job:
            start = time.monotonic()  # the first checkpoint (step 5 of 46): mid-epoch
            while not any(ck.glob("ckpt-*")) and job.poll() is None:
                assert time.monotonic() - start < 240, "no checkpoint in 240 s"
                time.sleep(0.02)
            doomed = _ranks_on(cluster, 1)
            assert len(doomed) == 2, doomed
            for pid in doomed:
                os.kill(pid, 9)
            try:
                stdout, stderr = job.communicate(timeout=240)
            except subprocess.TimeoutExpired:
                job.kill()  # the launcher, by its pid; the cluster's exit ends the rest
                stdout, stderr = job.communicate()
                pytest.fail(f"timed out:\n{stdout[-3000:]}\n{stderr[-3000:]}")
        assert job.returncode == 0, stderr[-3000:]
        assert "replicas: bit-identical (checked)" in stdout, stdout[-3000:]
        assert "node-aware" not in stdout  # the survivors of a node never wait for it
        np.testing.assert_allclose(_params(out), _params(ref), rtol=0, atol=1e-10)
        lost = json.loads((out / "metrics.json").read_text())["lost_ranks"]
        assert sorted(x["rank"] for x in lost) == [2, 3], lost
        assert {x["host"] for x in lost} == {cluster.names[1]}, lost
        assert all(x["survivors"] == 2 for x in lost), lost
