"""The model the options name: its file checked against the mode before any data
(:func:`check_model_file`), its layers for the data (:func:`build_layers`) checked against
the data's rows (:func:`check_inputs`) and the node's memory (:func:`check_fits`), and its
optimizer (:func:`optimizer_factory`)."""

from __future__ import annotations

import argparse

from .. import comm as C
from .. import nn
from ..data import distribute as D
from ..data.partition import steps_per_epoch
from ..nn.modelfile import is_model_file, layers_from, read_model_file
from ..nn.schedules import epoch_schedule
from ..nn.sparse import CSR
from ..parallel.modes import refuses_model
from ..run import memory
from .imports import HINT, near, unregistered


def check_model_file(args: argparse.Namespace) -> None:
    """ValueError naming the option, the mode and the reason when ``--model`` (a model
    file) holds a layer the chosen ``--parallel`` / ``--sync`` cannot train."""
    if not is_model_file(args.model):
        return
    specs = read_model_file(args.model)
    if missing := unregistered(specs):
        raise ValueError(f"--model {args.model}: layer class {missing[0]!r} is not registered: "
                         f"{HINT}{near(missing[0])}")
    layers = layers_from(specs, 1, where=f"--model {args.model}")
    if why := refuses_model(layers, args.parallel, args.sync):
        raise ValueError(f"--model {args.model}: {why}")


def build_layers(args: argparse.Namespace, data: D.Data) -> tuple[list, nn.Loss]:
    """The unbound layers and loss that ``--model`` names, for ``data``'s samples (with a
    ``Standardize`` in front for ``--standardize``)."""
    sparse = isinstance(data.train.X, CSR)
    if args.standardize and sparse:
        raise ValueError(f"--standardize does not apply to --dataset {args.dataset}: its rows "
                         f"are sparse, and centring them would make them dense")
    layers, loss = nn.model_layers(args.model, data.sample_shape, data.n_outputs, args.hidden,
                                   data.classification, sparse)
    if args.standardize and layers[0].reads:
        raise ValueError(f"--standardize does not apply to this model: its first layer "
                         f"{layers[0]!r} reads {layers[0].reads} from the data set, "
                         f"which centring would change")
    return ([nn.Standardize(), *layers] if args.standardize else layers), loss


def check_inputs(comm: C.Comm, args: argparse.Namespace, layers: list, data: D.Data) -> None:
    """Every rank checks its rows against a first layer that takes token ids (an ``Embedding``);
    one error on every rank, before any work, if a row holds another value. Collective."""
    error = None
    if isinstance(layers[0], nn.Embedding):
        try:
            for shard in (data.train, data.test):
                layers[0].token_ids(shard.X)
        except ValueError as exc:
            error = f"--dataset {args.dataset} does not suit --model {args.model}: {exc}"
    C.agree(comm, error)


def check_fits(args: argparse.Namespace, data: D.Data, share: float, ranks_here: int) -> None:
    """ValueError, with the figure and the fix, when ``share`` of the model cannot fit in
    memory on ``ranks_here`` ranks of a node (or ``--val-fraction`` left no validation rows
    to watch, or the learning-rate schedule makes no sense: :func:`optimizer_factory`)."""
    if args.val_fraction and data.val is None:
        raise ValueError(f"--val-fraction {args.val_fraction} leaves no validation rows of the "
                         f"{data.train.n_total} training samples: give a larger fraction")
    optimizer_factory(args, data.train.n_total)
    try:
        count, activations = memory.model_size(build_layers(args, data)[0], data.sample_shape)
    except ValueError as exc:  # the file named once, as the option; another option as itself
        said = str(exc).removeprefix(f"model file {args.model}: ")
        raise ValueError(said if said.startswith("--") else f"--model {args.model}: {said}") \
            from None
    need = memory.estimate_counts(count, activations, args.dtype, args.optimizer,
                                  args.batch_size, share)
    hidden = f", hidden {','.join(map(str, args.hidden))}" if args.model == "mlp" else ""
    try:
        memory.check(need, ranks_here, f"the {args.model} model of {count:,} parameters "
                     f"({data.n_features} features, {data.n_outputs} outputs{hidden})")
    except ValueError as exc:
        hint = (" (outputs come from the largest class label + 1: check the labels or set "
                "--n-classes)" if data.classification and args.n_classes is None
                and data.n_outputs > 10_000 else "")
        fixes = ["smaller --hidden layers" if args.model == "mlp" else None,
                 "--dtype float32" if args.dtype == "float64" else None,
                 "fewer ranks per node", "a node with more memory"]
        raise ValueError(f"{exc}{hint}; use " + ", ".join(f for f in fixes if f)) from None


def optimizer_factory(args: argparse.Namespace, n_train: int):
    """A factory of the optimizer the options ask for, its rate a schedule of the update
    count (:func:`mpidp.nn.schedules.epoch_schedule`) for ``n_train`` training samples
    in global batches (accumulation updates once per group). ValueError naming the options
    when the schedule they ask for makes no sense (:func:`check_fits` asks first)."""
    steps = steps_per_epoch(n_train, args.batch_size, args.drop_last)
    per_epoch = -(-steps // args.sync_every) if args.sync == "accumulate" else steps
    lr = args.lr if args.lr_scaling == "none" else nn.scaled_lr(
        args.lr, args.batch_size, args.base_batch, args.lr_scaling)
    warmup, updates = args.warmup_steps or round(args.warmup_epochs * per_epoch), \
        args.epochs * per_epoch
    if warmup and warmup >= updates:
        asked = (f"--warmup-steps {args.warmup_steps}" if args.warmup_steps else
                 f"--warmup-epochs {args.warmup_epochs:g}")
        raise ValueError(f"{asked} is not shorter than the run ({updates} updates in --epochs "
                         f"{args.epochs}): every update would be warmup; give a shorter one")
    if args.lr_schedule in ("cosine", "polynomial") and args.lr_min > lr:
        raise ValueError(f"--lr-min {args.lr_min:g} is above the learning rate {lr:g} (--lr"
                         f"{'' if args.lr_scaling == 'none' else ' scaled by --lr-scaling'}): "
                         f"the {args.lr_schedule} schedule decays from it down to --lr-min")
    schedule = epoch_schedule(args.lr_schedule, lr, per_epoch, args.epochs,
                              warmup_steps=args.warmup_steps, warmup_epochs=args.warmup_epochs,
                              step_epochs=args.lr_step_epochs, milestones=args.lr_milestones,
                              gamma=args.lr_gamma, min_lr=args.lr_min)
    return lambda: nn.make_optimizer(args.optimizer, schedule, args.momentum, args.weight_decay,
                                     clip_norm=args.clip_norm, clip_value=args.clip_value)
