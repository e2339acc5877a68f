"""RunSpec: one settings object for every trainer kind, filled from keyword arguments."""

from __future__ import annotations

import subprocess
import sys

import pytest

from mpidp.errors import MpidpError
from mpidp.run.spec import Checkpointing, RunSpec


def test_keywords_fill_a_new_spec_and_defaults_hold():
    spec = RunSpec.of(epochs=3, batch_size=16, seed=4, drop_last=True)
    assert (spec.epochs, spec.batch_size, spec.seed, spec.shuffle, spec.drop_last) == \
        (3, 16, 4, True, True)
    assert spec.partition is None and spec.checkpoint is None and spec.check_every == 0


def test_keywords_override_a_given_spec_and_leave_it_unchanged():
    base = RunSpec(2, 32, seed=1)
    spec = RunSpec.of(base, epochs=5, shuffle=False)
    assert (spec.epochs, spec.batch_size, spec.seed, spec.shuffle) == (5, 32, 1, False)
    assert (base.epochs, base.shuffle) == (2, True)
    assert RunSpec.of(base, epochs=None, batch_size=None) == base  # None: keep the spec's


def test_an_unknown_setting_is_named():
    with pytest.raises(TypeError, match="unknown run setting.*batchsize"):
        RunSpec.of(epochs=1, batchsize=8)


def test_epochs_and_batch_size_are_required_without_a_spec():
    with pytest.raises(TypeError, match="missing run setting.*batch_size"):
        RunSpec.of(epochs=1)


@pytest.mark.parametrize("field, value", [("epochs", 0), ("batch_size", 0), ("batch_size", 2.5),
                                          ("seed", -1), ("check_every", -1), ("epochs", True)])
def test_bad_values_are_refused_by_name(field, value):
    settings = {"epochs": 1, "batch_size": 4, field: value}
    with pytest.raises(MpidpError, match=f"{field} must be an integer"):
        RunSpec(**settings)


def test_checkpointing_refuses_non_positive_periods():
    with pytest.raises(ValueError, match="every/keep"):
        Checkpointing("ck", 0)


def test_checkpointing_names_a_period_that_is_not_an_integer():
    with pytest.raises(ValueError, match="every/keep must be integers"):
        Checkpointing("ck", "5")


def test_numpy_integers_are_integers():
    import numpy as np
    spec = RunSpec(np.int32(2), np.int64(16), seed=np.int64(3), check_every=np.uint8(1))
    assert (spec.epochs, spec.batch_size, spec.seed, spec.check_every) == (2, 16, 3, 1)
    assert all(type(v) is int for v in (spec.epochs, spec.batch_size, spec.seed))


def test_the_spec_starts_no_mpi():
    code = ("import sys; from mpidp.run.spec import RunSpec; RunSpec(1, 2); "
            "assert 'mpi4py.MPI' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_step_stats_show_means_first():
    from mpidp.run.stats import StepStats
    s = StepStats(12.0, 8, 6)
    assert (s.loss, s.accuracy) == (1.5, 0.75)
    assert repr(s) == "StepStats(loss=1.5, accuracy=0.75, count=8, loss_sum=12, correct=6)"
    assert repr(StepStats(0.0, 0, 0, skipped=True)).endswith("correct=0, skipped=True)")
