"""Which option of ``mpidp train`` applies to which mode (:data:`TABLE`; the modes of
:mod:`mpidp.parallel.modes`) and under which other settings (:data:`DEPENDS`: ``--lr-gamma``
under a decaying schedule), decided before any work. An option given where it does not
apply is refused with one message naming it and what it needs, never silently ignored; a
recorded configuration keeps only what applied (:func:`applying`). No MPI here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..parallel.modes import MODES, PIPELINED, SYNCS
from .flags import FLAGS

MODEL_PARALLEL = PIPELINED
DATA = frozenset(n for n, m in MODES.items() if m.kind != "pipeline")  # each rank a shard
LOCKSTEP = frozenset(n for n, m in MODES.items() if m.kind != "async")  # ranks step together
_WHOLE_BATCH = (DATA, "pipeline stages all see the whole batch")
_NO_EPOCH_MODEL = "its workers are at different epochs, so there is no epoch's model to validate"

#: option (argparse dest) -> the modes it applies to, and why not elsewhere (one reason, or
#: one per mode; a flag of :data:`mpidp.cli.flags.FLAGS`: the modes whose settings carry its
#: field).
TABLE: dict[str, tuple[frozenset, str | Mapping[str, str]]] = {
    "sync": (DATA, "a pipeline (and each of hybrid's pipelines) exchanges what its stages "
             "need by itself: there is no gradient exchange to choose"),
    "distribute": (DATA, "every pipeline stage reads the whole training set"),
    "init_sync": (frozenset(SYNCS), "the initial parameters are set by the mode itself"),
    **dict.fromkeys(("partition", "costs", "capacities", "adapt_every"), _WHOLE_BATCH),
    **{f.dest: (frozenset(f.modes), f.why) for f in FLAGS},
    "elastic": (frozenset(n for n, m in MODES.items() if m.elastic is True),
                {n: f"{m.elastic}; only " + ", ".join(n for n, m in MODES.items()
                                                     if m.elastic is True)
                 + " go on over the survivors of a lost rank (see docs/reliability.md)"
                 for n, m in MODES.items() if m.elastic is not True}),
    "log_every": (LOCKSTEP, "its workers are at different steps, so there is no "
                  "common step to log (its epochs are in history.jsonl)"),
    "check_every": (LOCKSTEP, "its workers hold different parameters by design until the end"),
    "progress": (LOCKSTEP, "its workers are at different steps; the server "
                 "reports when training ends"),
    "max_skipped": (LOCKSTEP, "its server counts the pushes it drops, and fails "
                    "the run when it applied none"),
    "val_fraction": (LOCKSTEP, f"{_NO_EPOCH_MODEL} (the server evaluates once, at the end)"),
    **dict.fromkeys(("early_stopping", "min_delta"), (LOCKSTEP, _NO_EPOCH_MODEL)),
    **dict.fromkeys(("lr_schedule", "lr_step_epochs", "lr_milestones", "lr_gamma", "lr_min",
                     "warmup_epochs", "warmup_steps", "plateau_factor", "plateau_patience"),
                    (LOCKSTEP, "its server applies each push as it comes, so an update is "
                     "no step of a global batch to schedule by (a constant rate only)")),
}

#: schedule options -> the --lr-schedule values they belong to
SCHEDULE_OPTIONS = {"lr_step_epochs": ("step",), "lr_milestones": ("multistep",),
                    "lr_gamma": ("step", "multistep", "exponential"),
                    "lr_min": ("cosine", "polynomial"),
                    "plateau_factor": ("plateau",), "plateau_patience": ("plateau",)}

#: Strategies that decide owners again every epoch (they need the whole world in the plan).
DYNAMIC_PARTITIONS = ("cost", "adaptive")

#: The optimizers that read --momentum.
MOMENTUM_OPTIMIZERS = ("momentum", "lars")

#: The datasets made to a size (--n-samples, --n-features).
GENERATED = ("synthetic", "bow")

#: the sizes of generated data (--n-samples, --n-features) when none is given
SIZE_DEFAULTS = {"n_samples": 60000, "n_features": 784}


@dataclass(frozen=True)
class Needs:
    """A condition on the other settings for an option to matter: ``holds(settings)``
    (option dest -> value). ``refusal`` is what the option, given where the condition fails,
    is told (a format string of the settings); None: it is accepted there. Either way a
    recorded configuration leaves it out."""

    holds: Callable[[Mapping[str, Any]], bool]
    refusal: str | None


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _only(dest: str, key: str, values: Sequence, why: str) -> tuple[Needs]:
    """``dest`` matters only where setting ``key`` is one of ``values``; ``why``: the end
    of its refusal elsewhere."""
    return (Needs(lambda s: s.get(key) in values,
                  f"{_flag(dest)} does not apply to {_flag(key)} {{{key}}}: {why}"),)


def _needing(dest: str, key: str, what: str = "") -> Needs:
    """``dest`` matters only where setting ``key`` is set (``what``: said after it)."""
    return Needs(lambda s: bool(s.get(key)), f"{_flag(dest)} needs {_flag(key)}{what}")


#: ``--watchdog-grace`` matters where the watchdog runs (train and predict)
WATCHDOG_ON = Needs(lambda s: s.get("watchdog") != 0,
                    "--watchdog-grace needs the watchdog (--watchdog 0 turns it off)")

#: option (argparse dest) -> what must hold of the other settings for it to matter, within
#: a mode it applies to (:data:`TABLE`).
DEPENDS: dict[str, tuple[Needs, ...]] = {
    **{dest: _only(dest, "lr_schedule", names, "it belongs to --lr-schedule "
                   + " or ".join(names)) for dest, names in SCHEDULE_OPTIONS.items()},
    "base_batch": (Needs(lambda s: s.get("lr_scaling") != "none",
                         "--base-batch needs --lr-scaling linear or sqrt"),),
    "momentum": _only("momentum", "optimizer", MOMENTUM_OPTIMIZERS,
                      "only " + " and ".join(MOMENTUM_OPTIMIZERS) + " use it"),
    "early_stopping": (_needing("early_stopping", "val_fraction", " (a validation set to watch)"),),
    "min_delta": (_needing("min_delta", "val_fraction", " (a validation set to watch)"),
                  Needs(lambda s: bool(s.get("early_stopping"))  # the loss watched
                        or s.get("lr_schedule") == "plateau", None)),
    "max_skipped": (Needs(lambda s: s.get("on_nonfinite") == "skip",
                          "--max-skipped needs --on-nonfinite skip (only skipped steps are "
                          "counted)"),),
    "min_ranks": (_needing("min_ranks", "elastic"),),
    "watchdog_grace": (WATCHDOG_ON,),
    **{dest: (_needing(dest, "checkpoint_dir"),)
       for dest in ("checkpoint_every", "keep_checkpoints", "restart")},
    "capacities": _only("capacities", "partition", ("weighted", "adaptive"),
                        "only weighted and adaptive use rank speeds"),
    "costs": _only("costs", "partition", DYNAMIC_PARTITIONS,
                   "only cost and adaptive balance by per-sample cost"),
    "adapt_every": _only("adapt_every", "partition", ("adaptive",),
                         "only adaptive re-measures speeds"),
    "copy_data": (Needs(lambda s: mode_of(s) not in DATA or s.get("distribute") == "local",
                        "--copy-data does not apply to --distribute {distribute}: only local "
                        "reads can map rows from the file"),),
    "trace_steps": (_needing("trace_steps", "trace"),),
    **{dest: _only(dest, "dataset", GENERATED, f"only the generated datasets "
                   f"({', '.join(GENERATED)}) are made to a size") for dest in SIZE_DEFAULTS},
    "hidden": _only("hidden", "model", ("mlp",), "only mlp has hidden layers of those sizes "
                    "(a model file sets its own)"),
    "compress": (Needs(lambda s: s.get("sync") != "auto" or s.get("dtype") != "float64",
                       "--compress does not apply to --sync auto with --dtype float64: auto "
                       "tries compression for float32 models only"),),
}


def depends_met(dest: str, settings: Mapping[str, Any]) -> bool:
    """Whether every condition :data:`DEPENDS` puts on option ``dest`` holds in ``settings``."""
    return all(needs.holds(settings) for needs in DEPENDS.get(dest, ()))


def applies(dest: str, settings: Mapping[str, Any]) -> bool:
    """Whether option ``dest`` matters under ``settings`` (dest -> value): :data:`TABLE`
    and :data:`DEPENDS` agree."""
    return (dest not in TABLE or mode_of(settings) in TABLE[dest][0]) \
        and depends_met(dest, settings)


def mode_of(settings: argparse.Namespace | Mapping[str, Any]) -> str:
    """The mode (see :data:`MODES`) that parsed arguments or settings (dest -> value) select."""
    s = vars(settings) if isinstance(settings, argparse.Namespace) else settings
    parallel = s.get("parallel", "data")
    return parallel if parallel != "data" else s.get("sync", "allreduce")


def dedicated_server(args: argparse.Namespace) -> bool:
    """True when rank 0 serves parameters and holds no training data."""
    return args.sync == "async-ps" or (args.sync == "ps" and args.ps_placement == "dedicated")


def applying(config: dict) -> dict:
    """``config`` (dest -> value, as a run records it) without the options that do not
    apply to it, so a config file says only what mattered."""
    return {k: v for k, v in config.items() if applies(k, config)}


def given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The ``dest`` of every option written on the command line ``argv`` (after the
    subcommand), whatever its value: an option given with its default value is still given."""
    actions = parser._option_string_actions  # noqa: SLF001 - argparse offers no public map
    argv = list(argv)
    names = [t.split("=", 1)[0] for t in argv[:argv.index("--") if "--" in argv else None]]
    return {actions[name].dest for name in names if name in actions}


