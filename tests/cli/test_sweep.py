"""``mpidp sweep``: trials on groups of ranks, each equal to the same ``mpidp train`` run
alone; a failed trial recorded while the others go on; a resumed sweep keeps what finished."""

from __future__ import annotations

import csv
import importlib.util
import json

import numpy as np
import pytest
from helpers import run_here, run_mpi

pytest.importorskip("mpi4py")

TINY = ["--dataset", "synthetic", "--n-samples", "200", "--n-features", "8", "--epochs", "2",
        "--dtype", "float64", "--hidden", "8", "--val-fraction", "0.2", "--no-progress",
        "--quiet"]


def _sweep(n: int, out, *args: str):
    r = run_mpi(n, "sweep", "--out", str(out), *args, *TINY)
    return r, (json.loads((out / "sweep.json").read_text()) if (out / "sweep.json").exists()
               else None)


def _params(folder) -> np.ndarray:
    return np.load(folder / "model.npz")["params"]


def test_grid_on_two_groups_equals_each_trial_alone(tmp_path):
    out = tmp_path / "s"
    r, summary = _sweep(4, out, "--ranks-per-trial", "2", "--grid", "lr=0.03,0.1", "seed=0,1",
                        "--select", "val_accuracy")
    assert r.returncode == 0, r.stderr
    assert "on 2 groups of 2 ranks" in r.stdout and "best by val_accuracy" in r.stdout
    trials = summary["trials"]
    assert sorted(t["index"] for t in trials) == [0, 1, 2, 3]
    assert {tuple(t["ranks"]) for t in trials} <= {(0, 1), (2, 3)}
    assert [t["settings"] for t in sorted(trials, key=lambda t: t["index"])] == [
        {"lr": 0.03, "seed": 0}, {"lr": 0.03, "seed": 1}, {"lr": 0.1, "seed": 0},
        {"lr": 0.1, "seed": 1}]
    accs = [t["result"]["val_accuracy"] for t in trials]
    assert accs == sorted(accs, reverse=True)  # best first
    assert summary["best"]["trial"] == trials[0]["index"]
    rows = list(csv.DictReader((out / "sweep.csv").open()))
    assert [int(x["trial"]) for x in rows] == [t["index"] for t in trials]
    for i in (1, 2):  # the same trial alone, from its config.toml, at 2 ranks
        folder = out / f"trial-{i:03d}"
        assert {"model.npz", "metrics.json", "config.toml", "trial.json"} <= {
            p.name for p in folder.iterdir()}
        alone = run_mpi(2, "train", "--config", str(folder / "config.toml"),
                        "--out", str(tmp_path / f"alone{i}"), "--quiet")
        assert alone.returncode == 0, alone.stderr
        np.testing.assert_allclose(_params(folder), _params(tmp_path / f"alone{i}"),
                                   rtol=0, atol=1e-10)
    if importlib.util.find_spec("matplotlib"):  # mpidp plot on the sweep's folder
        from mpidp.cli.main import main
        from mpidp.observe.plot import sweep_series
        assert main(["plot", str(out), "--out", str(tmp_path / "p.png")]) == 0
        assert (tmp_path / "p.png").stat().st_size > 0
        by = {t["index"]: t for t in trials}
        for series, name in zip(sweep_series(summary), ("lr", "seed")):
            assert series["setting"] == name and series["trials"] == [0, 1, 2, 3]
            assert series["x"] == [by[i]["settings"][name] for i in range(4)]
            assert series["y"] == [by[i]["result"]["val_accuracy"] for i in range(4)]


def test_spare_rank_idle_and_a_failed_trial_does_not_stop_the_others(tmp_path, capsys):
    """3 ranks, 2 per trial: one spare. A trial that diverges (NaN under the default
    on_nonfinite stop) fails alone; a resume runs it again and keeps the others. The same
    sweep again without --resume is refused by rank 0 before any trial (in this process,
    one rank: the claim on --out is rank 0's alone)."""
    out = tmp_path / "s"
    r, summary = _sweep(3, out, "--ranks-per-trial", "2", "--grid", "lr=0.03,1e300")
    assert r.returncode == 0, r.stderr
    assert "1 spare rank left idle" in r.stdout
    by = {t["index"]: t for t in summary["trials"]}
    assert by[0]["status"] == "ok" and by[1]["status"] == "failed" and by[1]["error"]
    assert summary["trials"][-1]["index"] == 1  # failed ones last
    assert "1 of 2 trials failed" in r.stderr

    again = run_here(capsys, "sweep", "--out", str(out), "--ranks-per-trial", "1",
                     "--grid", "lr=0.03,1e300", *TINY)
    assert again.returncode == 2 and "--resume" in again.stderr  # a used --out: refused
    assert "holds a sweep already" in again.stderr
    from mpidp.cli.sweep import _held
    while _held:  # the lock rank 0 took on --out: a job's end lets it go, as here
        _held.pop().close()
    before = (out / "trial-000" / "model.npz").stat().st_mtime_ns
    resumed, summary = _sweep(3, out, "--ranks-per-trial", "2", "--resume",
                              "--grid", "lr=0.03,1e300")
    assert resumed.returncode == 0, resumed.stderr
    assert "(1 done before)" in resumed.stdout and "sweep: trial 0 " not in resumed.stdout
    assert (out / "trial-000" / "model.npz").stat().st_mtime_ns == before
    assert {t["index"]: t["status"] for t in summary["trials"]} == {0: "ok", 1: "failed"}


