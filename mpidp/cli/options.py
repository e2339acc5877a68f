"""Which option of ``mpidp train`` applies to which mode: one table, decided before any work.

A mode is a ``--sync`` strategy of data parallelism (``allreduce``, ``per-layer``, ...,
``local-sgd``), ``async-ps``, ``pipeline`` or ``hybrid``. An option given on the command
line that does not apply to the mode is refused with one message naming the option and the
mode, never silently ignored. Pure: no MPI here (every rank reaches the same verdict).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from ..parallel.strategies import SYNCS as SYNC_MODES

MODES = (*SYNC_MODES, "async-ps", "pipeline", "hybrid")
MODEL_PARALLEL = ("pipeline", "hybrid")
ALL = frozenset(MODES)
DATA = frozenset((*SYNC_MODES, "async-ps"))  # every rank (or worker) holds a shard

#: option (argparse dest) -> the modes it applies to, and why not elsewhere.
TABLE: dict[str, tuple[frozenset, str]] = {
    "distribute": (DATA, "every pipeline stage reads the whole training set"),
    "init_sync": (frozenset(SYNC_MODES), "the initial parameters are set by the mode itself"),
    "partition": (DATA, "pipeline stages all see the whole batch"),
    "costs": (DATA, "pipeline stages all see the whole batch"),
    "capacities": (DATA, "pipeline stages all see the whole batch"),
    "adapt_every": (DATA, "pipeline stages all see the whole batch"),
    "micro_batches": (frozenset(MODEL_PARALLEL), "only pipelines cut batches into micro-batches"),
    "schedule": (frozenset(MODEL_PARALLEL), "only pipelines have a schedule"),
    "max_staleness": (frozenset({"async-ps"}), "only the asynchronous server drops stale pushes"),
    "ps_placement": (frozenset({"ps"}), "only --sync ps has a server to place"),
    "ps_transport": (frozenset({"ps"}), "only --sync ps ships parameters from a server"),
    "ps_chunk_mb": (frozenset({"ps"}), "only --sync ps ships parameters from a server"),
    "bucket_mb": (frozenset({"overlapped", "auto"}), "only --sync overlapped (and auto, "
                  "which tries it) buckets gradients"),
    "compress": (frozenset({"compressed", "auto"}), "only --sync compressed (and auto, which "
                 "tries it) encodes gradients"),
    "overlap_progress": (frozenset({"overlapped", "auto"}), "only --sync overlapped (and "
                         "auto, which tries it) starts sums during backward"),
    "node_aware": (frozenset({"allreduce", "accumulate", "auto"}), "only a fused allreduce "
                   "of the whole buffer (allreduce, accumulate, auto) goes node-aware"),
    "sync_every": (frozenset({"accumulate", "local-sgd"}), "only accumulate and local-sgd "
                   "synchronise every few steps"),
    "log_every": (ALL - {"async-ps"}, "its workers are at different steps, so there is no "
                  "common step to log (its epochs are in history.jsonl)"),
    "check_every": (ALL - {"async-ps"}, "its workers hold different parameters by design "
                    "until the end"),
    "progress": (ALL - {"async-ps"}, "its workers are at different steps; the server "
                 "reports when training ends"),
    "max_skipped": (ALL - {"async-ps"}, "its server counts the pushes it drops, and fails "
                    "the run when it applied none"),
    "val_fraction": (ALL - {"async-ps"}, "its workers are at different epochs, so there is "
                     "no epoch's model to validate (the server evaluates once, at the end)"),
    "early_stopping": (ALL - {"async-ps"}, "its workers are at different epochs, so there "
                       "is no epoch's model to validate"),
    "min_delta": (ALL - {"async-ps"}, "its workers are at different epochs, so there is no "
                  "epoch's model to validate"),
    **{dest: (ALL - {"async-ps"}, "its server applies each push as it comes, so an update is "
              "no step of a global batch to schedule by (a constant rate only)")
       for dest in ("lr_schedule", "lr_step_epochs", "lr_milestones", "lr_gamma", "lr_min",
                    "warmup_epochs", "warmup_steps", "plateau_factor", "plateau_patience")},
}

#: schedule options -> the --lr-schedule values they belong to
SCHEDULE_OPTIONS = {"lr_step_epochs": ("step",), "lr_milestones": ("multistep",),
                    "lr_gamma": ("step", "multistep", "exponential"),
                    "lr_min": ("cosine", "polynomial"),
                    "plateau_factor": ("plateau",), "plateau_patience": ("plateau",)}

#: Strategies that decide owners again every epoch (they need the whole world in the plan).
DYNAMIC_PARTITIONS = ("cost", "adaptive")


def mode_of(args: argparse.Namespace) -> str:
    """The mode ``args`` selects (see :data:`MODES`)."""
    return args.parallel if args.parallel != "data" else args.sync


def dedicated_server(args: argparse.Namespace) -> bool:
    """True when rank 0 serves parameters and holds no training data."""
    return args.sync == "async-ps" or (args.sync == "ps" and args.ps_placement == "dedicated")


#: Options that only the generated datasets read.
GENERATED = {"n_samples": ("synthetic", "bow"), "n_features": ("synthetic", "bow")}


def applying(config: dict) -> dict:
    """``config`` (option ``dest`` -> value, as a run records it) without the options that
    do not apply to its mode or its dataset, so a config file says only what mattered."""
    mode = config.get("parallel", "data")
    mode = mode if mode != "data" else config.get("sync", "allreduce")
    return {k: v for k, v in config.items()
            if not (k in TABLE and mode not in TABLE[k][0])
            and not (k in GENERATED and config.get("dataset") not in GENERATED[k])}


def given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The ``dest`` of every option written on the command line ``argv`` (after the
    subcommand), whatever its value: an option given with its default value is still given."""
    actions = parser._option_string_actions  # noqa: SLF001 - argparse offers no public map
    out = set()
    for token in argv:
        if token == "--":
            break
        name = token.split("=", 1)[0]
        if name in actions:
            out.add(actions[name].dest)
    return out