def reason(dest: str, mode: str) -> str:
    """Why option ``dest`` does not apply to ``mode`` (:data:`TABLE`)."""
    why = TABLE[dest][1]
    return why if isinstance(why, str) else why[mode]


def problems(args: argparse.Namespace, given_: set[str], size: int) -> list[str]:
    """Every option in ``given_`` that does not apply to ``args``, and settings that
    contradict each other, as messages (empty when all is well)."""
    mode, settings, out = mode_of(args), vars(args), []
    for dest in sorted(given_):
        if dest in TABLE and mode not in TABLE[dest][0]:
            out.append(f"{_flag(dest)} does not apply to {MODES[mode].option}: "
                       f"{reason(dest, mode)}")
            continue
        out += [n.refusal.format(**settings) for n in DEPENDS.get(dest, ())
                if n.refusal is not None and not n.holds(settings)][:1]
    if mode in DATA:
        out += _partition_problems(args, size, "capacities" in given_)
    out += _schedule_problems(args, given_)
    if args.resume and not args.checkpoint_dir:
        out.append("--resume needs --checkpoint-dir")
    if beyond := sorted(r for r in (getattr(args, "slowdown", None) or {}) if r >= size):
        out.append(f"--slowdown names rank{'s' * (len(beyond) > 1)} "
                   f"{', '.join(map(str, beyond))} but there are {size} ranks"
                   + ("" if "slowdown" in given_ else " (the resumed run's --slowdown, for "
                      "another number of ranks: give --slowdown for these, 0:1 for none)"))
    if mode in ("ps", "async-ps") and size < 2:
        out.append(f"--sync {args.sync} needs at least 2 ranks (a server and a worker)")
    return out