def test_one_rank_per_trial_with_random_draws_and_a_file(tmp_path, capsys):
    trials = tmp_path / "t.toml"
    trials.write_text('[[trial]]\noptimizer = "adam"\nlr = 0.01\n')
    out = tmp_path / "s"
    r, summary = _sweep(2, out, "--random", "2", "--space", "lr=0.001:0.1:log",
                        "momentum=0.5,0.9", "--trials", str(trials))
    assert r.returncode == 0, r.stderr
    assert "on 2 groups of 1 rank" in r.stdout
    settings = {t["index"]: t["settings"] for t in summary["trials"]}
    assert settings[0] == {"optimizer": "adam", "lr": 0.01}
    assert all(0.001 <= settings[i]["lr"] <= 0.1 and settings[i]["momentum"] in (0.5, 0.9)
               for i in (1, 2))
    alone = run_here(capsys, "train", "--config", str(out / "trial-001" / "config.toml"),
                     "--out", str(tmp_path / "alone"), "--quiet")  # one rank: this process
    assert alone.returncode == 0, alone.stderr
    np.testing.assert_allclose(_params(out / "trial-001"), _params(tmp_path / "alone"),
                               rtol=0, atol=1e-10)


@pytest.mark.parametrize("args,said", [
    (["--grid", "lrr=0.1"], "'lrr' is not an option of mpidp train"),
    (["--grid", "out=x"], "trial 0 sets out"),
    (["--restart", "--grid", "lr=0.1"], "--restart is not for a sweep"),
    (["--elastic", "--grid", "lr=0.1"], "--elastic is not for a sweep: a trial's ranks are"),
    (["--grid", "lr=0.1", "elastic=true"], "trial 0 sets elastic, which is not for a sweep"),
    (["--grid", "min_ranks=2"], "trial 0 sets min_ranks, which is not for a sweep"),
    ([], "no trials"),
    (["--random", "0"], "no trials"),
    (["--grid", "lr"], "--grid 'lr': write NAME=VALUES"),
    (["--grid", "lr=0.1,,0.2"], "--grid lr=0.1,,0.2: an empty value"),
    (["--grid", "lr=0.1", "lr=0.2"], "--grid names lr twice"),
    (["--grid", "batch_size=8", "batch-size=16"], "--grid names batch-size twice"),
    (["--grid", "lr=abc"], "trial 0: lr = \"abc\": expected a number"),
    (["--random", "2", "--space", "lr=1:0"], "--space lr=1:0: write LO:HI"),
    (["--grid", "lr=0.1", "--select", "val_acc"], "--select val_acc: not a figure of a trial"),
    (["--grid", "lr=0.1", "--trials", "no-such.toml"], "--trials no-such.toml: cannot read"),
    (["--grid", "lr=0.1", "--ranks-per-trial", "0"], "--ranks-per-trial: must be an integer"),
])
def test_refusals(args, said, capsys):
    from mpidp.cli.main import main
    with pytest.raises(SystemExit) as exc:
        main(["sweep", *args, *TINY])
    assert exc.value.code == 2 and said in capsys.readouterr().err


def test_library_form_runs_each_trial_once():
    """mpidp.sweep in one process: a callable for each trial, a failure recorded."""
    import mpidp
    from mpidp import comm as C

    def train(group, trial, i):
        if trial == "bad":
            raise mpidp.MpidpError("refused")
        return trial * 2

    records = mpidp.sweep(C.world(), [1, "bad", 3], ranks_per_trial=1, train=train, skip=[2])
    if C.world().size == 1:
        assert [(r["index"], r["status"], r.get("result", r.get("error"))) for r in records] == [
            (0, "ok", 2), (1, "failed", "refused")]


