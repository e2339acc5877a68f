"""``mpidp train --parallel pipeline|hybrid`` end to end, against ``--parallel data``."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from helpers import run_here, run_mpi


def _npz(tmp_path, n=90, d=5, seed=0):
    rng = np.random.default_rng(seed)
    path = tmp_path / "d.npz"
    np.savez(path, X=rng.standard_normal((n, d)), y=rng.integers(0, 3, n))
    return str(path)


def _params(out):
    return np.load(os.path.join(out, "model.npz"))["params"]


def test_help_lists_the_model_parallel_options(capsys):
    """In this process (tests/cli/test_train.py runs ``mpidp train --help`` in a job)."""
    r = run_here(capsys, "train", "--help")
    assert r.returncode == 0
    for text in ("--parallel", "data,pipeline,hybrid", "--micro-batches", "--schedule", "gpipe,1f1b"):
        assert text in r.stdout, text


ARGS = ["--batch-size", "16", "--dtype", "float64", "--hidden", "8,6", "--optimizer", "adam",
        "--lr", "0.01", "--no-progress"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The data set (90 rows) and 3 epochs of ARGS on it by one process (--parallel data)."""
    base = tmp_path_factory.mktemp("one")
    data = _npz(base)
    r = run_mpi(1, "train", "--dataset", data, *ARGS, "--epochs", "3", "--parallel", "data",
                "--out", str(base / "data"))
    assert r.returncode == 0, r.stderr[-3000:]
    return data, base / "data"


def test_pipeline_and_hybrid_train_the_same_model_as_one_process(tmp_path, one_process):
    """72 training rows in batches of 16: the last batch (8) splits 3,3,2 into micro-batches."""
    data, one = one_process
    args = ["train", "--dataset", data, *ARGS, "--epochs", "3"]
    runs = {"pipeline": (3, ["--micro-batches", "3", "--schedule", "gpipe"]),
            "hybrid": (4, ["--micro-batches", "3", "--schedule", "1f1b"])}
    for name, (n, extra) in runs.items():
        r = run_mpi(n, *args, "--parallel", name, *extra, "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr[-3000:]
    ref = _params(one)
    for name in ("pipeline", "hybrid"):
        np.testing.assert_allclose(_params(tmp_path / name), ref, rtol=1e-9, atol=1e-11)
        m = json.loads((tmp_path / name / "metrics.json").read_text())
        assert m["parallel"] == name and m["params_in_sync"] is True
        assert (m["stages"], m["replicas"]) == ((3, 1) if name == "pipeline" else (2, 2))
        d = json.loads((one / "metrics.json").read_text())
        assert m["final_loss"] == pytest.approx(d["final_loss"], rel=1e-9)
        assert m["test_accuracy"] == d["test_accuracy"]
        sizes = [r["param_bytes"] for r in m["memory_per_rank"]]
        assert sum(sizes[:m["stages"]]) == ref.nbytes  # one replica's stages hold the model once


def test_pipeline_stages_on_mapped_rows_train_like_one_process_and_like_copied_rows(tmp_path,
                                                                                    capsys):
    """A float64 folder with --test-fraction 0: every stage maps the whole X.npy. The one
    process is this one (a job of one rank); the pipelines are jobs of 3 ranks."""
    folder, rng = tmp_path / "d", np.random.default_rng(2)
    folder.mkdir()
    np.save(folder / "X.npy", rng.standard_normal((80, 5)))
    np.save(folder / "y.npy", rng.integers(0, 3, 80))
    args = ["train", "--dataset", str(folder), "--test-fraction", "0", "--epochs", "2",
            "--batch-size", "16", "--dtype", "float64", "--hidden", "8,6", "--no-progress"]
    r = run_here(capsys, *args, "--out", str(tmp_path / "data"))
    assert r.returncode == 0, r.stderr[-3000:]
    for name, extra in (("mapped", []), ("copied", ["--copy-data"])):
        r = run_mpi(3, *args, "--parallel", "pipeline", "--micro-batches", "2", *extra,
                    "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr[-3000:]
    np.testing.assert_allclose(_params(tmp_path / "mapped"), _params(tmp_path / "data"),
                               rtol=1e-9, atol=1e-11)
    assert np.array_equal(_params(tmp_path / "copied"), _params(tmp_path / "mapped"))


BAD = {
    "more stages than layers": (2, ["--parallel", "pipeline", "--model", "logreg"],
                                "more pipeline stages (2) than layers (1)"),
    "micro-batches": (2, ["--parallel", "pipeline", "--micro-batches", "9", "--batch-size", "8"],
                      "more micro-batches (9) than samples in a batch"),
    "hybrid on 3 ranks": (3, ["--parallel", "hybrid"], "must be a multiple of the number of stages"),
    "unsupported": (2, ["--parallel", "pipeline", "--distribute", "local"],
                    "--distribute does not apply to --parallel pipeline"),
    "seed init": (2, ["--parallel", "hybrid", "--init-sync", "seed"],
                  "--init-sync does not apply to --parallel hybrid"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_clear_error_every_rank_nothing_written(tmp_path, capsys, case):
    """The refusals that need their number of ranks by a job of them; the others, whatever
    the ranks, as a job of one rank in this process."""
    n, extra, message = BAD[case]
    out = tmp_path / "out"
    hidden = [] if "--model" in extra else ["--hidden", "8"]  # only an mlp has them
    args = ["train", "--dataset", _npz(tmp_path), *hidden, "--epochs", "1", "--no-progress",
            *extra, "--out", str(out)]
    r = (run_mpi(n, *args, timeout=60) if case in ("more stages than layers", "hybrid on 3 ranks")
         else run_here(capsys, *args))
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert r.stderr.count(message) == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert not out.exists()


def test_pipeline_checkpoints_resume_as_pipeline_or_data_parallel(tmp_path, one_process):
    """A 3-stage pipeline run checkpoints, stops after 2 of 3 epochs, and is finished once by
    a 2-stage pipeline and once by data-parallel training on 2 ranks: both give the model
    (and Adam's state behind it) of an uninterrupted single-process run."""
    data, one = one_process
    args = ["train", "--dataset", data, *ARGS]
    ckpt = tmp_path / "ckpt"
    r = run_mpi(3, *args, "--epochs", "2", "--parallel", "pipeline", "--micro-batches", "2",
                "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4",
                "--out", str(tmp_path / "first"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(p.name for p in ckpt.glob("ckpt-*.npz"))[-1] == "ckpt-0000000010.npz"  # 5 steps per epoch
    finish = {"pipeline": (2, ["--parallel", "pipeline", "--schedule", "gpipe"]),
              "data": (2, ["--parallel", "data"])}
    for name, (n, extra) in finish.items():
        mine = tmp_path / f"ckpt-{name}"  # each finisher from the same checkpoints
        shutil.copytree(ckpt, mine)
        r = run_mpi(n, *args, "--epochs", "3", *extra, "--checkpoint-dir", str(mine),
                    "--resume", "--out", str(tmp_path / name))
        assert r.returncode == 0, r.stderr[-3000:]
        assert "resumed from" in r.stdout + r.stderr and "written with 3 ranks" in r.stdout + r.stderr
        np.testing.assert_allclose(_params(tmp_path / name), _params(one),
                                   rtol=1e-9, atol=1e-11)
        m = json.loads((tmp_path / name / "metrics.json").read_text())
        assert len(m["history"]) == 3
