"""What ``mpidp train`` writes in ``--out``: checked before any work (:func:`check_out`),
the live outputs (:func:`outputs`), and at the end ``model.npz``, ``metrics.json`` and
``config.toml`` with the summary on the console (:func:`finish`)."""

from __future__ import annotations

import argparse
import json
import os

from .. import comm as C
from .. import nn
from ..atomic import check_folder, write_together
from ..data import distribute as D
from ..observe.report import summary
from ..observe.watch import Outputs, Watch, say
from ..run.checkpoint import write_atomic
from . import config as config_file
from . import options as O

BEST = "best.npz"  # the best validation epoch's model, in OUT


def check_out(args: argparse.Namespace) -> None:
    """ValueError unless every output location can be written (tried for real; no
    symbolic link to nothing in the way) and ``OUT/config.toml`` can record the settings."""
    out = args.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} exists and is not a folder")
    check_folder(out, "--out")
    if args.checkpoint_dir:
        check_folder(args.checkpoint_dir, "--checkpoint-dir")
    config_file.check_recordable(O.applying(vars(args)))
    Watch.check(outputs(args))


def outputs(args: argparse.Namespace) -> Outputs:
    """Where the run's live outputs go, from the options."""
    return Outputs(args.out, args.log_every, args.tensorboard, args.trace, args.trace_steps)


def model_meta(args: argparse.Namespace, data: D.Data) -> dict:
    """What ``model.npz`` (and ``best.npz``) records of the run besides the model."""
    return {"model": args.model, "hidden": list(args.hidden), "n_features": data.n_features,
            "sample_shape": list(data.sample_shape), "n_outputs": data.n_outputs,
            "classification": data.classification, "standardized": bool(args.standardize)}


def finish(comm: C.Comm, args: argparse.Namespace, metrics: dict, model: nn.Sequential,
           data: D.Data, replicas: str) -> dict:
    """On rank 0: write ``model.npz``, ``metrics.json`` and ``config.toml`` (all of them or,
    when one fails, none: :func:`mpidp.atomic.write_together`) and print the summary."""
    meta = model_meta(args, data)
    texts = {"metrics.json": json.dumps(metrics, indent=2).encode(),
             "config.toml": config_file.dumps(O.applying(metrics["config"])).encode()}
    write_together([(os.path.join(args.out, "model.npz"),
                     lambda path: nn.save(model, path, meta=meta)),
                    *((os.path.join(args.out, name), lambda path, text=text: write_atomic(
                        path, lambda f: f.write(text))) for name, text in texts.items())],
                   what="--out")
    say(comm, *summary(metrics, comm.size, args.out, replicas))
    return metrics
