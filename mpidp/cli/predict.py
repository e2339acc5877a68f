"""``mpidp predict``: a saved model applied to a dataset across the ranks (map/reduce),
every rank writing its own rows of one ``.npy`` file."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from .. import comm as C
from .. import nn
from ..atomic import check_file, target, write_atomic
from ..data.partition import block_range, split_rows
from ..data.sources import open_source, scan_rows
from ..nn.modelfile import is_model_file
from ..nn.sparse import CSR, input_problem
from ..observe.scores import ScoreSums
from ..parallel.evaluation import global_sums
from ..parallel.mapreduce import map_reduce
from .imports import HINT, import_modules, imports_of, model_file, saved_spec, unregistered
from .options import GENERATED, SIZE_DEFAULTS, WATCHDOG_ON


class _Rows:
    """A source restricted to ``rows`` (sorted), cast to the model's dtype."""

    def __init__(self, src, rows, dtype) -> None:
        self.src, self.rows, self.dtype, self.n_samples = src, rows, dtype, len(rows)

    def read(self, idx):
        X, y = self.src.read(self.rows[np.asarray(idx)])
        return (X.astype(self.dtype) if isinstance(X, CSR) else np.asarray(X, self.dtype)), y

    def costs(self):
        return self.src.costs()[self.rows] if hasattr(self.src, "costs") else None


def _open_model(path: str) -> nn.Sequential:
    """The model saved in ``path`` (a ``model.npz`` or its folder), by :func:`mpidp.nn.load`;
    ValueError naming the file if it is missing, truncated, corrupted (zip CRC-32), not a model,
    or not finite, and naming the layer class and ``--import`` for one no imported module registers."""
    if is_model_file(path) and not os.path.isdir(path):
        raise ValueError(f"--model {path} is a model file (layers without trained parameters): "
                         f"give the model.npz that 'mpidp train' wrote from it, or its folder")
    try:
        model = nn.load(path, check_finite=False)
    except ValueError as exc:
        if missing := [name for name in unregistered(saved_spec(path)) if repr(name) in str(exc)]:
            raise ValueError(f"--model {model_file(path)!r} uses layer class {missing[0]!r}, "
                             f"which is not registered: {HINT}") from None
        raise ValueError(f"--model {exc}; give the model.npz that 'mpidp train' wrote, or its "
                         f"folder") from None
    if not np.isfinite(model.params).all():
        raise ValueError(f"--model {model_file(path)!r}: the saved parameters contain NaN or Inf")
    return model


def _scores(comm: C.Comm, model: nn.Sequential, mine: _Rows, classifier: bool) -> dict:
    """The figures of ``model`` on every rank's rows ``mine`` (:mod:`mpidp.observe.scores`),
    equal to one process' on all of them. Collective."""
    sums, problem = ScoreSums(classifier, model.n_out), None
    for lo in range(0, mine.n_samples, 4096):
        X, y = mine.read(np.arange(lo, min(lo + 4096, mine.n_samples)))
        what = "rows"  # features (token ids, say), then labels or targets, that do not suit
        try:
            scores = model.predict(X, "scores")
            what = "labels"
            sums.add(scores, y)
        except ValueError as exc:  # agreed on
            problem = f"the dataset's {what} do not suit the model ({exc})"
            break
    C.agree(comm, problem and f"{problem}; no predictions were written")
    _, vector = global_sums(comm, np.zeros(1), sums)
    return sums.scores(vector)


def check_outputs(args: argparse.Namespace) -> None:
    """ValueError naming the option, the path and the fix unless ``--out`` (and
    ``--metrics``) can be written as files: not a folder, not a symbolic link to nothing,
    in a place where a file can be created (tried, before any work)."""
    check_file(args.out, "--out", "predictions.npy")
    if args.metrics:
        check_file(args.metrics, "--metrics", "metrics.json")
        if os.path.realpath(args.metrics) == os.path.realpath(args.out):
            raise ValueError(f"--metrics {args.metrics} is the --out file: the figures would "
                             f"replace the predictions; give another path")


def problems(args: argparse.Namespace, given: set[str] = frozenset()) -> list[str]:
    """Options that would do nothing together, as messages (empty when all is well). ``given``:
    the options written on the command line (refused where they do nothing, whatever their value)."""
    out = []
    if args.dynamic and args.partition != "block":
        out.append(f"--partition {args.partition} does not apply with --dynamic: the ranks "
                   f"take chunks of rows as they go")
    if "chunk_size" in given and not args.dynamic:
        out.append("--chunk-size needs --dynamic (ranks then take chunks of that many rows)")
    if "watchdog_grace" in given and not WATCHDOG_ON.holds(vars(args)):
        out.append(WATCHDOG_ON.refusal)
    if args.test_fraction is not None and args.rows != "test":
        out.append("--test-fraction needs --rows test (it sizes the held-out rows)")
    if args.dataset not in GENERATED:  # a file or a built-in set: its own size and rows
        if sized := [f"--{dest.replace('_', '-')}" for dest in SIZE_DEFAULTS if dest in given]:
            out.append(f"{' and '.join(sized)} {'do' if len(sized) > 1 else 'does'} not apply "
                       f"to --dataset {args.dataset}: only the generated datasets "
                       f"({', '.join(GENERATED)}) are made to a size")
        if "seed" in given and args.rows != "test":
            out.append(f"--seed does not apply to --dataset {args.dataset} with --rows "
                       f"{args.rows}: it seeds the held-out split (--rows test) and generated data")
    return out


