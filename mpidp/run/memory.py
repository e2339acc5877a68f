"""How much memory a run needs, estimated before anything is allocated, so that a model too
big for the node is refused with the figure and what to change, not a ``MemoryError`` on
every rank. Pure arithmetic plus ``/proc/meminfo``; no MPI."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from ..nn.model import as_shape, chain_shapes

#: Copies of the parameter vector a rank may hold: parameters, gradients (with the reduced
#: buffer), two more for the exchange strategies (residuals, padded or shared buffers).
BASE_COPIES = 4
OPTIMIZER_COPIES = {"sgd": 0, "momentum": 1, "adam": 2}


def estimate_counts(count: int, activations: int, dtype, optimizer: str, batch: int,
                    share: float = 1.0) -> int:
    """Bytes one rank needs for a model of ``count`` parameters whose layers' inputs and
    output hold ``activations`` values per sample: ``share`` of the parameter copies plus
    three copies of a batch's activations."""
    item = np.dtype(dtype).itemsize
    copies = BASE_COPIES + OPTIMIZER_COPIES.get(optimizer, 2)
    return int(count * share * copies * item + 3 * batch * activations * item)


def model_size(layers: Sequence, in_shape: Sequence[int]) -> tuple[int, int]:
    """``(parameters, activation values per sample)`` of unbound ``layers`` taking samples
    of ``in_shape``; nothing is allocated."""
    shapes = chain_shapes(layers, as_shape(in_shape))
    count = sum(int(np.prod(s)) for layer in layers for s in layer.param_shapes().values())
    return count, sum(int(np.prod(s)) for s in shapes)


def available() -> int | None:
    """Bytes of memory available on this node (``MemAvailable``), None if unknown."""
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def check(need: int, ranks_here: int, what: str) -> None:
    """ValueError when ``ranks_here`` ranks needing ``need`` bytes each do not fit."""
    have = available()
    if have is None or need * ranks_here <= have:
        return
    raise ValueError(f"{what} needs about {need / 2**30:.1f} GiB per rank, {ranks_here} "
                     f"rank(s) on this node {need * ranks_here / 2**30:.1f} GiB, but only "
                     f"{have / 2**30:.1f} GiB are available")
