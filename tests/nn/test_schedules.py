"""Learning-rate schedules against plain formulas, warmup joins, configs that rebuild them,
and the optimizer's use of them (rate per update count, lr_scale, a resumed count)."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from mpidp import nn
from mpidp.nn import schedules as S
from mpidp.nn.schedules import Constant, Cosine, Exponential, MultiStep, Polynomial, StepDecay, Warmup

T = range(0, 40)


def _values(s: S.Schedule, ts=T) -> list[float]:
    return [s(t) for t in ts]


def test_constant():
    assert _values(Constant(0.3)) == [0.3] * len(T)


def test_step_decay_against_formula():
    s = StepDecay(0.5, step_size=7, gamma=0.3)
    want = [0.5 * 0.3 ** (t // 7) for t in T]
    np.testing.assert_allclose(_values(s), want, rtol=1e-15)
    assert s(6) == 0.5 and s(7) == pytest.approx(0.15) and s(13) == s(7) and s(14) < s(13)


def test_multistep_against_formula():
    s = MultiStep(1.0, milestones=(3, 10, 25), gamma=0.5)
    want = [1.0 * 0.5 ** sum(t >= m for m in (3, 10, 25)) for t in T]
    np.testing.assert_allclose(_values(s), want, rtol=1e-15)
    assert (s(2), s(3), s(9), s(10), s(25)) == (1.0, 0.5, 0.5, 0.25, 0.125)


def test_exponential_against_formula():
    s = Exponential(0.2, gamma=0.9)
    np.testing.assert_allclose(_values(s), [0.2 * 0.9 ** t for t in T], rtol=1e-14)


def test_cosine_against_formula_with_floor():
    s = Cosine(0.4, total=30, min_lr=0.01)
    want = [0.01 + (0.4 - 0.01) * (1 + math.cos(math.pi * min(t, 30) / 30)) / 2 for t in T]
    np.testing.assert_allclose(_values(s), want, rtol=1e-14)
    assert s(0) == 0.4 and s(30) == 0.01 and s(1000) == 0.01
    assert s(15) == pytest.approx((0.4 + 0.01) / 2)
    assert all(a >= b for a, b in zip(_values(s), _values(s)[1:]))  # never rises


def test_polynomial_against_formula():
    s = Polynomial(0.1, total=20, power=2.0, end_lr=0.001)
    want = [0.001 + (0.1 - 0.001) * (1 - min(t, 20) / 20) ** 2 for t in T]
    np.testing.assert_allclose(_values(s), want, rtol=1e-14)
    assert Polynomial(1.0, 4)(2) == 0.5  # power 1: linear to 0


@pytest.mark.parametrize("after", [Constant(0.8), Cosine(0.8, 25, 0.05), StepDecay(0.8, 5, 0.5),
                                   MultiStep(0.8, (4, 9)), Exponential(0.8, 0.95),
                                   Polynomial(0.8, 12)], ids=lambda s: s.name)
@pytest.mark.parametrize("start", [0.0, 0.1])
def test_warmup_in_front_of_any_schedule(after, start):
    """A linear ramp of 6 updates from ``start`` (at t = -1) to the base rate (at t = 5),
    then the schedule from its own t = 0: the join is continuous."""
    s = Warmup(after, warmup=6, start=start)
    ramp = [start + (0.8 - start) * (t + 1) / 6 for t in range(6)]
    np.testing.assert_allclose(_values(s, range(6)), ramp, rtol=1e-15)
    assert s(5) == pytest.approx(0.8) and s(6) == after(0) == 0.8
    np.testing.assert_allclose(_values(s, range(6, 40)), _values(after, range(34)), rtol=0)
    assert s(0) == pytest.approx(start + (0.8 - start) / 6) and s(0) > 0  # ~0, not 0: it moves
    assert all(a < b for a, b in zip(ramp, ramp[1:]))


def test_warmup_of_a_plain_rate():
    s = Warmup(0.6, 3)
    assert s.after == Constant(0.6)
    np.testing.assert_allclose(_values(s, range(6)), [0.2, 0.4, 0.6, 0.6, 0.6, 0.6])


ALL = [Constant(0.3), StepDecay(0.5, 7, 0.3), MultiStep(1.0, (3, 10), 0.5), Exponential(0.2, 0.9),
       Cosine(0.4, 30, 0.01), Polynomial(0.1, 20, 2.0, 0.001), Warmup(Cosine(0.4, 30), 5, 0.01),
       Warmup(Warmup(0.3, 2), 3)]


@pytest.mark.parametrize("s", ALL, ids=lambda s: s.name)
def test_config_is_json_and_rebuilds_the_same_schedule(s):
    config = json.loads(json.dumps(s.config()))
    again = S.schedule_from_config(config)
    assert again == s and type(again) is type(s)
    assert _values(again) == _values(s)
    assert S.as_schedule(config) == s


def test_make_schedule_by_name():
    assert set(S.SCHEDULES) == {"constant", "step", "multistep", "exponential", "cosine", "polynomial"}
    assert S.make_schedule("constant", 0.1) == Constant(0.1)
    assert S.make_schedule("cosine", 0.1, total=50, min_lr=1e-3) == Cosine(0.1, 50, 1e-3)
    assert S.make_schedule("step", 0.1, step_size=3) == StepDecay(0.1, 3)
    assert S.make_schedule("multistep", 0.1, milestones=[5, 8]) == MultiStep(0.1, (5, 8))
    w = S.make_schedule("cosine", 0.1, total=50, warmup=10, warmup_start=0.01)
    assert w == Warmup(Cosine(0.1, 50), 10, 0.01)
    assert S.make_schedule("exponential", 0.1, gamma=0.5, warmup=0) == Exponential(0.1, 0.5)


@pytest.mark.parametrize("make, match", [
    (lambda: S.make_schedule("linear-ish", 0.1), "unknown learning-rate schedule 'linear-ish'"),
    (lambda: S.make_schedule("cosine", 0.1), "total"),
    (lambda: S.make_schedule("cosine", 0.1, total=10, gamma=0.5), "no setting \\['gamma'\\]"),
    (lambda: S.schedule_from_config({"lr": 0.1}), "'name'"),
    (lambda: Constant(0.0), "lr must be"),
    (lambda: Constant(float("nan")), "lr must be"),
    (lambda: StepDecay(0.1, 0), "step_size"),
    (lambda: StepDecay(0.1, 2.5), "step_size"),
    (lambda: MultiStep(0.1, (5, 3)), "increase"),
    (lambda: Exponential(0.1, 0.0), "gamma"),
    (lambda: Cosine(0.1, 10, min_lr=0.2), "above"),
    (lambda: Cosine(0.1, 10, min_lr=-1), "min_lr"),
    (lambda: Polynomial(0.1, 10, power=0), "power"),
    (lambda: Warmup(0.1, 0), "warmup"),
    (lambda: Warmup(0.1, 5, start=0.5), "above the base rate"),
    (lambda: Constant(0.1)(-1), "t >= 0"),
])
def test_bad_settings_name_the_problem(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_scaled_lr():
    assert S.scaled_lr(0.1, 1024, 256) == pytest.approx(0.4)
    assert S.scaled_lr(0.1, 64, 256) == pytest.approx(0.025)
    assert S.scaled_lr(1e-3, 1024, 256, rule="sqrt") == pytest.approx(2e-3)
    with pytest.raises(ValueError, match="rule"):
        S.scaled_lr(0.1, 2, 1, rule="cubic")
    with pytest.raises(ValueError):
        S.scaled_lr(0.1, 0, 256)


# --- the optimizer's side ---------------------------------------------------------------

def test_optimizer_uses_the_rate_of_each_update_count():
    """Plain SGD on a unit gradient moves by exactly the scheduled rate of update t."""
    s = Warmup(Cosine(0.5, 12, 0.05), 4)
    opt, p = nn.SGD(s), np.zeros(1)
    moved = []
    for t in range(20):
        assert opt.lr == opt.lr_at(t) == s(t)  # the rate the next update will use
        before = p[0]
        opt.step_(p, np.ones(1))
        moved.append(before - p[0])
    np.testing.assert_allclose(moved, _values(s, range(20)), rtol=1e-12)
    assert isinstance(opt.schedule, Warmup)


def test_a_float_is_a_constant_and_lr_can_be_set():
    opt = nn.Adam(0.01)
    assert opt.schedule == Constant(0.01) and opt.lr == 0.01
    opt.lr = 0.02
    assert opt.lr == 0.02 and opt.lr_at(100) == 0.02
    opt.lr = S.make_schedule("step", 0.1, step_size=2)
    assert opt.lr == 0.1
    opt.t = 5
    assert opt.lr == pytest.approx(0.1 * 0.1 ** 2)
    with pytest.raises(TypeError, match="learning rate"):
        nn.SGD("0.1")


def test_lr_scale_multiplies_every_rate():
    s = Cosine(0.4, 10)
    a, b = nn.SGD(s), nn.SGD(s)
    b.lr_scale = 0.5
    pa, pb = np.zeros(1), np.zeros(1)
    for t in range(6):
        assert b.lr_at(t) == 0.5 * a.lr_at(t)
        a.step_(pa, np.ones(1))
        b.step_(pb, np.ones(1))
    np.testing.assert_allclose(pb, 0.5 * pa, rtol=1e-14)


@pytest.mark.parametrize("make", [lambda s: nn.SGD(s, momentum=0.9), lambda s: nn.Adam(s),
                                  lambda s: nn.LAMB(s), lambda s: nn.LARS(s, weight_decay=1e-3)],
                         ids=["momentum", "adam", "lamb", "lars"])
def test_resuming_from_t_and_state_continues_bit_identically(make):
    """What a checkpoint holds (t and the flat state) is all a schedule needs: a fresh
    optimizer given them continues exactly as the uninterrupted one."""
    s = Warmup(Cosine(0.3, 15, 0.01), 5)
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(8) for _ in range(12)]
    p0 = rng.standard_normal(8)
    straight, p = make(s), p0.copy()
    for g in grads:
        straight.step_(p, g.copy())
    first, q = make(s), p0.copy()
    for g in grads[:7]:
        first.step_(q, g.copy())
    again = make(S.schedule_from_config(json.loads(json.dumps(s.config()))))
    again.t, again.state = first.t, {k: v.copy() for k, v in first.state.items()}
    for g in grads[7:]:
        again.step_(q, g.copy())
    assert np.array_equal(p, q) and again.t == straight.t == 12


def _documented() -> tuple[dict[str, str], str]:
    """The formulas of docs/training.md as printed: schedule name -> its rate after the
    warmup, and the warmup's rate."""
    from helpers import ROOT
    text = (ROOT / "docs" / "training.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)`(?: \(default\))? \| `([^`]+)`", text, re.M))
    ramp = re.search(r"for `t < W`, the warmup ramps linearly to the rate that follows it: "
                     r"`([^`]+)`", text.replace("\n", " "))
    return rows, ramp[1]


