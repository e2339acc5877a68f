"""Early stopping and learning-rate reduction on a plateau: pure state machines, fed ONE
global figure per epoch (the same on every rank: every rank decides alike). A value
*improves* when it beats the best so far by MORE than ``min_delta`` (the first finite value
always does, NaN and +-Inf never); one that does not is a *bad epoch*. :meth:`state` and
:meth:`restore` let a resumed run decide as the uninterrupted one would."""

from __future__ import annotations

import math

_MODES = ("min", "max")


def _count(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{what} must be an integer >= 0, got {v!r}")
    return v


def _number(v, what: str, lo: float, hi: float, lo_open: bool = False,
            hi_open: bool = False) -> float:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) \
        and (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        raise ValueError(f"{what} must be a number in {'(' if lo_open else '['}{lo}, {hi}"
                         f"{')' if hi_open else ']'}, got {v!r}")
    return float(v)


class _Plateau:
    """The best value so far, the epoch it came in, and the bad epochs since."""

    _KEYS = ("best", "best_epoch", "bad_epochs", "epochs")

    def __init__(self, patience: int, min_delta: float = 0.0, mode: str = "min") -> None:
        self.patience = _count(patience, "patience")
        self.min_delta = _number(min_delta, "min_delta", 0.0, math.inf, hi_open=True)
        if mode not in _MODES:
            raise ValueError(f"mode must be 'min' (a loss) or 'max' (an accuracy), got {mode!r}")
        self.mode = mode
        #: best value seen (None before the first finite one), the epoch (0-based) it came in
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.bad_epochs, self.epochs = 0, 0  # epochs in a row without improvement, seen

    def improves(self, value: float) -> bool:
        """Whether ``value`` would improve on the best so far (does not change the state)."""
        value = float(value)
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        return (value < self.best - self.min_delta if self.mode == "min"
                else value > self.best + self.min_delta)

    def _see(self, value: float) -> bool:
        if better := self.improves(value):
            self.best, self.best_epoch, self.bad_epochs = float(value), self.epochs, 0
        else:
            self.bad_epochs += 1
        self.epochs += 1
        return better

    def state(self) -> dict:
        """The counters, JSON-able (settings are not included: they come from the run)."""
        return {k: getattr(self, k) for k in self._KEYS}

    def restore(self, state: dict) -> None:
        """Take back counters :meth:`state` returned (e.g. from a checkpoint)."""
        if missing := [k for k in self._KEYS if k not in state]:
            raise ValueError(f"{type(self).__name__}.restore: the saved state lacks "
                             f"{missing}; it holds {sorted(state)}")
        self.best = None if state["best"] is None else float(state["best"])
        self.best_epoch = None if state["best_epoch"] is None else int(state["best_epoch"])
        self.bad_epochs, self.epochs = int(state["bad_epochs"]), int(state["epochs"])

    def __repr__(self) -> str:  # the settings and counters of _SHOWN
        return f"{type(self).__name__}({', '.join(f'{k}={getattr(self, k)!r}' for k in self._SHOWN)})"


class EarlyStopping(_Plateau):
    """Stop when the monitored figure has not improved for ``patience`` epochs in a row:
    ``update(value)`` once per epoch returns True when ``bad_epochs >= patience`` (0: at the
    first bad epoch). ``mode``: ``"min"`` (a loss) or ``"max"`` (an accuracy)."""

    _SHOWN = ("patience", "min_delta", "mode", "best", "bad_epochs")

    def update(self, value: float) -> bool:
        """Feed this epoch's global figure; True: stop now."""
        self._see(value)
        return self.bad_epochs >= self.patience and self.bad_epochs > 0


class ReduceOnPlateau(_Plateau):
    """Multiply the learning rate by ``factor`` (in (0, 1)) when the figure has not improved
    for ``patience`` epochs in a row: ``update(value)`` once per epoch returns ``scale``, the
    multiplier from the next epoch on, which becomes ``max(scale * factor, min_scale)`` on
    that bad epoch; the count then restarts after ``cooldown`` epochs (as Keras does)."""

    _KEYS = _Plateau._KEYS + ("scale", "reductions", "cooldown_left")
    _SHOWN = ("factor", "patience", "min_scale", "scale", "bad_epochs")

    def __init__(self, factor: float = 0.1, patience: int = 10, min_delta: float = 0.0,
                 min_scale: float = 0.0, mode: str = "min", cooldown: int = 0) -> None:
        super().__init__(patience, min_delta, mode)
        self.factor = _number(factor, "factor", 0.0, 1.0, lo_open=True, hi_open=True)
        self.min_scale = _number(min_scale, "min_scale", 0.0, 1.0)
        self.cooldown = _count(cooldown, "cooldown")
        self.scale, self.reductions, self.cooldown_left = 1.0, 0, 0

    def update(self, value: float) -> float:
        """Feed this epoch's global figure; returns the learning-rate multiplier."""
        better = self._see(value)
        if self.cooldown_left > 0:  # bad epochs right after a reduction do not count
            self.cooldown_left -= 1
            self.bad_epochs = 0
        elif not better and self.bad_epochs >= self.patience:
            new = max(self.scale * self.factor, self.min_scale)
            if new < self.scale:
                self.scale, self.reductions = new, self.reductions + 1
            self.bad_epochs, self.cooldown_left = 0, self.cooldown
        return self.scale

    def restore(self, state: dict) -> None:
        super().restore(state)
        self.scale, self.reductions = float(state["scale"]), int(state["reductions"])
        self.cooldown_left = int(state["cooldown_left"])