def _seed_problem(args: argparse.Namespace, given: set[str], src) -> str | None:
    """``--seed`` given where it seeds nothing: the held-out rows of a dataset with a test
    set of its own (no --test-fraction), on a dataset that is not generated."""
    if "seed" in given and args.dataset not in GENERATED and args.rows == "test" \
            and args.test_fraction is None and src.fixed_test:
        return (f"--seed does not apply to --dataset {args.dataset} with --rows test: its "
                f"test rows are its own (give --test-fraction for a seeded split)")
    return None


def predict(args: argparse.Namespace, comm: C.Comm, given: set[str] = frozenset()) -> dict | None:
    """Run ``mpidp predict``. Collective. Returns a summary on rank 0. ``given``: the
    options written on the command line."""
    if errors := problems(args, given):  # the same on every rank, from the same arguments
        raise C.MpidpError("; ".join(errors))
    C.root_decides(comm, check_outputs, args)
    # the user's layers: one that stalls a rank is named, as under train
    watchdog = C.Watchdog(comm, args.watchdog, args.watchdog_grace).start() if args.watchdog != 0 else None
    try:
        with C.user_code(f"importing --import {', '.join(imports_of(args))}"):
            C.run_agreed(comm, import_modules, imports_of(args))
        model = C.run_agreed(comm, _open_model, args.model)
    finally:  # not over the rows: a rank may compute its block for hours without MPI
        if watchdog is not None:
            watchdog.stop()
    src = C.run_agreed(comm, open_source, args.dataset, seed=args.seed,
                       n_samples=args.n_samples, n_features=args.n_features)
    if seed := _seed_problem(args, given, src):  # the same verdict on every rank, as below
        raise C.MpidpError(seed)
    rows = (split_rows(src.n_samples, args.test_fraction, args.seed, src.fixed_test)[1]
            if args.rows == "test" else np.arange(src.n_samples))
    shape = tuple(src.sample_shape)
    if shape != model.in_shape and not (len(model.in_shape) == 1 and src.n_features == model.n_in):
        what = lambda s: f"{s[0]} features" if len(s) == 1 else f"samples of shape {s}"
        raise C.MpidpError(f"--dataset {args.dataset} has {what(shape)}, but the model in "
                           f"{args.model} takes {what(model.in_shape)}")
    problem = len(rows) and input_problem(model.layers, isinstance(src.read(rows[:1])[0], CSR))
    if problem:
        raise C.MpidpError(f"--dataset {args.dataset} does not suit the model in "
                           f"{args.model}: {problem}")
    mine = rows[slice(*block_range(len(rows), comm.size, comm.rank))]
    bad = scan_rows(src, mine, dtype=model.dtype)  # each rank its block, before any work
    C.agree(comm, bad and f"{bad}: predictions for such rows are meaningless; clean or drop "
            f"them first")
    classifier = model.meta.get("classification", src.classification)
    C.agree(comm, None if args.output == "scores" or classifier else
            f"--output {args.output} needs a classifier, but the model in {args.model} was "
            f"trained for regression: use --output scores")
    scored = src.classification or classifier is False
    C.agree(comm, None if scored or not args.metrics else
            f"--metrics: the model in {args.model} is a classifier, but --dataset "
            f"{args.dataset} holds real-valued targets, not class labels: no figures to write")
    data = _Rows(src, rows, model.dtype)
    costs = data.costs() if args.partition == "cost" else None
    # the figures first: labels that do not suit the model are refused before any output
    scores = _scores(comm, model, _Rows(src, mine, model.dtype), classifier) if scored else None
    res = map_reduce(comm, lambda X: nn.outputs(model.forward(X), args.output), data, "concat",
                     partition=args.partition, costs=costs, dynamic=args.dynamic,
                     chunk_size=args.chunk_size, out=target(args.out))  # a link: its file
    if args.metrics and scores is not None:
        C.root_decides(comm, write_atomic, args.metrics,
                       lambda f: f.write(json.dumps(scores, indent=2).encode()), "--metrics")
    if comm.rank != 0:
        return None
    correct = None if scores is None else scores.get("accuracy")
    acc = "" if correct is None else f", accuracy {correct:.4f}"
    if scores is not None and "f1_macro" in scores:
        acc += f", macro F1 {scores['f1_macro']:.4f}"
    elif scores is not None and scores.get("r2") is not None:
        acc += f", MSE {scores['mse']:.6g}, R^2 {scores['r2']:.4f}"
    print(f"predicted {len(rows)} rows on {comm.size} ranks in {res.seconds:.2f}s{acc}; "
          f"wrote {args.out}", flush=True)
    return {"rows": len(rows), "out": args.out, "accuracy": correct, "scores": scores,
            "per_rank": res.per_rank, "seconds": res.seconds}
