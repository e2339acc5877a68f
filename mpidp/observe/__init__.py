"""Observing a run: per-rank timers (:mod:`~.metrics`), live history, the console and
TensorBoard (:mod:`~.watch`), timelines (:mod:`~.trace`) and plots (:mod:`~.plot`)."""
