"""Running a job, for every trainer: the one loop (:mod:`~.loop`), checkpoints and their folders,
signals, fault injection, the NaN policy, what a step reports, and the memory a run needs."""
