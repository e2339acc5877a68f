"""Learning-rate schedules: pure functions of the optimizer's update count ``t`` (0 for the first
update), so a resumed run, at any number of ranks, continues the same rates. A schedule is a
frozen dataclass ``schedule(t) -> float``; :func:`make_schedule` builds one by name,
:func:`epoch_schedule` from settings in epochs."""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from functools import partial
from typing import Any, ClassVar

SCHEDULES = ("constant", "step", "multistep", "exponential", "cosine", "polynomial")


def _positive(what: str, value: float, zero: bool = False) -> float:
    """``value`` as a float, checked finite and > 0 (``zero``: >= 0)."""
    value = float(value)
    if not (value >= 0 if zero else value > 0) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number {'>=' if zero else '>'} 0, got {value}")
    return value


_at_least_zero = partial(_positive, zero=True)


def _count(what: str, value: int, least: int = 1) -> int:
    if isinstance(value, bool) or int(value) != value or value < least:
        raise ValueError(f"{what} must be a whole number >= {least}, got {value!r}")
    return int(value)


def _milestones(what: str, value: tuple[int, ...]) -> tuple[int, ...]:
    ms = tuple(_count("a milestone", m, 0) for m in value)
    if list(ms) != sorted(set(ms)):
        raise ValueError(f"{what} must increase strictly, got {list(ms)}")
    return ms


class Schedule:
    """Base class: ``__call__(t) -> float`` the rate of update ``t`` (0: the first), from ``_rate(t)``."""

    name: ClassVar[str] = ""
    #: each setting's check, in order: ``check(name, value)`` returns the value kept
    _checks: ClassVar[dict[str, Callable[[str, Any], Any]]] = {}
    _end: ClassVar[str] = ""  # the setting of the rate decayed to, which may not exceed lr

    def __post_init__(self) -> None:
        for key, check in self._checks.items():
            object.__setattr__(self, key, check(key, getattr(self, key)))
        if self._end and getattr(self, self._end) > self.lr:
            raise ValueError(f"{self._end} {getattr(self, self._end)} is above lr {self.lr}")

    def __call__(self, t: int) -> float:
        if t < 0:
            raise ValueError(f"a schedule is defined for update counts t >= 0, got {t}")
        return self._rate(int(t))

    def _rate(self, t: int) -> float:
        raise NotImplementedError

    @property
    def base(self) -> float:
        """The rate at ``t = 0`` without warmup: what a warmup ramps up to."""
        return self(0)

    def config(self) -> dict[str, Any]:
        """JSON-able settings: ``{"name": ..., **fields}``; see :func:`schedule_from_config`."""
        return {"name": self.name, **{k: list(v) if isinstance(v, tuple) else v
                                      for k, v in asdict(self).items()}}  # type: ignore


@dataclass(frozen=True)
class Constant(Schedule):
    """``lr`` for every update."""

    name: ClassVar[str] = "constant"
    _checks = {"lr": _positive}
    lr: float

    def _rate(self, t: int) -> float:
        return self.lr


