"""Learning-rate schedules, large-batch optimizers and clipping through ``mpidp train``:
the rates each epoch records, a resume in the middle of a schedule, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import parser_refusal, run_here, run_mpi

BASE = ["train", "--dataset", "digits", "--no-progress", "--seed", "1", "--dtype", "float64",
        "--batch-size", "128"]
STEPS = 12  # ceil(1438 training rows / 128) updates per epoch


def _history(out) -> list[dict]:
    return json.loads((Path(out) / "metrics.json").read_text())["history"]


def test_a_step_schedule_with_warmup_and_linear_scaling_records_its_rates(tmp_path):
    r = run_mpi(2, *BASE, "--epochs", "4", "--lr", "0.01", "--lr-scaling", "linear",
                "--base-batch", "64", "--lr-schedule", "step", "--lr-step-epochs", "1",
                "--lr-gamma", "0.5", "--warmup-steps", "6", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr[-3000:]
    base = 0.01 * 128 / 64  # the linear scaling rule
    # update t (0-based) after the 6 warmup updates has rate base * 0.5^floor((t-6)/12)
    want = [base * 0.5 ** ((e * STEPS - 1 - 6) // STEPS) for e in range(1, 5)]
    got = [h["lr"] for h in _history(tmp_path / "o")]
    assert np.allclose(got, want, rtol=1e-12), (got, want)


@pytest.mark.parametrize("optimizer, lr", [("lamb", "0.01"), ("lars", "1.0"), ("adamw", "0.003")])
def test_large_batch_optimizers_resume_mid_schedule_on_other_ranks_to_the_same_model(tmp_path,
                                                                               optimizer, lr):
    args = [*BASE, "--optimizer", optimizer, "--lr", lr, "--lr-schedule", "cosine",
            "--warmup-epochs", "1", "--clip-norm", "1.0"]
    ck = tmp_path / "ck"  # checkpoints every 10 steps, all kept
    r = run_mpi(2, *args, "--epochs", "4", "--checkpoint-dir", str(ck), "--checkpoint-every",
                "10", "--keep-checkpoints", "10", "--out", str(tmp_path / "ref"))
    assert r.returncode == 0, r.stderr[-3000:]
    for late in sorted(ck.glob("ckpt-*.npz"))[2:]:  # as if stopped in its third epoch (at
        late.unlink()  # step 29; tests/run/test_faults.py stops runs by faults)
    assert sorted(p.name for p in ck.glob("ckpt-*.npz"))[-1].endswith("20.npz")
    r = run_mpi(3, *args, "--epochs", "4", "--checkpoint-dir", str(ck), "--resume", "--out",
                str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr[-3000:]
    ref, resumed = _history(tmp_path / "ref"), _history(tmp_path / "b")
    assert [h["lr"] for h in ref] == [h["lr"] for h in resumed]
    assert ref[-1]["lr"] < ref[1]["lr"] < ref[0]["lr"] * STEPS  # warmup, then the cosine
    with np.load(tmp_path / "ref" / "model.npz") as a, np.load(tmp_path / "b" / "model.npz") as b:
        assert np.max(np.abs(a["params"] - b["params"])) <= 1e-10


def test_the_plateau_rule_lowers_the_rate_when_the_validation_loss_stalls(tmp_path):
    r = run_mpi(2, *BASE, "--epochs", "12", "--lr", "0.5", "--val-fraction", "0.2",
                "--lr-schedule", "plateau", "--plateau-factor", "0.5", "--plateau-patience",
                "1", "--out", str(tmp_path / "o"))
    assert r.returncode == 0, r.stderr[-3000:]
    h = _history(tmp_path / "o")
    scales = [x["lr_scale"] for x in h]
    assert scales[-1] < 1.0 and all(b <= a for a, b in zip(scales, scales[1:]))
    assert np.allclose([x["lr"] for x in h[1:]], [0.5 * s for s in scales[:-1]])


@pytest.mark.parametrize("extra, message", [
    (["--lr-schedule", "step"], "--lr-schedule step needs --lr-step-epochs"),
    (["--lr-schedule", "multistep"], "--lr-schedule multistep needs --lr-milestones"),
    (["--lr-milestones", "3,2", "--lr-schedule", "multistep"], "give increasing epochs"),
    (["--lr-min", "0.001"], "--lr-min does not apply to --lr-schedule constant"),
    (["--lr-schedule", "plateau"], "--lr-schedule plateau needs --val-fraction"),
    (["--warmup-epochs", "1", "--warmup-steps", "3"], "give one"),
    (["--lr-schedule", "cosine", "--lr", "0.01", "--lr-min", "0.1"],
     "--lr-min 0.1 is above the learning rate 0.01 (--lr)"),
    (["--epochs", "2", "--warmup-epochs", "2"], "--warmup-epochs 2 is not shorter than the run "
     f"({2 * STEPS} updates in --epochs 2): every update would be warmup"),
    (["--epochs", "2", "--warmup-steps", str(10**12)], "every update would be warmup"),
    (["--base-batch", "32"], "--base-batch needs --lr-scaling"),
    (["--lr-schedule", "cosine", "--sync", "async-ps"], "--lr-schedule does not apply to"),
    (["--clip-norm", "0"], "--clip-norm"),
    (["--optimizer", "lion"], "invalid choice: 'lion'"),
])
def test_schedule_options_that_cannot_work_are_refused(tmp_path, capsys, extra, message):
    """Refused by the parser, or by the job: async-ps by a job of 2 ranks (it needs 2), the
    others as a job of one rank in this process (the same checks, before MPI's first
    collective)."""
    err = parser_refusal(capsys, *BASE, *extra, "--out", str(tmp_path / "o"))
    if err is not None:
        assert message in err and not (tmp_path / "o").exists(), err
        return
    if "async-ps" in extra:
        r = run_mpi(2, *BASE, *extra, "--out", str(tmp_path / "o"))
    else:
        r = run_here(capsys, *BASE, *extra, "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "o" / "model.npz").exists()
