"""``mpidp sweep``: trials on groups of ranks, each equal to the same ``mpidp train`` run
alone; a failed trial recorded while the others go on; a resumed sweep keeps what finished."""

from __future__ import annotations

import csv
import importlib.util
import json

import numpy as np
import pytest
from helpers import run_mpi

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


def test_spare_rank_idle_and_a_failed_trial_does_not_stop_the_others(tmp_path):
    """3 ranks, 2 per trial: one spare. A trial that diverges (NaN under the default
    on_nonfinite stop) fails alone; a resume runs it again and keeps the others."""
    out = tmp_path / "s"
    r, summary = _sweep(3, out, "--ranks-per-trial", "2", "--grid", "lr=0.03,1e300")
    assert r.returncode == 0, r.stderr
    assert "1 spare rank left idle" in r.stdout
    by = {t["index"]: t for t in summary["trials"]}
    assert by[0]["status"] == "ok" and by[1]["status"] == "failed" and by[1]["error"]
    assert summary["trials"][-1]["index"] == 1  # failed ones last
    assert "1 of 2 trials failed" in r.stderr

    again, _ = _sweep(3, out, "--ranks-per-trial", "2", "--grid", "lr=0.03,1e300")
    assert again.returncode == 2 and "--resume" in again.stderr  # a used --out: refused
    before = (out / "trial-000" / "model.npz").stat().st_mtime_ns
    resumed, summary = _sweep(3, out, "--ranks-per-trial", "2", "--resume",
                              "--grid", "lr=0.03,1e300")
    assert resumed.returncode == 0, resumed.stderr
    assert "(1 done before)" in resumed.stdout and "sweep: trial 0 " not in resumed.stdout
    assert (out / "trial-000" / "model.npz").stat().st_mtime_ns == before
    assert {t["index"]: t["status"] for t in summary["trials"]} == {0: "ok", 1: "failed"}


def test_one_rank_per_trial_with_random_draws_and_a_file(tmp_path):
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
    alone = run_mpi(1, "train", "--config", str(out / "trial-001" / "config.toml"),
                    "--out", str(tmp_path / "alone"), "--quiet")
    assert alone.returncode == 0, alone.stderr
    np.testing.assert_allclose(_params(out / "trial-001"), _params(tmp_path / "alone"),
                               rtol=0, atol=1e-10)


@pytest.mark.parametrize("args,said", [
    (["--grid", "lrr=0.1"], "'lrr' is not an option of mpidp train"),
    (["--grid", "out=x"], "trial 0 sets out"),
    (["--restart", "--grid", "lr=0.1"], "--restart is not for a sweep"),
    ([], "no trials"),
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
