"""Elastic data parallelism (``--elastic``): ranks SIGKILLed mid-epoch, the survivors go on
and end with the model of the uninterrupted run (float64, 1e-10); refusals before any work
where the MPI or the mode cannot survive a lost rank. The kills come from the fault
injection hook (``MPIDP_FAULT=kill@RANK:STEP``), so they land at the same step every time.
Each job runs under a timeout and is killed, every process of it, if it outlives it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, kill_job, mpiexec, start_job

OPEN_MPI = (Path(sys.executable).parent / "ompi_info").exists()
ULFM = ("--with-ft", "ulfm", "--mca", "btl", "tcp,self")
TRAIN = ("train", "--dataset", "digits", "--model", "mlp", "--epochs", "2", "--batch-size",
         "64", "--dtype", "float64", "--no-progress", "--seed", "3")
open_mpi_only = pytest.mark.skipif(not OPEN_MPI, reason="ULFM (surviving a lost rank) is Open "
                                   "MPI's; MPICH refuses --elastic (tested below)")


def _job(n: int, out: Path, *extra: str, launcher=ULFM, fault: str | None = None,
         timeout: float = 240) -> subprocess.CompletedProcess:
    env = {"MPIDP_FAULT": fault or ""}
    if OPEN_MPI:  # as root (CI, containers), and 4 ranks on fewer cores
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                   PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe")
    cmd = [mpiexec(), *(launcher if OPEN_MPI else ()), "-n", str(n), sys.executable, "-m",
           "mpidp", *TRAIN, "--out", str(out), *extra]
    with start_job(cmd, env, "elastic", cwd=ROOT, stdout=subprocess.PIPE,
                   stderr=subprocess.PIPE) as job:
        try:
            stdout, stderr = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_job(job)  # the launcher and every rank (Open MPI's outlive their launcher)
            stdout, stderr = job.communicate()
            pytest.fail(f"timed out after {timeout} s:\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(cmd, job.returncode, stdout, stderr)


def _params(out: Path) -> np.ndarray:
    with np.load(out / "model.npz") as z:
        return np.concatenate([z[k].ravel() for k in sorted(z.files) if k != "meta"
                               and z[k].dtype.kind == "f"])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> np.ndarray:
    out = tmp_path_factory.mktemp("whole") / "out"
    got = _job(4, out, "--elastic", "--distribute", "local") if OPEN_MPI else None
    if got is None:
        pytest.skip("Open MPI only")
    assert got.returncode == 0, got.stderr[-3000:]
    return _params(out)


@open_mpi_only
@pytest.mark.parametrize("fault, lost", [
    ("kill@1:5", [1]),  # a worker, in the first epoch
    ("kill@0:20", [0]),  # the root, in the second epoch (digits: 23 steps of 64 an epoch)
    ("kill@1:4,kill@2:30", [1, 2]),  # two ranks, one after the other
    ("kill@1:7,kill@3:7", [1, 3]),  # two ranks in one step
])
@pytest.mark.parametrize("distribute", ["local", "scatter"])
def test_the_survivors_end_with_the_uninterrupted_model(uninterrupted, tmp_path, fault, lost,
                                                        distribute):
    """Each rank reading its rows, or rank 0 reading and sending them (scatter: after a
    loss the new rank 0 reads and sends every survivor's rows again, a lost root too)."""
    out = tmp_path / "out"
    got = _job(4, out, "--elastic", "--distribute", distribute, fault=fault)
    assert got.returncode == 0, got.stderr[-3000:]
    np.testing.assert_allclose(_params(out), uninterrupted, rtol=0, atol=1e-10)
    records = _lost(out, got, lost)
    assert records == [x for r in _metrics(out)["history"] for x in r.get("lost_ranks", [])]
    assert "bit-identical" in got.stdout


#: --sync overlapped's elastic variants: sums tested at each layer boundary or moved by a
#: communication thread, completed in backward or in the next forward pass; small buckets,
#: so that several are in flight when a rank dies
OVERLAPPED = {"test": ("--overlap-progress", "test"),
              "thread": ("--overlap-progress", "thread"),
              "forward": ("--overlap-finish", "forward", "--on-nonfinite", "ignore")}


@open_mpi_only
@pytest.mark.parametrize("variant, fault, lost, distribute", [
    ("test", "kill@1:5", [1], "local"),
    ("test", "kill@0:20", [0], "scatter"),
    ("test", "kill@1:4,kill@2:30", [1, 2], "local"),  # the last two: a pair's own exchange
    ("thread", "kill@1:5", [1], "scatter"),
    ("thread", "kill@0:20", [0], "local"),
    ("thread", "kill@1:4,kill@2:30", [1, 2], "scatter"),
    ("forward", "kill@1:5", [1], "local"),
    ("forward", "kill@0:20", [0], "scatter"),
    ("forward", "kill@1:4,kill@2:30", [1, 2], "local"),
])
def test_overlapped_survivors_end_with_the_uninterrupted_model(uninterrupted, tmp_path,
                                                               variant, fault, lost,
                                                               distribute):
    """The sums in flight on the old communicators (the world's, a pair's, a private one or
    the communication thread's) are dropped wherever the loss shows: the survivors end with
    the allreduce run's model (overlapped sums it to the last bits: 1e-16 apart)."""
    out = tmp_path / "out"
    got = _job(4, out, "--elastic", "--sync", "overlapped", "--bucket-mb", "0.01",
               "--distribute", distribute, *OVERLAPPED[variant], fault=fault, timeout=120)
    assert got.returncode == 0, got.stderr[-3000:]
    np.testing.assert_allclose(_params(out), uninterrupted, rtol=0, atol=1e-10)
    _lost(out, got, lost)
    assert "bit-identical" in got.stdout


@pytest.fixture(scope="module")
def uninterrupted_accumulate(tmp_path_factory) -> np.ndarray:
    out = tmp_path_factory.mktemp("whole-accumulate") / "out"
    got = _job(4, out, "--elastic", "--sync", "accumulate", "--distribute", "local")
    assert got.returncode == 0, got.stderr[-3000:]
    return _params(out)


@open_mpi_only
@pytest.mark.parametrize("fault, lost, distribute, back_to", [
    ("kill@1:5", [1], "local", [4]),  # within the group of steps 4-7: noticed at its end
    ("kill@0:20", [0], "scatter", None),  # the last group of the first epoch (20-22)
    ("kill@1:4,kill@2:30", [1, 2], "local", None),
])
def test_accumulate_survivors_go_back_to_the_group_start(uninterrupted_accumulate, tmp_path,
                                                         fault, lost, distribute, back_to):
    """A group's gradients are summed on each rank until its one exchange, where a loss
    shows: the survivors go back to the group's first step and sum it again over themselves
    (the lost rank's share included)."""
    out = tmp_path / "out"
    got = _job(4, out, "--elastic", "--sync", "accumulate", "--distribute", distribute,
               fault=fault, timeout=120)
    assert got.returncode == 0, got.stderr[-3000:]
    np.testing.assert_allclose(_params(out), uninterrupted_accumulate, rtol=0, atol=1e-10)
    records = _lost(out, got, lost, most=4)  # survivors are one group apart at most
    assert back_to is None or [x["step"] for x in records] == back_to, records
    assert all(x["step"] % 23 % 4 == 0 for x in records), records  # a group's first step
    assert "bit-identical" in got.stdout


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


def _lost(out: Path, got, ranks: list[int], most: int = 1) -> list[dict]:
    """metrics.json's record of the losses (one each: rank, host, step, seconds to recover,
    steps recomputed: at ``most``), and the console's line for each."""
    records = _metrics(out)["lost_ranks"]
    assert sorted(x["rank"] for x in records) == ranks, records  # in one step: either first
    assert all(x["seconds_to_recover"] >= 0 and 0 <= x["steps_recomputed"] <= most
               and x["host"] and x["step"] >= 0 for x in records), records
    assert got.stderr.count("mpidp: lost rank") == len(ranks), got.stderr[-3000:]
    return records


@open_mpi_only
@pytest.mark.parametrize("fault, lost, distribute", [
    ("kill@1:load", 1, "local"),  # a reader of its own rows
    ("kill@0:load", 0, "scatter"),  # the root, which reads and sends: another takes its role
])
def test_a_loss_before_the_first_step_is_survived(uninterrupted, tmp_path, fault, lost,
                                                  distribute):
    """A rank lost while the data loads (or in a collective just before: one rank may see a
    loss a collective early): the survivors prepare the run again over themselves."""
    out = tmp_path / "out"
    got = _job(4, out, "--elastic", "--distribute", distribute, fault=fault)
    assert got.returncode == 0, got.stderr[-3000:]
    np.testing.assert_allclose(_params(out), uninterrupted, rtol=0, atol=1e-10)
    assert [(x["step"], x["steps_recomputed"]) for x in _lost(out, got, [lost])] == [(0, 0)]
    assert _metrics(out)["world_size"] == 3


@open_mpi_only
@pytest.mark.parametrize("fault, where", [("raise@1:5", "step 5"), ("raise@1:load", "load")])
def test_an_exception_on_one_rank_is_not_a_lost_rank(tmp_path, fault, where):
    """A bug or bad data on one rank ends the whole job with its error, in a step or while
    the data loads, as without --elastic: the survivors do not go on without it."""
    got = _job(3, tmp_path / "out", "--elastic", fault=fault, timeout=90)
    assert got.returncode not in (0, None), got.stderr[-3000:]
    assert f"injected fault on rank 1 at {where}" in got.stderr, got.stderr[-3000:]
    assert "lost rank" not in got.stderr and not (tmp_path / "out" / "model.npz").exists()


@open_mpi_only
def test_too_few_survivors_before_the_first_step_end_with_nothing_written(tmp_path):
    got = _job(3, tmp_path / "out", "--elastic", "--min-ranks", "3", fault="kill@1:load")
    assert got.returncode == 69, got.stderr[-3000:]
    assert "fewer than the 3 --min-ranks asks for: nothing was trained" in got.stderr
    assert not (tmp_path / "out").exists()


@open_mpi_only
@pytest.mark.parametrize("fault, lost", [
    ("kill@1:evaluate", 1),  # in the first epoch's evaluation
    ("kill@2:checkpoint", 2),  # after the step's update, while the root writes
    ("kill@0:checkpoint", 0),  # the root, as it starts writing
    ("kill@0:write", 0),  # the root, as it starts writing the model: another writes it
])
def test_a_loss_outside_a_step_is_survived(uninterrupted, tmp_path, fault, lost):
    out, ck = tmp_path / "out", tmp_path / "ck"
    got = _job(3, out, "--elastic", "--distribute", "local", "--checkpoint-dir", str(ck),
               "--checkpoint-every", "10", fault=fault)
    assert got.returncode == 0, got.stderr[-3000:]
    np.testing.assert_allclose(_params(out), uninterrupted, rtol=0, atol=1e-10)
    # the step the survivors went on from: the last all had reached (a checkpoint's: after
    # its step, or before it where a survivor noticed the loss in the write)
    step = _lost(out, got, [lost])[0]["step"]
    assert step in ((46,) if "write" in fault else (23,) if "evaluate" in fault else (9, 10))
    assert _metrics(out)["world_size"] == 2


@open_mpi_only
@pytest.mark.parametrize("lost, step", [("5", 6), ("load", 1)])
def test_a_stop_signal_during_a_recovery_ends_with_a_checkpoint_that_resumes(uninterrupted,
                                                                           tmp_path, lost,
                                                                           step):
    """SIGTERM on a survivor while the survivors regroup (in a step, or before the first):
    the run stops at the next step with a checkpoint and the preemption exit status;
    resuming it ends with the model."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    run = ("--elastic", "--distribute", "local", "--checkpoint-dir", str(ck))
    got = _job(3, out, *run, fault=f"kill@1:{lost},term@0:recover")
    assert got.returncode == 75, got.stderr[-3000:]
    # the step after the one the survivors went back to (one further where a survivor had
    # not yet received the dead rank's last messages: see the library test below)
    said = re.search(r"stopped by a signal after step (\d+)", got.stderr)
    assert said and int(said[1]) in (step, step - 1), got.stderr[-3000:]
    assert [p.name for p in ck.glob("ckpt-*.npz")] == [f"ckpt-{int(said[1]):010d}.npz"]
    again = _job(2, tmp_path / "again", *run, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    np.testing.assert_allclose(_params(tmp_path / "again"), uninterrupted, rtol=0, atol=1e-10)


def test_elastic_is_refused_where_the_mpi_cannot_survive_a_lost_rank(tmp_path):
    """MPICH has no ULFM; Open MPI without its fault tolerance switched on would hang."""
    got = _job(2, tmp_path / "out", "--elastic", launcher=(), timeout=120)
    assert got.returncode == 2, got.stderr[-3000:]
    assert "ULFM" in got.stderr and not (tmp_path / "out").exists()
    lines = {line for line in got.stderr.splitlines() if "ULFM" in line}
    assert len(lines) == 1, got.stderr  # one line, said once


def test_a_mode_that_is_not_elastic_is_refused(tmp_path):
    got = _job(2, tmp_path / "out", "--elastic", "--sync", "sharded-ps", timeout=120)
    assert got.returncode == 2, got.stderr[-3000:]
    assert "--elastic does not apply to" in got.stderr and "allreduce" in got.stderr
    assert not (tmp_path / "out").exists()


def test_each_mode_that_is_not_elastic_says_its_own_reason():
    """The command line and the library refuse a mode with the reason its declaration
    gives, and no two modes share one (a reason names what that mode would lose)."""
    from mpidp.cli import build_parser
    from mpidp.cli.options import given, problems
    from mpidp.parallel.elastic import refusal
    from mpidp.parallel.modes import MODES
    refused = {n: m.elastic for n, m in MODES.items() if m.elastic is not True}
    assert set(refused) == set(MODES) - {"allreduce", "per-layer", "overlapped", "accumulate"}
    assert len(set(refused.values())) == len(refused), refused
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]
    for name, why in refused.items():
        kind = "--parallel" if MODES[name].kind == "pipeline" else "--sync"
        argv = ["--elastic", kind, name]
        args = parser.parse_args(["train", *argv])
        said = [p for p in problems(args, given(train, argv), 4) if p.startswith("--elastic")]
        assert said == [f"--elastic does not apply to {kind} {name}: {why}; only allreduce, "
                        "per-layer, overlapped, accumulate go on over the survivors of a lost "
                        "rank (see docs/reliability.md)"], said
        assert refusal(name).endswith(f": {why}; use --sync allreduce, --sync per-layer, "
                                      "--sync overlapped or --sync accumulate")


@open_mpi_only
def test_too_few_survivors_end_with_a_checkpoint_that_resumes(uninterrupted, tmp_path):
    """Fewer survivors than --min-ranks: a checkpoint of the step they went back to, one
    line, exit status 69, no model or metrics; resuming it ends with the uninterrupted model."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    run = ("--elastic", "--distribute", "local", "--min-ranks", "4", "--checkpoint-dir",
           str(ck), "--checkpoint-every", "100")
    got = _job(4, out, *run, fault="kill@1:15")
    assert got.returncode == 69, got.stderr[-3000:]
    ending = [line for line in got.stderr.splitlines() if "--min-ranks" in line]
    assert len(ending) == 1 and "--resume" in ending[0], got.stderr[-3000:]
    assert not (out / "model.npz").exists() and not (out / "metrics.json").exists()
    step = int(ending[0].split("the run ends at step ")[1].split()[0].rstrip(":;,."))
    assert step in (14, 15), ending  # the last step every survivor reached (timing decides)
    assert [p.name for p in ck.glob("ckpt-*.npz")] == [f"ckpt-{step:010d}.npz"]
    again = _job(4, tmp_path / "again", *run, "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    np.testing.assert_allclose(_params(tmp_path / "again"), uninterrupted, rtol=0, atol=1e-10)


@open_mpi_only
def test_min_ranks_needs_elastic(tmp_path):
    got = _job(2, tmp_path / "out", "--min-ranks", "2", timeout=120)
    assert got.returncode == 2 and "--min-ranks needs --elastic" in got.stderr, got.stderr


LIBRARY = """
import sys
import mpidp
import numpy as np
from mpi4py import MPI
from mpidp import nn

from mpidp.parallel import make_sync
from mpidp.parallel.elastic import last_run

comm = MPI.COMM_WORLD
rng = np.random.default_rng(0)
X, y = rng.normal(size=(300, 6)), rng.integers(0, 3, 300)  # the whole set, on every rank
model = nn.mlp(6, hidden=(64, 64), n_out=3, dtype=np.float64)
model.init_(np.random.default_rng(0))
sync = make_sync("overlapped", finish="forward", bucket_bytes=512) if sys.argv[2:] else None
dp = mpidp.DataParallel(model, nn.Adam(1e-2), nn.SoftmaxCrossEntropy(), comm,
                        sync=sync or "allreduce", on_nonfinite="ignore")
history = mpidp.fit(dp, (X, y), epochs=2, batch_size=32, seed=0, test=(X[:90], y[:90]),
                    elastic=True)
dp.settle()
if dp.comm.rank == 0:
    np.save(sys.argv[1], model.params)
    print("test rows", history[-1]["test_loss"] is not None, dp.comm.size)
    print("went back to", [x["step"] for x in last_run(dp).losses])
"""


@open_mpi_only
def test_the_library_with_whole_arrays_on_every_rank(tmp_path):
    """fit(dp, (X, y), elastic=True): each rank trains on its block of the rows; the
    survivors of a lost rank split them again: the model of the uninterrupted run. With
    overlapped sums that finish in the next forward pass (no on_step settles them), the
    rank mostly dies with its last update's sums unsent: the survivors cannot complete that
    update and go back to the step before it."""
    script = tmp_path / "fit.py"
    script.write_text(LIBRARY)
    got = {}
    for name, fault, *sync in (("whole", None), ("lost", "kill@1:6"),
                               ("overlapped", "kill@1:6", "overlapped")):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MPIDP_FAULT": fault or "",
               "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}
        with subprocess.Popen([mpiexec(), *ULFM, "-n", "3", sys.executable, str(script),
                               str(tmp_path / name), *sync], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) as job:
            try:
                stdout, stderr = job.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                job.kill()
                pytest.fail(f"timed out: {job.communicate()}")
        assert job.returncode == 0, stderr[-3000:]
        assert f"test rows True {2 if fault else 3}" in stdout, stdout + stderr[-2000:]
        # the step in flight, or the one before where a survivor had not yet received the
        # dead rank's last messages of it (sent as it finished the step, then killed); with
        # overlapped sums, the step before it, or that step itself where the dead rank's sums
        # had all gone out before it died (the model is the same either way: checked below)
        back = {"whole": [[]], "lost": [[6], [5]], "overlapped": [[6], [5], [4]]}[name]
        assert any(f"went back to {b}" in stdout for b in back), stdout + stderr[-2000:]
        got[name] = np.load(tmp_path / f"{name}.npy")
    np.testing.assert_allclose(got["lost"], got["whole"], rtol=0, atol=1e-10)
    np.testing.assert_allclose(got["overlapped"], got["whole"], rtol=0, atol=1e-10)


@open_mpi_only
def test_replicas_out_of_sync_after_a_loss_fail_the_run(tmp_path):
    """The survivors leave at exit without waiting for the dead: with the run's status."""
    out = tmp_path / "out"
    got = _job(3, out, "--elastic", "--distribute", "local", fault="kill@2:5,desync@1:10")
    assert got.returncode == 2, got.stderr[-3000:]
    assert "replicas are out of sync" in got.stderr and not (out / "model.npz").exists()


@open_mpi_only
def test_the_node_aware_reduction_is_refused(tmp_path):
    """Its ranks wait for their node in shared memory, where no lost rank is noticed (auto
    turns it off under --elastic)."""
    got = _job(2, tmp_path / "out", "--elastic", "--node-aware", "on")
    assert got.returncode == 2 and "--node-aware off" in got.stderr, got.stderr[-3000:]
