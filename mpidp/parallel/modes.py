"""Every parallel mode, declared once in :data:`MODES`: its name, kind, settings (checked when
made), the layers it cannot serve and why, its note for ``--help``, and the class that runs it.
A setting shared by several modes has one name in all. Pure (no MPI)."""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any

import numpy as np

from ..errors import MpidpError, is_whole, setting
from .codecs import CODECS, JIT_CODECS
from .stages import SCHEDULES

KERNELS = ("auto", "numpy", "numba")  # how compressed runs its codec's passes
PROGRESS = ("test", "thread")  # how overlapped sums move during backward
FINISH = ("backward", "forward")  # where overlapped sums complete
HYBRID_STAGES = 2  # default stages per pipeline for "hybrid"


class SettingError(MpidpError):
    """A refused setting. ``parts``: text, and ``(field,)`` or ``(field, value)`` named by
    :func:`~mpidp.errors.setting`."""

    def __init__(self, *parts: str | tuple) -> None:
        super().__init__("".join(p if isinstance(p, str) else setting(*p) for p in parts))


# --- checks of one field's value: (field, value) -> the value kept, or SettingError ------

def _whole(low: int) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        if not is_whole(value, low):
            raise SettingError((name,), f" must be a whole number >= {low}, got {value!r}")
        return int(value)
    return check


def _one_of(what: str, choices: tuple[str, ...], or_none: bool = False) -> Callable:
    def check(name: str, value: Any) -> str | None:
        if value not in choices and not (or_none and value is None):
            raise SettingError(f"unknown {what} {value!r} (", (name,),
                               f"); expected one of {choices}")
        return value
    return check


