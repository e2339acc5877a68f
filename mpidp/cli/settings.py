"""Which value each setting of ``mpidp train`` takes when several sources give one.

Lowest first: its default, the settings recorded in the checkpoint a ``--resume``
continues, the ``--config`` file, the command line; each value goes through its flag's
parsing and checks (:func:`mpidp.cli.config.tokens`). A file setting changed from its
default counts as given (refused where it does not apply), unless a typed flag makes it
moot (``--optimizer adam`` over a file's ``momentum``): then it is left out. A setting that
matters nowhere now is put back at its default.

A resume keeps the checkpoint's settings but :data:`mpidp.cli.config.NOT_STORED`; it may
change :data:`RESUME_MAY_CHANGE` (announced and recorded) and must match
:data:`RESUME_MUST_MATCH`, the data's fingerprint and at least the epochs done.

No MPI here: rank 0 reads the checkpoint's settings, and every rank decides the same.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from .config import NOT_STORED, RECORDS, load, tokens
from .flags import FLAGS
from .options import DEPENDS, applies, applying, depends_met, given
from .parser import launcher_rank, refuse, subcommand

if TYPE_CHECKING:
    from .. import comm as C
    from ..run import checkpoint as ck

#: Settings a checkpoint must share with the run that resumes it (the world size may differ).
RESUME_MUST_MATCH = ("dataset", "model", "hidden", "batch_size", "seed", "dtype", "optimizer",
                     "test_fraction", "no_shuffle", "drop_last", "n_samples", "n_features",
                     "val_fraction", "standardize")
#: The settings that choose the gradient exchange: ``--sync`` and every mode's settings
#: (the flag table); a resume may change them, said apart from the hyperparameters.
RESUME_EXCHANGE = ("sync", *(f.dest for f in FLAGS))
#: Settings a resume may change; the change is announced and recorded.
RESUME_MAY_CHANGE = ("lr", "momentum", "weight_decay", "lr_schedule", "lr_step_epochs",
                     "lr_milestones", "lr_gamma", "lr_min", "warmup_epochs", "warmup_steps",
                     "lr_scaling", "base_batch", "plateau_factor", "plateau_patience",
                     "clip_norm", "clip_value", "early_stopping", "min_delta", *RESUME_EXCHANGE)


def _in_front(parser: argparse.ArgumentParser, argv: list[str], table: dict, source: str,
              literal: bool = False) -> tuple[argparse.Namespace, list[str]]:
    """Parse ``argv`` with ``table``'s options in front of the ones after ``train`` (which
    win: the table's are left out). Returns the arguments and the new argv. ``literal``: the
    table is what a run recorded (see :func:`mpidp.cli.config.tokens`)."""
    at = argv.index("train") + 1
    train = subcommand(parser, "train")
    try:
        toks = tokens(table, train, skip=given(train, argv[at:]), source=source,
                      literal=literal)
    except ValueError as exc:
        parser.error(str(exc))
    new = [*argv[:at], *toks, *argv[at:]]
    return parser.parse_args(new), new


def with_config_file(parser: argparse.ArgumentParser, argv: list[str], path: str
                     ) -> tuple[argparse.Namespace, list[str], set[tuple[str, bool]]]:
    """The arguments of ``argv`` (as typed) with config file ``path`` under them, the new
    argv, and the file's settings that count as given, each as ``(dest, whether it applies
    to the file's own settings)`` for :func:`settle`."""
    try:
        table = load(path)
    except ValueError as exc:  # a file that cannot be read: one line, as a refused path
        refuse(str(exc))
    train = subcommand(parser, "train")
    typed = given(train, argv[argv.index("train") + 1:])
    args, new = _in_front(parser, argv, table, f"--config {path}")
    keys = {k.replace("-", "_"): v for k, v in table.items()}
    alone = {**{a.dest: a.default for a in train._actions}, **keys}  # noqa: SLF001
    changed = {d for d, v in keys.items() if d not in RECORDS and v != (
        list(train.get_default(d) or []) if isinstance(v, list) else train.get_default(d))}
    from_file = {(d, applies(d, alone)) for d in changed}
    # a key at its default that does not apply to the file's own settings (a momentum beside
    # optimizer = "sgd") is refused too: written, it says something. Not in a run's record
    # of every setting with a value by default (a metrics.json's), nor a flag written false.
    valued = {a.dest for a in train._actions  # noqa: SLF001
              if a.default not in (None, {}, [], ()) and a.dest != "help"}
    if not valued - NOT_STORED <= set(keys):
        idle = set(keys) - set(applying(alone)) - RECORDS - changed
        from_file |= {(d, False) for d in idle if keys[d] is not False}
    if "out" in table and "out" not in typed and launcher_rank() == 0:
        print(f"mpidp: writing into --out {args.out} as --config {path} says "
              "(give --out to write elsewhere)", file=sys.stderr, flush=True)
    return args, new, from_file


def stored_config(directory: str) -> dict | None:
    """The settings recorded in the newest readable checkpoint of ``directory`` (rank 0)."""
    from ..run.checkpoint import list_checkpoints, read
    for path in reversed(list_checkpoints(directory)):  # none where there is no folder
        try:
            return read(path)[0].get("config")
        except ValueError:
            continue
    return None


