"""The data the options name: how ``mpidp train`` loads them (:func:`load_data`, in every
mode: :func:`load_settings`) and partitions them over the ranks (:func:`partition_of`)."""

from __future__ import annotations

import argparse

import numpy as np

from .. import comm as C
from ..data import distribute as D
from ..data.balance import Partition
from ..data.dedicated import load_on_workers
from . import options as O


def _costs_arg(path: str):
    if path in ("auto", "uniform"):
        return None
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--costs {path!r}: cannot read a .npy file ({exc})") from exc


def load_settings(args: argparse.Namespace) -> dict:
    """Keyword arguments for :func:`mpidp.load` that every mode gives."""
    return dict(copy=args.copy_data, seed=args.seed, test_fraction=args.test_fraction,
                val_fraction=args.val_fraction, dtype=args.dtype, n_classes=args.n_classes,
                n_samples=args.n_samples, n_features=args.n_features,
                regression=args.model == "linear" and args.dataset == "synthetic")


def load_data(comm: C.Comm, args: argparse.Namespace, server: int | None) -> D.Data:
    """Load the dataset over all ranks, or (dedicated parameter server) over the workers only,
    the server getting empty shards. Collective; errors reach every rank, said once."""
    def load(over: C.Comm) -> D.Data:
        return D.load(over, args.dataset, distribute=args.distribute, **load_settings(args),
                      partition=args.partition, capacities=args.capacities,
                      costs=C.run_agreed(over, _costs_arg, args.costs))
    return load(comm) if server is None else load_on_workers(comm, server, load, args.dtype)


def partition_of(args: argparse.Namespace, data: D.Data) -> Partition | None:
    """The training partition the options ask for; None with a dedicated server (the
    shards stay as loaded, over the workers)."""
    if O.dedicated_server(args):
        return None
    costs = None if args.costs == "uniform" else data.costs
    return Partition(args.partition, costs, args.capacities, args.adapt_every, args.seed)
