"""A program of one's own gets the command line's watchdog: a stalled rank is named and
the job ends (exit 3) instead of hanging."""

from __future__ import annotations

from helpers import run_mpi


def test_a_rank_stalled_in_a_library_run_is_named(tmp_path):
    """``fit(watchdog=2)`` in a program of one's own: a hang on rank 1 ends the job, exit 3."""
    script = tmp_path / "prog.py"
    script.write_text(
        "import numpy as np, mpidp\nfrom mpidp import nn\nfrom mpi4py import MPI\n"
        "c = MPI.COMM_WORLD\nrng = np.random.default_rng(0)\n"
        "s = mpidp.shard_from_arrays(c, rng.standard_normal((40, 3)), rng.integers(0, 2, 40))\n"
        "m = nn.mlp(3, (4,), 2).init_(0)\n"
        "dp = mpidp.DataParallel(m, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), c)\n"
        "mpidp.fit(dp, s, 50, 4, watchdog=2)\n")
    r = run_mpi(2, str(script), module=False, env={"MPIDP_FAULT": "hang@1:3"}, timeout=60)
    assert r.returncode == 3 and "stalled rank(s) [1]" in r.stderr, (r.returncode, r.stderr)
