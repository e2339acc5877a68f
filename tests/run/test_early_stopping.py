"""EarlyStopping and ReduceOnPlateau (mpidp.run.early_stopping): decisions on sequences
with and without improvements, min_delta at its edge, NaN, and a restore mid-way (through
JSON, as a checkpoint) deciding as the uninterrupted machine."""

from __future__ import annotations

import json
import math

import pytest

from mpidp.run.early_stopping import EarlyStopping, ReduceOnPlateau


def _feed(machine, values):
    return [machine.update(v) for v in values]


def test_stops_after_patience_bad_epochs():
    es = EarlyStopping(patience=2)
    assert _feed(es, [1.0, 0.5, 0.75, 0.5, 0.25, 0.25, 0.5]) == \
        [False, False, False, True, False, False, True]
    assert es.best == 0.25 and es.best_epoch == 4 and es.bad_epochs == 2 and es.epochs == 7


def test_always_improving_never_stops_and_patience_0_stops_at_once():
    es = EarlyStopping(patience=1)
    assert not any(_feed(es, [10.0 - i for i in range(20)]))
    assert es.best == -9.0 and es.best_epoch == 19 and es.bad_epochs == 0
    es0 = EarlyStopping(patience=0)
    assert _feed(es0, [1.0, 0.5, 0.5]) == [False, False, True]


def test_mode_max():
    es = EarlyStopping(patience=2, mode="max")
    assert _feed(es, [0.5, 0.75, 0.75, 0.5, 0.875, 0.0, 0.0]) == \
        [False, False, False, True, False, False, True]
    assert es.best == 0.875 and es.best_epoch == 4


@pytest.mark.parametrize("mode,sign", [("min", 1.0), ("max", -1.0)])
def test_min_delta_edges(mode, sign):
    """An improvement must beat the best by MORE than min_delta; the best moves only then
    (values chosen exact in binary, so the edge is exact)."""
    es = EarlyStopping(patience=3, min_delta=0.25, mode=mode)
    v = lambda x: sign * x
    es.update(v(1.0))
    assert not es.improves(v(0.75))          # exactly min_delta better: not enough
    assert es.improves(v(0.6875))            # more than min_delta better
    assert _feed(es, [v(0.75), v(0.8125), v(0.5)]) == [False, False, False]
    assert es.best == v(0.5) and es.best_epoch == 3 and es.bad_epochs == 0
    assert _feed(es, [v(0.375), v(0.3125), v(0.25)]) == [False, False, True]  # creeping down
    assert es.best == v(0.5)                 # by less than min_delta each: never the best
    zero = EarlyStopping(patience=1, mode=mode)  # min_delta 0: any strict improvement
    assert _feed(zero, [v(1.0), v(1.0)]) == [False, True]
    assert not zero.improves(v(1.0)) and zero.improves(v(1.0 - 2 ** -40))


def test_nan_and_inf_never_improve():
    es = EarlyStopping(patience=2)
    assert _feed(es, [math.nan, math.inf]) == [False, True]
    assert es.best is None and es.best_epoch is None
    assert _feed(es, [3.0, math.nan, -math.inf]) == [False, False, True]
    assert es.best == 3.0 and es.best_epoch == 2
    json.dumps(es.state(), allow_nan=False)  # strict JSON: the best is always finite


def _run_with_restore(make, values, cut):
    """Decisions of one machine over ``values``, and of one restored at ``cut`` from the
    JSON of the first's state."""
    whole = make()
    straight = _feed(whole, values)
    first = make()
    head = _feed(first, values[:cut])
    saved = json.loads(json.dumps(first.state()))
    second = make()
    second.restore(saved)
    resumed = head + _feed(second, values[cut:])
    assert second.state() == whole.state()
    return straight, resumed


SEQ = [1.0, 0.9, 0.95, 0.97, 0.85, math.nan, 0.86, 0.87, 0.88, 0.84, 0.90, 0.91, 0.92, 0.93]


@pytest.mark.parametrize("cut", range(len(SEQ) + 1))
def test_restore_mid_way_gives_the_same_decisions(cut):
    for make in (lambda: EarlyStopping(patience=2, min_delta=0.005),
                 lambda: ReduceOnPlateau(factor=0.5, patience=1, min_scale=0.1, cooldown=1)):
        straight, resumed = _run_with_restore(make, SEQ, cut)
        assert straight == resumed


def test_restore_refuses_a_foreign_state():
    with pytest.raises(ValueError, match="lacks"):
        EarlyStopping(2).restore({"best": 1.0})
    with pytest.raises(ValueError, match="lacks"):
        ReduceOnPlateau().restore(EarlyStopping(2).state())


def test_reduce_on_plateau():
    r = ReduceOnPlateau(factor=0.5, patience=2, min_scale=0.125)
    scales = _feed(r, [1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 0.25])
    assert scales == [1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.125, 0.125, 0.125, 0.125, 0.125,
                      0.125]
    assert r.reductions == 3 and r.best == 0.25 and r.bad_epochs == 0  # floored at min_scale
    improving = ReduceOnPlateau(factor=0.1, patience=0)
    assert _feed(improving, [3.0, 2.0, 1.0]) == [1.0, 1.0, 1.0]
    assert improving.update(1.0) == pytest.approx(0.1)  # patience 0: every bad epoch


def test_reduce_on_plateau_cooldown():
    r = ReduceOnPlateau(factor=0.5, patience=1, cooldown=2)
    assert _feed(r, [1.0, 2.0, 2.0, 2.0, 2.0, 2.0]) == [1.0, 0.5, 0.5, 0.5, 0.25, 0.25]
    r0 = ReduceOnPlateau(factor=0.5, patience=0, cooldown=1, mode="max")
    assert _feed(r0, [1.0, 0.0, 0.0, 0.0, 2.0, 0.0]) == [1.0, 0.5, 0.5, 0.25, 0.25, 0.125]


@pytest.mark.parametrize("make,match", [
    (lambda: EarlyStopping(-1), "patience"), (lambda: EarlyStopping(1.5), "patience"),
    (lambda: EarlyStopping(1, min_delta=-0.1), "min_delta"),
    (lambda: EarlyStopping(1, mode="lowest"), "mode"),
    (lambda: ReduceOnPlateau(factor=1.0), "factor"),
    (lambda: ReduceOnPlateau(min_scale=2), "min_scale"),
    (lambda: ReduceOnPlateau(cooldown=-1), "cooldown"),
])
def test_bad_settings_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()