def _schedule_problems(args, given_: set[str]) -> list[str]:
    """Learning-rate settings that contradict each other or the chosen schedule."""
    out, name = [], args.lr_schedule
    dest, what = {"step": ("lr_step_epochs", "epochs between decays"),
                  "multistep": ("lr_milestones", "the epochs to decay after"),
                  "plateau": ("val_fraction", "a validation loss to watch")}.get(name, ("", ""))
    if dest and not getattr(args, dest):  # unset (None), or no validation set (0)
        out.append(f"--lr-schedule {name} needs {_flag(dest)} ({what})")
    if "warmup_epochs" in given_ and "warmup_steps" in given_:
        out.append("--warmup-epochs and --warmup-steps both set the warmup: give one")
    return out


def _partition_problems(args, size: int, typed: bool = True) -> list[str]:
    """``typed``: whether --capacities was given (else it is a resumed run's setting)."""
    out, strategy, server = [], args.partition, dedicated_server(args)
    if strategy == "weighted" and args.capacities is None:
        out.append("--partition weighted needs --capacities (one relative speed per "
                   + ("worker" if server else "rank") + ")")
    if server and strategy in DYNAMIC_PARTITIONS + ("cyclic", "shuffled") \
            and args.sync == "async-ps":
        out.append(f"--partition {strategy} does not apply to async-ps: its workers read "
                   "contiguous blocks (block or weighted)")
    elif server and strategy in DYNAMIC_PARTITIONS:
        out.append(f"--partition {strategy} does not apply to a dedicated parameter server: "
                   "owners are fixed when the workers load their data (use block, cyclic, "
                   "shuffled or weighted)")
    want = size - 1 if server else size
    if args.capacities is not None and len(args.capacities) != want:
        who = "worker (rank 0 is the parameter server and holds no data)" if server else "rank"
        out.append(f"--capacities has {len(args.capacities)} entries; give one per {who}: "
                   f"{want}" + ("" if typed else " (the resumed run's capacities, for "
                                "another number of ranks: give --capacities for these)"))
    return out