@dataclass(frozen=True)
class StepDecay(Schedule):
    """``lr * gamma ** (t // step_size)``: times ``gamma`` every ``step_size`` updates."""

    name: ClassVar[str] = "step"
    _checks = {"lr": _positive, "step_size": _count, "gamma": _positive}
    lr: float
    step_size: int
    gamma: float = 0.1

    def _rate(self, t: int) -> float:
        return self.lr * self.gamma ** (t // self.step_size)


@dataclass(frozen=True)
class MultiStep(Schedule):
    """``lr * gamma ** k``, ``k`` the number of ``milestones`` (update counts) ``<= t``."""

    name: ClassVar[str] = "multistep"
    _checks = {"lr": _positive, "milestones": _milestones, "gamma": _positive}
    lr: float
    milestones: tuple[int, ...]
    gamma: float = 0.1

    def _rate(self, t: int) -> float:
        return self.lr * self.gamma ** bisect.bisect_right(self.milestones, t)


@dataclass(frozen=True)
class Exponential(Schedule):
    """``lr * gamma ** t``."""

    name: ClassVar[str] = "exponential"
    _checks = {"lr": _positive, "gamma": _positive}
    lr: float
    gamma: float

    def _rate(self, t: int) -> float:
        return self.lr * self.gamma ** t


@dataclass(frozen=True)
class Cosine(Schedule):
    """Half a cosine from ``lr`` (``t = 0``) down to ``min_lr`` (``t = total`` and after)."""

    name: ClassVar[str] = "cosine"
    _checks = {"lr": _positive, "total": _count, "min_lr": _at_least_zero}
    lr: float
    total: int
    min_lr: float = 0.0
    _end = "min_lr"

    def _rate(self, t: int) -> float:
        if t >= self.total:
            return self.min_lr
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1 + math.cos(math.pi * t / self.total))


@dataclass(frozen=True)
class Polynomial(Schedule):
    """``end_lr + (lr - end_lr) * (1 - t / total) ** power``, ``end_lr`` from ``total`` on
    (``power = 1``: a linear decay, as BERT's LAMB runs use)."""

    name: ClassVar[str] = "polynomial"
    _checks = {"lr": _positive, "total": _count, "power": _positive, "end_lr": _at_least_zero}
    lr: float
    total: int
    power: float = 1.0
    end_lr: float = 0.0
    _end = "end_lr"

    def _rate(self, t: int) -> float:
        if t >= self.total:
            return self.end_lr
        return self.end_lr + (self.lr - self.end_lr) * (1 - t / self.total) ** self.power


@dataclass(frozen=True)
class Warmup(Schedule):
    """A linear ramp of ``warmup`` updates in front of ``after`` (a schedule or a rate):
    ``start + (after.base - start) * (t + 1) / warmup`` for ``t < warmup`` (the base rate
    at ``t = warmup - 1``), then ``after(t - warmup)``."""

    name: ClassVar[str] = "warmup"
    after: Schedule
    warmup: int
    start: float = 0.0
    _base: float = field(init=False, repr=False, compare=False)
    _checks = {"after": lambda _, v: as_schedule(v), "warmup": _count,
               "start": lambda _, v: _at_least_zero("warmup start", v)}

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "_base", self.after.base)
        if self.start > self._base:
            raise ValueError(f"warmup start {self.start} is above the base rate {self._base}")

    @property
    def base(self) -> float:
        return self._base

    def _rate(self, t: int) -> float:
        if t >= self.warmup:
            return self.after(t - self.warmup)
        return self.start + (self._base - self.start) * (t + 1) / self.warmup

    def config(self) -> dict[str, Any]:
        return {"name": self.name, "warmup": self.warmup, "start": self.start, "after": self.after.config()}


_BY_NAME: dict[str, type[Schedule]] = {
    cls.name: cls for cls in (Constant, StepDecay, MultiStep, Exponential, Cosine, Polynomial, Warmup)}


def schedule_from_config(config: dict[str, Any]) -> Schedule:
    """The schedule a :meth:`Schedule.config` dict describes (``ValueError`` naming what is
    wrong: an unknown name, a missing or unknown setting)."""
    if not isinstance(config, dict) or "name" not in config:
        raise ValueError(f"a schedule's config is a dict with a 'name', got {config!r}")
    settings = dict(config)
    name = settings.pop("name")
    if (cls := _BY_NAME.get(name)) is None:
        raise ValueError(f"unknown learning-rate schedule {name!r}; expected one of {(*SCHEDULES, 'warmup')}")
    known = {f.name for f in fields(cls) if f.init}
    if unknown := sorted(set(settings) - known):
        raise ValueError(f"schedule {name!r} has no setting {unknown}; its settings are {sorted(known)}")
    try:
        return cls(**settings)
    except TypeError as exc:  # a required setting is missing
        raise ValueError(f"schedule {name!r}: {exc}; its settings are {sorted(known)}") from None