def _boolean(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise SettingError((name,), f" must be True or False, got {value!r}")
    return bool(value)


def _where_it_pays(name: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, (bool, np.bool_)):
        raise SettingError((name,), f" must be None (node-aware where it pays), True or "
                           f"False, got {value!r}")
    return None if value is None else bool(value)


def _bytes(name: str, value: Any) -> int:
    """A whole number of bytes from 1 to 2^62 (an int, or a float such as ``1e6``)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise SettingError((name,), f" must be a number of bytes, got {value!r}")
    try:
        size = float(value)
    except OverflowError:  # an int beyond float's range
        size = math.inf
    if not (math.isfinite(size) and 1 <= size < 2**62):
        raise SettingError((name,), f" must be a finite number of bytes from 1 to 2^62, got "
                           f"{value!r}")
    if value != int(value):
        raise SettingError((name,), f" must be a whole number of bytes, got {value!r}")
    return int(value)


def _setting(default: Any, check: Callable, help: str, why: str | None = None,
             **meta: Any) -> Any:
    """A settings field: its default, check and ``help``, and ``why`` it applies to no other mode."""
    return field(default=default, metadata={"check": check, "help": help, "why": why, **meta})


# --- the settings shared by several modes, one declaration each (a new field per call) ---

_bucket_bytes = partial(_setting, 1 << 20, _bytes, "bucket size in MiB (auto also tries a "
                        "quarter of the gradient)", "only --sync overlapped and compressed (and "
                        "auto, which tries them) bucket gradients", mib=True)

_node_aware = partial(_setting, None, _where_it_pays, "sum inside each node through shared "
                      "memory and across nodes between node leaders only, so a node's link "
                      "carries one rank's gradient instead of every rank's (auto: when ranks "
                      "share nodes and there are several nodes)", "only a fused allreduce of "
                      "the whole buffer (allreduce, accumulate, auto) goes node-aware")

_progress = partial(_setting, "test", _one_of("overlap progress", PROGRESS), "how started "
                    "bucket sums move during backward: tested at every layer boundary (test), "
                    "or a communication thread in a blocking Allreduce per bucket (thread: a "
                    "core polls meanwhile); compressed always tests at every layer boundary",
                    "only --sync overlapped (and auto, which tries it) chooses how its sums "
                    "move (compressed always tests them)", choices=PROGRESS)

_k = partial(_setting, 4, _whole(1), "steps between synchronisations", "only accumulate and "
             "local-sgd synchronise every few steps", low=1)


def _codec(default: str | None) -> Any:
    return _setting(default, _one_of("compression", CODECS, or_none=default is None),
                    "format of the gradients on the wire: 16-bit floats (half of float32's "
                    "bytes), or int8 with a float32 scale per 256 values (about a quarter; "
                    "coarser, error feedback keeps what it rounds off) (default: bfloat16; "
                    "auto tries bfloat16 and int8 unless one is given)", "only --sync "
                    "compressed (and auto, which tries it) encodes gradients", choices=CODECS)


@dataclass(frozen=True)
class Settings:
    """A mode's settings (this base: none), each field checked when made (:class:`SettingError`)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            object.__setattr__(self, f.name, f.metadata["check"](f.name, getattr(self, f.name)))


@dataclass(frozen=True)
class AllreduceSettings(Settings):
    node_aware: bool | None = _node_aware()


@dataclass(frozen=True)
class OverlappedSettings(Settings):
    bucket_bytes: int = _bucket_bytes()
    progress: str = _progress()
    finish: str = _setting(
        "backward", _one_of("overlap finish", FINISH), "the bucket sums complete before the "
        "update (backward), or only the loss and counts do and each other part is applied as "
        "it arrives, at the latest when the next forward pass reads it (forward: the first "
        "layers' transfer overlaps the next forward; needs --on-nonfinite ignore, an "
        "elementwise optimizer and --overlap-progress test)", "only --sync overlapped can "
        "leave its last sums to the next forward pass", choices=FINISH)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.finish == "forward" and self.progress == "thread":
            raise SettingError(("finish", "forward"), " applies each sum as it arrives, which "
                               "the communication thread of ", ("progress", "thread"),
                               " does not report: use ", ("progress", "test"))


@dataclass(frozen=True)
class CompressedSettings(Settings):
    codec: str = _codec("bfloat16")
    error_feedback: bool = _setting(True, _boolean, "keep what each rounding loses and add "
                                    "it back at the next step")
    bucket_bytes: int = _bucket_bytes()
    kernels: str = _setting("auto", _one_of("compression kernels", KERNELS), "how the "
                            "codec's passes run: numpy, numba (compiled) or auto",
                            choices=KERNELS)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kernels == "numba" and self.codec not in JIT_CODECS:
            raise SettingError(("kernels", "numba"), f": compression kernels 'numba' exist for "
                               f"{JIT_CODECS} only, not ", ("codec", self.codec),
                               ": use kernels 'auto' or 'numpy'")


@dataclass(frozen=True)
class PSSettings(Settings):
    dedicated: bool = _setting(False, _boolean, "the server also computes (root) or holds "
                               "no data (dedicated)", "only --sync ps has a server to place")
    shared_memory: bool = _setting(
        True, _boolean, "within each node that runs several ranks, gradients and parameters "
        "go through MPI shared memory and node leaders relay over MPI (shared), or always "
        "Reduce_scatter + Gatherv and Bcast (mpi)", "only --sync ps ships parameters from a "
        "server")
    chunk_bytes: int = _setting(1 << 20, _bytes, "(shared) the server ships its update in "
                                "pieces of this many MiB", "only --sync ps ships parameters "
                                "from a server", mib=True)


@dataclass(frozen=True)
class AccumulateSettings(Settings):
    k: int = _k()
    node_aware: bool | None = _node_aware()


@dataclass(frozen=True)
class LocalSGDSettings(Settings):
    k: int = _k()


@dataclass(frozen=True)
class AutoSettings(Settings):
    bucket_bytes: int = _bucket_bytes()
    codec: str | None = _codec(None)  # None: bfloat16 and int8 are both tried
    node_aware: bool | None = _node_aware()
    progress: str = _progress()


@dataclass(frozen=True)
class AsyncPSSettings(Settings):
    max_staleness: int = _setting(8, _whole(0), "drop gradients computed on parameters "
                                  "older than this", "only the asynchronous server drops "
                                  "stale pushes", low=0)


@dataclass(frozen=True)
class PipelineSettings(Settings):
    micro_batches: int = _setting(4, _whole(1), "micro-batches per batch (sizes differ by "
                                  "at most 1)", "only pipelines cut batches into "
                                  "micro-batches", low=1)
    schedule: str = _setting("1f1b", _one_of("schedule", SCHEDULES), "gpipe (all forwards, "
                             "then all backwards) or 1f1b", "only pipelines have a schedule",
                             choices=SCHEDULES)


@dataclass(frozen=True)
class Mode:
    """One mode: ``kind`` ``"data"`` (a gradient exchange), ``"async"`` or ``"pipeline"``;
    ``runner``: ``".module:Class"``, imported when asked for; ``refuses``: a layer's need
    (:attr:`mpidp.nn.Layer.needs`) -> why not; ``stages``: a pipeline's by default (None:
    every rank); ``elastic``: True when it goes on over the survivors, else why not."""

    name: str
    kind: str
    settings: type[Settings]
    note: str
    runner: str
    refuses: Mapping[str, str] = field(default_factory=dict)
    stages: int | None = None
    elastic: bool | str = "it does not go on over the survivors"

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(f.name for f in fields(self.settings))

    @property
    def option(self) -> str:
        """How the command line asks for it: ``--sync NAME`` or ``--parallel NAME``."""
        return f"--{'parallel' if self.kind == 'pipeline' else 'sync'} {self.name}"

    def make_settings(self, **values: Any) -> Settings:
        """Its settings from ``values`` (field -> value); a field it lacks is refused."""
        for name in values:
            if name not in self.fields:
                others = having(name)
                where = (f" applies to {MODES[others[0]].option.split()[0]} {_either(others)}"
                         if others else " is no setting of any mode")
                raise MpidpError(f"{name} {values[name]!r}{where}, not {self.name} ("
                                 f"{self.option} takes {', '.join(self.fields) or 'none'})")
        return self.settings(**values)

    def runner_class(self) -> type:
        module, _, name = self.runner.partition(":")
        return getattr(importlib.import_module(module, __package__), name)


_NO_GLOBAL_BATCH = "no global batch to take statistics over (use LayerNorm, or another {fix})"
_STAGED = {"replica-sums": "each stage sees one micro-batch at a time, so no stage holds the "
           "global batch to take statistics over (use LayerNorm, or --parallel data)",
           "sample-index": "a stage after the first does not know which samples a "
           "micro-batch holds, so masks could not be keyed to the samples (use --parallel "
           "data)"}

#: name -> :class:`Mode`: every mode, in the order the command line lists them.
MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("allreduce", "data", AllreduceSettings, "one fused in-place Allreduce per step",
         ".sync:Sync", elastic=True),
    Mode("per-layer", "data", Settings, "one per array", ".sync:PerLayer", elastic=True),
    Mode("overlapped", "data", OverlappedSettings, "bucketed Iallreduce during backward",
         ".overlap:Overlapped", elastic=True),
    Mode("compressed", "data", CompressedSettings, "16- or 8-bit with error feedback, "
         "bucketed during backward", ".compress:Compressed",
         elastic="each rank's error-feedback residual is its own and is lost with it, so the "
         "survivors could not train the model of an uninterrupted run"),
    Mode("ps", "data", PSSettings, "parameter server (rank 0)", ".ps:ParameterServer",
         elastic="the server alone holds the optimizer's state, lost with it (a server is not "
         "replicated)"),
    Mode("sharded-ps", "data", Settings, "every rank updates 1/P of the parameters",
         ".ps:ShardedParameterServer", elastic="each rank alone holds its shard of the "
         "optimizer's state, lost with it (shards are not replicated)"),
    Mode("accumulate", "data", AccumulateSettings, "sync every --sync-every batches",
         ".sync:Accumulate", elastic=True),
    Mode("local-sgd", "data", LocalSGDSettings, "average parameters every --sync-every steps",
         ".sync:LocalSGD", {"replica-sums": "each replica steps on its own part of the "
                            "batch, so there is " + _NO_GLOBAL_BATCH.format(fix="--sync")},
         elastic="between averages each replica steps on its own rows, so a lost replica's "
         "steps since the last average are lost with it"),
    Mode("auto", "data", AutoSettings, "the fastest of allreduce, overlapped and compressed "
         "(float32 only) on the first steps, said in one line", ".auto:Auto",
         elastic="it may choose an exchange that does not go on over the survivors"),
    Mode("async-ps", "async", AsyncPSSettings, "workers push gradients and pull parameters "
         "without waiting (rank 0 serves)", ".async_ps:AsyncPS",
         {"replica-sums": "each worker steps on its own batch at its own pace, so there is "
          + _NO_GLOBAL_BATCH.format(fix="--sync")},
         elastic="the server alone holds the parameters' newest values and the optimizer's "
         "state, lost with it"),
    Mode("pipeline", "pipeline", PipelineSettings, "consecutive layers on consecutive ranks",
         ".pipeline:Pipeline", _STAGED,
         elastic="each stage alone holds its layers, so a lost stage is lost"),
    Mode("hybrid", "pipeline", PipelineSettings, f"pipelines of {HYBRID_STAGES} stages x "
         f"P/{HYBRID_STAGES} data-parallel replicas", ".pipeline:Pipeline", _STAGED,
         stages=HYBRID_STAGES, elastic="a lost stage's pipeline is not rebuilt from the "
         "stage's replicas in the other pipelines"),
)}
SYNCS = tuple(n for n, m in MODES.items() if m.kind == "data")  # DataParallel's exchanges
PIPELINED = tuple(n for n, m in MODES.items() if m.kind == "pipeline")  # the model in stages
PARALLEL = ("data", *PIPELINED)  # --parallel's choices, make_trainer's names


