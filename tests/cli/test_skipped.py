"""Steps skipped for NaN/Inf are counted per epoch on the console and in the history, and a
run that skips more than its bound fails instead of ending as if it had learnt."""

from __future__ import annotations

import json

import pytest
from helpers import run_mpi

ARGS = ["train", "--dataset", "digits", "--no-progress", "--on-nonfinite", "skip"]


@pytest.mark.parametrize("mode", [[], ["--parallel", "pipeline"]], ids=["data", "pipeline"])
def test_a_run_that_skips_nearly_every_step_fails_on_every_rank(tmp_path, mode):
    r = run_mpi(2, *ARGS, *mode, "--epochs", "3", "--lr", "1e30", "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.count("mpidp: error:") == 1 and "were skipped, more than the 0.5" in r.stderr
    assert "skipped 22 steps (NaN/Inf)" in r.stdout  # the epoch is reported first
    assert not (tmp_path / "o" / "model.npz").exists()


def test_the_bound_can_be_raised_and_each_epoch_says_what_it_skipped(tmp_path):
    r = run_mpi(2, *ARGS, "--epochs", "2", "--out", str(tmp_path / "o"),
                env={"MPIDP_FAULT": "nan@1:3"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "skipped 1 steps (NaN/Inf)" in r.stdout
    history = json.loads((tmp_path / "o" / "metrics.json").read_text())["history"]
    assert [h["skipped"] for h in history] == [1, 0]
    r = run_mpi(2, *ARGS, "--epochs", "1", "--lr", "1e30", "--max-skipped", "1",
                "--out", str(tmp_path / "p"))
    assert r.returncode == 0 and "skipped 22 steps" in r.stdout, r.stderr[-2000:]


def test_max_skipped_needs_a_share(tmp_path):
    r = run_mpi(1, *ARGS, "--max-skipped", "1.5", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--max-skipped" in r.stderr