def make_schedule(name: str, lr: float, *, warmup: int = 0, warmup_start: float = 0.0,
                  **settings: Any) -> Schedule:
    """A schedule by name (:data:`SCHEDULES`) with base rate ``lr`` and its ``settings``
    (``step_size``, ``milestones``, ``gamma``, ``total``, ``min_lr``, ``power``,
    ``end_lr``), behind a :class:`Warmup` of ``warmup`` updates from ``warmup_start``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {name!r}; expected one of {SCHEDULES}")
    schedule = schedule_from_config({"name": name, "lr": lr, **settings})
    return Warmup(schedule, warmup, warmup_start) if warmup else schedule


def epoch_schedule(name: str, lr: float, per_epoch: int, epochs: int, *, warmup_steps: int = 0,
                   warmup_epochs: float = 0.0, step_epochs: int | None = None,
                   milestones: Sequence[int] = (), gamma: float = 0.1, min_lr: float = 0.0) -> Schedule:
    """The schedule ``name`` (:data:`SCHEDULES`, or ``"plateau"``: constant) from ``lr`` for ``epochs`` epochs
    of ``per_epoch`` updates: a warmup (``warmup_steps``, else ``warmup_epochs``), then a decay by ``gamma``
    every ``step_epochs``, at ``milestones`` or per epoch, or to ``min_lr`` at the end of the run. The step,
    exponential, cosine and polynomial decays count from the end of the warmup; milestones are epochs of the
    whole run (those within the warmup lower the rate it ramps to), as docs/training.md states."""
    warmup = warmup_steps or int(round(warmup_epochs * per_epoch))
    total = max(epochs * per_epoch - warmup, 1)
    settings = {}
    if name == "step":
        settings = {"step_size": step_epochs * per_epoch, "gamma": gamma}
    elif name == "multistep":
        milestones = _milestones("milestones", milestones)
        passed = sum(m * per_epoch <= warmup for m in milestones)  # by the warmup's end
        lr *= gamma ** passed
        settings = {"milestones": [m * per_epoch - warmup for m in milestones[passed:]], "gamma": gamma}
    elif name == "exponential":
        settings = {"gamma": gamma ** (1.0 / per_epoch)}
    elif name in ("cosine", "polynomial"):
        settings = {"total": total, "min_lr" if name == "cosine" else "end_lr": min_lr}
    return make_schedule("constant" if name == "plateau" else name, lr, warmup=warmup, **settings)


def as_schedule(lr: float | Schedule | dict[str, Any]) -> Schedule:
    """``lr`` as a schedule: a number is :class:`Constant`, a dict a config."""
    if isinstance(lr, Schedule):
        return lr
    if isinstance(lr, dict):
        return schedule_from_config(lr)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) and not hasattr(lr, "__float__"):
        raise TypeError(f"a learning rate is a number or a mpidp.nn.schedules.Schedule, "
                        f"got {type(lr).__name__}")
    return Constant(float(lr))


def scaled_lr(base_lr: float, global_batch: int, base_batch: int, rule: str = "linear") -> float:
    """The rate for a global batch of ``global_batch`` when ``base_lr`` suits ``base_batch``:
    ``base_lr * global_batch / base_batch`` (the linear rule, Goyal et al. 2017), or with
    ``rule="sqrt"`` times the ratio's square root (Adam-like optimizers)."""
    base_lr = _positive("base_lr", base_lr)
    ratio = _count("global_batch", global_batch) / _count("base_batch", base_batch)
    if rule not in ("linear", "sqrt"):
        raise ValueError(f"unknown scaling rule {rule!r}; expected 'linear' or 'sqrt'")
    return base_lr * (ratio if rule == "linear" else math.sqrt(ratio))