def having(name: str) -> tuple[str, ...]:
    """The modes whose settings carry the field ``name``."""
    return tuple(n for n, m in MODES.items() if name in m.fields)


def declared(name: str) -> Any:
    """The declaration (:class:`dataclasses.Field`) of the settings field ``name``."""
    return next(f for n in having(name) for f in fields(MODES[n].settings) if f.name == name)


def _either(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def make_sync(mode: str, settings: Settings | None = None, *, optimizer_factory=None,
              **values: Any):
    """The gradient exchange (a :class:`~mpidp.parallel.sync.Sync`) ``mode`` (of
    :data:`SYNCS`) with ``settings``, or its fields ``values``:
    ``make_sync("overlapped", bucket_bytes=4096)``. ``sharded-ps`` needs
    ``optimizer_factory`` (a callable in place of ``settings`` is taken for it)."""
    if callable(settings):
        settings, optimizer_factory = None, settings
    m = MODES.get(mode)
    if m is None or m.kind != "data":
        raise MpidpError(f"unknown sync mode {mode!r}; expected one of {SYNCS}")
    if settings is None:
        settings = m.make_settings(**values)
    elif values or type(settings) is not m.settings:
        raise MpidpError(f"{m.option} takes {m.settings.__name__} or its fields, got "
                         f"{type(settings).__name__}" + (" and fields" if values else ""))
    return m.runner_class().of(settings, optimizer_factory)


_NEED = {"replica-sums": "sums over the replicas", "sample-index": "each sample's index"}


def _needing(layers, need: str) -> str:
    """The class name of the first of ``layers`` (or inside a block) that needs ``need``."""
    for layer in layers:
        if need in layer.needs:
            inner = getattr(layer, "layers", None)
            return _needing(inner, need) if isinstance(inner, list) and any(
                need in la.needs for la in inner) else type(layer).__name__
    return "?"


def refuses_model(layers, mode: str = "data", sync: str = "allreduce") -> str | None:
    """Why a model of ``layers`` cannot be trained in ``mode`` (of :data:`MODES`, or
    ``"data"`` with the exchange ``sync``), naming option, layer and reason; or None."""
    m = MODES.get(sync if mode == "data" else mode)
    for need in sorted(frozenset().union(*(la.needs for la in layers))) if m else ():
        if (why := m.refuses.get(need)) is not None:
            return (f"{m.option} cannot train a model with {_needing(layers, need)} (it needs "
                    f"{_NEED.get(need, need)}): {why}")
    return None