def with_stored(parser: argparse.ArgumentParser, argv: list[str], stored: dict
                ) -> tuple[argparse.Namespace, list[str]]:
    """The arguments of ``argv`` over a resumed run's ``stored`` settings, and the new argv.
    None of them counts as given: a mode switched now keeps its own settings."""
    return _in_front(parser, argv, stored, "the checkpoint's settings", literal=True)


def settle(args: argparse.Namespace, train: argparse.ArgumentParser, typed: list[str],
           from_file: set[tuple[str, bool]] = frozenset()) -> set[str]:
    """The options given to ``train``: those ``typed`` after it and ``from_file``'s (see
    :func:`with_config_file`) that still apply or never applied in the file; puts every
    setting that matters nowhere now (a moot file setting among them) back at its default."""
    recorded = {d for d, met in from_file if applies(d, vars(args)) or not met}
    moot = {d for d, _ in from_file} - recorded
    for dest in [d for d in DEPENDS if not depends_met(d, vars(args))] + sorted(moot):
        setattr(args, dest, train.get_default(dest))
    return given(train, typed) | recorded


def compare_resume(saved_config: dict, config: dict, *, state: ck.State | None = None,
                   path: str = "the checkpoint") -> tuple[dict, str | None]:
    """Whether a run configured by ``config`` may resume checkpoint ``path`` (configured by
    ``saved_config``, at ``state``): ``(changed, refusal)``, ``changed`` mapping each of
    :data:`RESUME_MAY_CHANGE` that differs to ``{"checkpoint": old, "now": new}`` (of
    :data:`RESUME_EXCHANGE`, only what the checkpoint records, a ``--sync``'s settings only
    under the same one); ``refusal``: None, or why not."""
    problems, was_sync = [], saved_config.get("sync")
    if differ := [k for k in RESUME_MUST_MATCH if saved_config.get(k) != config.get(k)]:
        problems.append(f"checkpoint {path} was written with different settings: " + ", ".join(
            f"--{k.replace('_', '-')} {saved_config.get(k)} (now {config.get(k)})" for k in differ))
    was, now = saved_config.get("data_fingerprint"), config.get("data_fingerprint")
    if was is not None and now is not None and was != now:
        from ..data.sources import fingerprint_change  # the data's modules: only here
        problems.append(f"the dataset {config.get('dataset')} changed since checkpoint {path} "
                        f"was written ({fingerprint_change(was, now)}): resume with the data "
                        f"it was trained on, or start over with --restart or another "
                        f"--checkpoint-dir")
    epochs = config.get("epochs")
    need = None if state is None else state.epoch + (1 if state.step else 0)  # to finish it
    if need is not None and epochs is not None and epochs < need:
        done = f"{state.epoch} epochs" + (f" and {state.step} steps of epoch {state.epoch + 1}"
                                          if state.step else "")
        problems.append(f"--epochs {epochs} is below what checkpoint {path} has done ({done}, "
                        f"global step {state.global_step}): resume with --epochs {need} or "
                        f"more, or start over with --restart")
    changed = {k: {"checkpoint": saved_config.get(k), "now": config.get(k)}
               for k in RESUME_MAY_CHANGE if saved_config.get(k) != config.get(k)
               and (k not in RESUME_EXCHANGE or (k in saved_config
                    and (k == "sync" or was_sync == config.get("sync"))))}
    return changed, "; ".join(problems) or None


def format_changes(changed: dict) -> str:
    """One line announcing the settings a resume changed ('' if none): the hyperparameters,
    then the gradient exchange (:data:`RESUME_EXCHANGE`: ``--sync`` and its settings)."""
    groups = {"changed hyperparameters": [k for k in changed if k not in RESUME_EXCHANGE],
              "another gradient exchange": [k for k in changed if k in RESUME_EXCHANGE]}
    parts = [f"{what}: " + ", ".join(f"--{k.replace('_', '-')} {changed[k]['now']} (the "
                                     f"checkpoint used {changed[k]['checkpoint']})" for k in keys)
             for what, keys in groups.items() if keys]
    return "resuming with " + "; with ".join(parts) if parts else ""


def resumed(comm: C.Comm, directory: str, config: dict, found) -> ck.State | None:
    """The state to resume from, ``found`` (``(path, state)``, or None: none in
    ``directory``), once :func:`compare_resume` accepts it for this run's ``config``;
    announces what changed and records it in ``config["resume_changes"]``."""
    from .. import comm as C
    from ..observe.watch import say

    if found is None:
        say(comm, f"no checkpoint in {directory}: starting from the beginning")
        return None
    path, state = found
    state.source = state.source or path  # what a refusal of its position names
    changed, refusal = compare_resume(state.config, config, state=state, path=path)
    if refusal:
        raise C.MpidpError(refusal)
    if changed:
        config["resume_changes"] = changed
        say(comm, format_changes(changed))
    say(comm, f"resumed from {path}: epoch {state.epoch + 1}, step {state.step}, "
        f"{state.global_step} steps done (written with "
        f"{state.config.get('world_size', '?')} ranks, now {comm.size})")
    return state