def problems(args: argparse.Namespace, given_: set[str], size: int) -> list[str]:
    """Every option in ``given_`` that does not apply to the mode of ``args``, and settings
    that contradict each other, as messages (empty when all is well)."""
    mode, out = mode_of(args), []
    for dest in sorted(given_):
        if dest in TABLE and mode not in TABLE[dest][0]:
            out.append(f"--{dest.replace('_', '-')} does not apply to {_mode_name(mode)}: "
                       f"{TABLE[dest][1]}")
    if mode in TABLE["partition"][0]:
        out += _partition_problems(args, given_, size)
    if "copy_data" in given_ and args.distribute != "local" and mode in DATA:
        out.append(f"--copy-data does not apply to --distribute {args.distribute}: only "
                   "local reads can map rows from the file")
    if "trace_steps" in given_ and not args.trace:
        out.append("--trace-steps needs --trace")
    out += _schedule_problems(args, {d for d in given_ if d not in TABLE or mode in TABLE[d][0]})
    for dest in ("early_stopping", "min_delta"):
        if dest in given_ and not args.val_fraction:
            out.append(f"--{dest.replace('_', '-')} needs --val-fraction (a validation set "
                       f"to watch)")
    if args.resume and not args.checkpoint_dir:
        out.append("--resume needs --checkpoint-dir")
    for dest in ("checkpoint_every", "keep_checkpoints", "restart"):
        if dest in given_ and not args.checkpoint_dir:
            out.append(f"--{dest.replace('_', '-')} needs --checkpoint-dir")
    if mode in ("ps", "async-ps") and size < 2:
        out.append(f"--sync {args.sync} needs at least 2 ranks (a server and a worker)")
    return out


def _schedule_problems(args, given_: set[str]) -> list[str]:
    """Learning-rate options that contradict each other or the chosen schedule."""
    out, name = [], args.lr_schedule
    for dest, schedules in SCHEDULE_OPTIONS.items():
        if dest in given_ and name not in schedules:
            out.append(f"--{dest.replace('_', '-')} does not apply to --lr-schedule {name}: "
                       f"it belongs to --lr-schedule {' or '.join(schedules)}")
    if name == "step" and args.lr_step_epochs is None:
        out.append("--lr-schedule step needs --lr-step-epochs (epochs between decays)")
    if name == "multistep" and args.lr_milestones is None:
        out.append("--lr-schedule multistep needs --lr-milestones (the epochs to decay after)")
    if name == "plateau" and not args.val_fraction:
        out.append("--lr-schedule plateau needs --val-fraction (a validation loss to watch)")
    if "warmup_epochs" in given_ and "warmup_steps" in given_:
        out.append("--warmup-epochs and --warmup-steps both set the warmup: give one")
    if "base_batch" in given_ and args.lr_scaling == "none":
        out.append("--base-batch needs --lr-scaling linear or sqrt")
    return out


def _partition_problems(args, given_: set[str], size: int) -> list[str]:
    out, strategy = [], args.partition
    if "capacities" in given_ and strategy not in ("weighted", "adaptive"):
        out.append(f"--capacities does not apply to --partition {strategy}: only weighted "
                   "and adaptive use rank speeds")
    if strategy == "weighted" and args.capacities is None:
        out.append("--partition weighted needs --capacities (one relative speed per "
                   + ("worker" if dedicated_server(args) else "rank") + ")")
    if "costs" in given_ and strategy not in DYNAMIC_PARTITIONS:
        out.append(f"--costs does not apply to --partition {strategy}: only cost and adaptive "
                   "balance by per-sample cost")
    if "adapt_every" in given_ and strategy != "adaptive":
        out.append(f"--adapt-every does not apply to --partition {strategy}: only adaptive "
                   "re-measures speeds")
    if dedicated_server(args) and strategy in DYNAMIC_PARTITIONS + ("cyclic", "shuffled") \
            and args.sync == "async-ps":
        out.append(f"--partition {strategy} does not apply to async-ps: its workers read "
                   "contiguous blocks (block or weighted)")
    elif dedicated_server(args) and strategy in DYNAMIC_PARTITIONS:
        out.append(f"--partition {strategy} does not apply to a dedicated parameter server: "
                   "owners are fixed when the workers load their data (use block, cyclic, "
                   "shuffled or weighted)")
    if args.capacities is not None:
        want = size - 1 if dedicated_server(args) else size
        who = "worker (rank 0 is the parameter server and holds no data)" \
            if dedicated_server(args) else "rank"
        if len(args.capacities) != want:
            out.append(f"--capacities has {len(args.capacities)} entries; give one per {who}: "
                       f"{want}")
    return out


def _mode_name(mode: str) -> str:
    if mode in MODEL_PARALLEL:
        return f"--parallel {mode}"
    return f"--sync {mode}"
