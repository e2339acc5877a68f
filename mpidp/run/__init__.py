"""Running a job, for every trainer: the one loop (:mod:`~.loop`), checkpoints and the
folders they live in, signals, fault injection, the NaN policy, what a step reports, and
the memory a run needs."""