def test_out_holding_a_run_or_another_running_sweep_is_refused(tmp_path):
    """Rank 0's claim on --out: a train run's folder is not a sweep, and two sweeps into
    one folder at once would overwrite each other's trials."""
    from mpidp.cli.sweep import _held, _start
    from mpidp.errors import MpidpError
    plan = {"train": [], "trials": [{"lr": 0.1}]}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.json").write_text("{}")
    for resume in (False, True):
        with pytest.raises(MpidpError, match="holds a run of mpidp train"):
            _start(str(tmp_path / "run"), plan, resume)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["metrics.json"]
    assert _start(str(tmp_path / "s"), plan, False) == {}  # holds the lock from here
    try:
        with pytest.raises(MpidpError, match="another sweep is running into it"):
            _start(str(tmp_path / "s"), plan, True)
    finally:
        while _held:
            _held.pop().close()
    assert _start(str(tmp_path / "s"), plan, True) == {}  # let go: the resume goes on
    while _held:
        _held.pop().close()


def test_sigterm_stops_the_groups_cleanly_and_resume_finishes(tmp_path):
    """SIGTERM to the job while one group is idle and the other trains: the trial stops at
    a checkpoint, every rank exits 75, and --resume keeps the finished trial and continues
    the stopped one from its checkpoint. The signal comes as soon as the training trial
    has written its first checkpoint (step 50 of 2,000), not after a fixed wait."""
    import os
    import subprocess
    import sys
    import time

    from helpers import ROOT, mpiexec
    args = ["-m", "mpidp", "sweep", "--ranks-per-trial", "1", "--grid", "epochs=1,100",
            "--out", str(tmp_path / "s"), "--checkpoint-dir", str(tmp_path / "c"),
            "--checkpoint-every", "50", *TINY, "--n-samples", "2000"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    job = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, *args], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        said = ""
        for line in job.stdout:
            said += line
            if line.startswith("sweep: trial 0 "):
                break
        assert "sweep: trial 0 " in said, said
        while not list((tmp_path / "c" / "trial-001").glob("ckpt-*.npz")):
            assert job.poll() is None, job.communicate()
            time.sleep(0.02)
        job.terminate()
        out, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 75, err
    assert "sweep stopped by a signal with 1 trial unfinished: continue it with --resume" in err
    assert not (tmp_path / "s" / "trial-001" / "trial.json").exists()
    assert list((tmp_path / "c" / "trial-001").glob("ckpt-*.npz"))
    r = run_mpi(2, *args[2:], "--resume")
    assert r.returncode == 0, r.stderr
    assert "(1 done before)" in r.stdout and "sweep: trial 0 " not in r.stdout
    summary = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert {t["index"]: t["status"] for t in summary["trials"]} == {0: "ok", 1: "ok"}


def test_hang_ends_the_job_and_a_model_that_does_not_fit_fails_alone(tmp_path):
    """A trial that hangs: the watchdog ends the whole job (exit 3; MPICH ends every rank
    on MPI_Abort, even a group's), the trials done before are kept, and --resume runs the
    rest. A model that does not fit its data (a CNN on flat features) fails alone."""
    trials = tmp_path / "t.toml"
    trials.write_text('[[trial]]\nepochs = 1\n[[trial]]\nmodel = "cnn"\n'
                      '[[trial]]\nepochs = 4\n')
    args = ["sweep", "--out", str(tmp_path / "s"), "--trials", str(trials), "--watchdog", "4",
            "--dataset", "synthetic", "--n-samples", "200", "--n-features", "8",
            "--batch-size", "64", "--dtype", "float64", "--no-progress", "--quiet"]
    hung = run_mpi(2, *args, env={"MPIDP_FAULT": "hang@0:5"}, timeout=90)
    assert hung.returncode == 3 and "watchdog" in hung.stderr, hung.stderr
    done = {i: json.loads((tmp_path / "s" / f"trial-{i:03d}" / "trial.json").read_text())
            for i in (0, 1)}
    assert done[0]["status"] == "ok" and done[1]["status"] == "failed"
    assert "model 'cnn' needs samples shaped" in done[1]["error"]
    r = run_mpi(2, *args, "--resume")
    assert r.returncode == 0, r.stderr
    assert "(1 done before)" in r.stdout and "sweep: trial 0 " not in r.stdout
    summary = json.loads((tmp_path / "s" / "sweep.json").read_text())
    assert {t["index"]: t["status"] for t in summary["trials"]} == {
        0: "ok", 1: "failed", 2: "ok"}
