"""Observing a run: per-rank timers (:mod:`~.metrics`), live history, the console and
TensorBoard (:mod:`~.watch`), timelines (:mod:`~.trace`) and plots (:mod:`~.plot`)."""

from .._lazy import exports

_NAMES = {"BestModel": ".best", "EpochReport": ".report"}
__getattr__, __dir__ = exports(__name__, _NAMES)
__all__ = sorted(_NAMES)