def _evaluate(formula: str, **names) -> float:
    """A documented formula in Python: ``x`` multiplies, ``^`` raises, ``#{i : cond}``
    counts the milestones ``E_i`` for which ``cond`` holds."""
    py = re.sub(r"#\{i : ([^}]+)\}", r"sum(1 for E_i in milestones if \1)", formula)
    py = py.replace(" x ", " * ").replace("^", "**")
    return eval(py, {"floor": math.floor, "cos": math.cos, "pi": math.pi, **names})  # noqa: S307


@pytest.mark.parametrize("W", [0, 5, 12, 30])
@pytest.mark.parametrize("name", ["constant", "step", "multistep", "exponential", "cosine",
                                  "polynomial"])
def test_each_schedule_is_the_formula_docs_training_prints(name, W):
    """With warmup, step and exponential count from its end and multistep's milestones are
    epochs of the whole run: the page says so and gives the shift; this holds the code to it."""
    rows, warmup = _documented()
    S_, E, N, ms, gamma, lr, m = 7, 9, 2, [1, 3, 6], 0.5, 0.3, 0.01
    schedule = S.epoch_schedule(name, lr, S_, E, warmup_steps=W, step_epochs=N, milestones=ms,
                                gamma=gamma, min_lr=m)
    for t in range(E * S_):
        names = dict(W=W, S=S_, N=N, T=E * S_ - W, lr=lr, m=m, gamma=gamma, milestones=ms)
        r = lambda u, names=names: _evaluate(rows[name], t=u, **names)  # noqa: E731
        want = r(t) if t >= W else _evaluate(warmup, t=t, r=r, **names)
        assert schedule(t) == pytest.approx(want, rel=1e-12, abs=0), (name, t, rows[name])
