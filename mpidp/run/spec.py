"""What a run does, beyond its trainer and its data: one settings object for every trainer
kind, built once (by the command line from its options, or by a library user directly or
from the keyword arguments of :func:`mpidp.fit`). No MPI here."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field, is_dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import MpidpError, is_whole
from ..observe.progress import MODES as PROGRESS

#: The watchdog's default: a timeout of ``max(600 s, 50 median steps)``, as on the command line.
AUTO = "auto"

if TYPE_CHECKING:
    from ..comm import Watchdog
    from ..data.balance import Plan
    from ..data.partition import Partition
    from .checkpoint import State
    from .early_stopping import EarlyStopping, ReduceOnPlateau
    from .signals import StopSignals
    from .stats import StepStats


@dataclass
class Checkpointing:
    """Where and how often a run saves checkpoints (root rank writes them)."""

    directory: str
    every: int  # steps between checkpoints (a final one is written at the end too)
    keep: int = 3
    config: dict = field(default_factory=dict)
    run_id: str | None = None  # the folder's owner (mpidp.run.checkpoint.claim); None: unchecked
    #: the run's :class:`mpidp.BestModel`, whose file each checkpoint carries for a resume
    best: Any = None

    def __post_init__(self) -> None:
        if not (is_whole(self.every, 1) and is_whole(self.keep, 1)):
            raise ValueError(f"checkpoint every/keep must be integers >= 1, got "
                             f"{self.every!r}/{self.keep!r}")


@dataclass
class RunSpec:
    """One run: how long, in which batches, and what watches over it.

    ``epochs`` passes over the training set in GLOBAL batches of ``batch_size`` samples
    (summed over all ranks), in :func:`mpidp.data.partition.epoch_order` (``seed``,
    ``shuffle``; ``drop_last`` drops the last smaller batch). ``partition`` (data parallel):
    a :class:`mpidp.Partition`, or a :class:`mpidp.Plan` batching as the spec does.
    ``check_every``: compare replicas every this many steps (0: never). ``checkpoint``,
    ``resume``: where to save, the :class:`~mpidp.run.checkpoint.State` to continue from.
    ``progress`` (rank 0): one of :data:`mpidp.observe.progress.MODES`; True is ``"auto"``,
    False ``"none"``. ``stop`` (:class:`mpidp.run.signals.StopSignals`): stop cleanly on
    SIGTERM/SIGUSR1. ``watchdog`` (end the job, naming the stalled rank, when a rank makes no
    progress for a timeout): :data:`AUTO`, seconds, ``0``/``False`` (off; None: "not given"
    to ``fit``), or a :class:`mpidp.comm.Watchdog`.

    Callbacks, on every rank: ``on_step(step, stats)`` (the global step just done, from 1)
    and ``on_epoch(record)``; a true result on any rank stops every rank together.
    ``early_stopping`` ends training, ``plateau`` scales the learning rate, from the epoch's
    ``monitor`` figure (default ``"val_loss"``: the loss on ``test={"val": ...}``).
    ``max_skipped``: fail when more than this share of the run's steps had their update
    skipped by the NaN/Inf policy. ``elastic`` (data parallel, Open MPI's ULFM; False: off):
    ``rows(comm) -> Shard``, this rank's training rows over ``comm``, which the survivors of
    lost ranks go on over (:mod:`mpidp.parallel.elastic`). ``min_ranks``: fewer survivors
    end the run (a checkpoint where they are on)."""

    epochs: int
    batch_size: int
    seed: int = 0
    shuffle: bool = True
    drop_last: bool = False
    partition: Partition | Plan | None = None
    check_every: int = 0
    checkpoint: Checkpointing | None = None
    resume: State | None = None
    progress: bool | str = False
    on_epoch: Callable[[dict], None] | None = None
    on_step: Callable[[int, StepStats], None] | None = None
    stop: StopSignals | None = None
    watchdog: Watchdog | float | str | None = AUTO
    early_stopping: EarlyStopping | None = None
    plateau: ReduceOnPlateau | None = None
    monitor: str = "val_loss"
    max_skipped: float = 0.5
    elastic: Any = False
    min_ranks: int = 1

    def __post_init__(self) -> None:
        for name, low in (("epochs", 1), ("batch_size", 1), ("seed", 0), ("check_every", 0),
                          ("min_ranks", 1)):
            value = getattr(self, name)
            if not is_whole(value, low):
                raise MpidpError(f"{name} must be an integer >= {low}, got {value!r}")
            setattr(self, name, int(value))  # e.g. a NumPy integer
        for name in ("shuffle", "drop_last"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise MpidpError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if isinstance(self.max_skipped, bool) or not isinstance(self.max_skipped, numbers.Real) \
                or not 0 <= self.max_skipped <= 1:
            raise MpidpError(f"max_skipped must be a share in [0, 1], got {self.max_skipped!r}")
        dog = self.watchdog
        if isinstance(dog, str) and dog != AUTO or isinstance(dog, numbers.Real) and not \
                isinstance(dog, bool) and not dog >= 0:
            raise MpidpError(f"watchdog must be 'auto', a timeout in seconds >= 0 (0: off), "
                             f"None, or a Watchdog; got {dog!r}")
        if not isinstance(self.progress, bool) and self.progress not in PROGRESS:
            raise MpidpError(f"progress must be one of {PROGRESS} or a bool, got "
                             f"{self.progress!r}")

    def agreed(self) -> dict[str, Any]:
        """What every rank of a run must set alike (same steps, same collectives), by name,
        as values whose ``repr`` identifies them (callbacks and helpers: whether given)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in (
            "epochs", "batch_size", "seed", "shuffle", "drop_last", "check_every", "monitor",
            "max_skipped", "min_ranks")}
        out["partition"] = (None if self.partition is None else
                            repr(self.partition) if is_dataclass(self.partition)
                            else type(self.partition).__name__)
        out["checkpoint"] = None if self.checkpoint is None else (
            self.checkpoint.directory, self.checkpoint.every)
        out["resume"] = None if self.resume is None else (self.resume.epoch, self.resume.step)
        out["elastic"] = self.elastic is not False and self.elastic is not None
        out["early_stopping"], out["plateau"] = repr(self.early_stopping), repr(self.plateau)
        for k in ("on_step", "on_epoch", "stop"):
            out[k] = "given" if getattr(self, k) is not None else "not given"
        dog = self.watchdog
        out["watchdog"] = dog if isinstance(dog, (str, numbers.Real)) or dog is None \
            else "a Watchdog"
        return out

    @classmethod
    def of(cls, spec: RunSpec | None = None, **settings: Any) -> RunSpec:
        """``spec`` with ``settings`` (field names of :class:`RunSpec`) replaced, or a new
        spec from ``settings`` alone; a ``TypeError`` names an unknown setting."""
        settings = {k: v for k, v in settings.items() if v is not None}
        names = [f.name for f in dataclasses.fields(cls)]
        if unknown := sorted(set(settings) - set(names)):
            raise TypeError(f"unknown run setting(s) {', '.join(unknown)}; expected fields "
                            f"of RunSpec: {', '.join(names)}")
        if spec is None:
            if missing := [k for k in ("epochs", "batch_size") if settings.get(k) is None]:
                raise TypeError(f"missing run setting(s): {', '.join(missing)} (or give spec=)")
            return cls(**settings)
        return dataclasses.replace(spec, **settings)
