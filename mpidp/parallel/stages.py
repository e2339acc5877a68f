"""Planning a pipeline, pure (no MPI): the layers of each stage (:func:`plan_stages`), the
micro-batches, and each stage's order of forward (``F``) and backward (``B``) passes;
:func:`replay` runs schedules on given op durations (their bubble, without MPI)."""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from ..data.partition import block_counts, steps_per_epoch
from ..digest import checksum
from ..errors import setting
from ..nn.layers import Layer
from ..nn.model import as_shape, chain_shapes

SCHEDULES = ("gpipe", "1f1b")
BALANCE = ("params", "time")
Op = tuple[str, int]  # ("F" | "B", micro-batch index)


def param_counts(layers: Sequence[Layer]) -> list[int]:
    """Number of parameters of each layer (0 for activations)."""
    return [sum(int(np.prod(s)) for s in layer.param_shapes().values()) for layer in layers]


def measure_costs(layers: Sequence[Layer], n_in: int, n_samples: int = 256,
                  dtype: npt.DTypeLike = np.float32, repeats: int = 3) -> list[float]:
    """Median seconds of one forward plus backward of each layer on ``n_samples`` random
    inputs (copies of the layers, one at a time; the first skips dL/dx, as in training)."""
    rng, out = np.random.default_rng(0), []
    for i, (layer, shape) in enumerate(zip(layers, chain_shapes(layers, as_shape(n_in)))):
        probe, params = copy.copy(layer), layer.param_shapes()
        probe.bind({k: np.zeros(s, dtype) for k, s in params.items()},
                   {k: np.zeros(s, dtype) for k, s in params.items()})
        probe.init_(rng)
        x = rng.standard_normal((n_samples, *shape)).astype(dtype)
        times = []
        for _ in range(repeats + 1):  # the first run warms caches and is dropped
            t = time.perf_counter()
            y = probe.forward(x)
            probe.backward(np.ones_like(y), need_input_grad=i > 0)
            times.append(time.perf_counter() - t)
        out.append(float(np.median(times[1:])))
    return out


def split_stages(costs: Sequence[float], n_stages: int) -> list[int]:
    """Cut layers ``0 .. L-1`` into ``n_stages`` non-empty consecutive stages minimising the largest
    stage cost (dynamic programming): bounds ``b``, stage ``s`` layers ``b[s] .. b[s+1]-1``."""
    n = len(costs)
    if n_stages < 1:
        raise ValueError(f"need at least one pipeline stage, got {n_stages}")
    if n_stages > n:
        raise ValueError(f"more pipeline stages ({n_stages}) than layers ({n}): every stage "
                         f"needs at least one layer; use at most {n} ranks per pipeline")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(costs, np.float64))])
    best = np.full((n_stages + 1, n + 1), np.inf)  # best[k][j]: layers 0..j-1 in k stages
    cut = np.zeros((n_stages + 1, n + 1), np.int64)
    best[0][0] = 0.0
    for k in range(1, n_stages + 1):
        for j in range(k, n - (n_stages - k) + 1):
            for i in range(k - 1, j):
                worst = max(best[k - 1][i], prefix[j] - prefix[i])
                if worst < best[k][j] - 1e-12 * max(1.0, abs(worst)):
                    best[k][j], cut[k][j] = worst, i
    bounds = [n]
    for k in range(n_stages, 0, -1):
        bounds.append(int(cut[k][bounds[-1]]))
    return bounds[::-1]


def micro_batch_sizes(n: int, m: int) -> np.ndarray:
    """Sizes of the ``m`` micro-batches of ``n`` samples (the first ``n % m`` one larger)."""
    if m < 1:
        raise ValueError(f"need at least one micro-batch, got {m}")
    if m > n:
        raise ValueError(f"more micro-batches ({m}) than samples in a batch ({n}): every "
                         f"micro-batch needs a sample; use {setting('micro_batches')} <= {n}")
    return block_counts(n, m)


def schedule(name: str, n_stages: int, stage: int, m: int) -> list[Op]:
    """The order in which ``stage`` (of ``n_stages``) runs its ops for ``m`` micro-batches:
    ``gpipe``: all forwards, then all backwards; ``1f1b``: ``P - stage - 1`` forwards, then
    a forward and a backward alternately, then the last backwards."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {SCHEDULES}")
    if name == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(n_stages - stage - 1, m)
    ops: list[Op] = [("F", i) for i in range(warm)]
    for j in range(m - warm):
        ops += [("F", warm + j), ("B", j)]
    return ops + [("B", j) for j in range(m - warm, m)]


def max_in_flight(ops: Sequence[Op]) -> int:
    """Largest number of micro-batches forwarded but not yet backwarded along ``ops``."""
    return max([0, *itertools.accumulate(1 if kind == "F" else -1 for kind, _ in ops)])


def replay(schedules: Sequence[Sequence[Op]], durations: Sequence[Sequence[float]],
           latency: float = 0.0) -> tuple[np.ndarray, float]:
    """Run each stage's ``schedules[s]`` with op ``k`` lasting ``durations[s][k]`` (``F(i)`` waits
    for ``F(i)`` on ``s-1``, ``B(i)`` for ``B(i)`` on ``s+1``, plus ``latency``): each stage's busy
    seconds ``(P,)`` and the makespan. ``ValueError`` on a deadlock."""
    P = len(schedules)
    done: list[dict[Op, float]] = [{} for _ in range(P)]
    pos, free = [0] * P, [0.0] * P
    while any(pos[s] < len(schedules[s]) for s in range(P)):
        moved = False
        for s in range(P):
            while pos[s] < len(schedules[s]):
                kind, i = schedules[s][pos[s]]
                src = s - 1 if kind == "F" else s + 1
                if 0 <= src < P and (kind, i) not in done[src]:
                    break
                ready = done[src][(kind, i)] + latency if 0 <= src < P else 0.0
                free[s] = max(free[s], ready) + durations[s][pos[s]]
                done[s][(kind, i)] = free[s]
                pos[s] += 1
                moved = True
        if not moved:
            raise ValueError("the schedules deadlock: no stage can run its next op")
    busy = np.array([float(np.sum(d)) for d in durations])
    return busy, max(free)


@dataclass
class StagePlan:
    """What every rank agrees on before any message: stage bounds and boundary widths."""

    bounds: list[int]  # stage s holds layers bounds[s] .. bounds[s+1]-1
    widths: list[int]  # widths[i]: features per sample entering layer i; [-1]: model output
    costs: list[float]
    n_params: list[int]  # per layer
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # per-sample shapes, likewise

    def fingerprint(self, *extra) -> int:
        dims = [d for s in self.shapes for d in (*s, -2)]
        return checksum(np.array([*self.bounds, -1, *self.widths, -1, *dims, -1, *extra], np.int64))


def plan_stages(layers: Sequence[Layer], n_in: int, n_stages: int, size: int, micro_batches: int,
              schedule: str, balance: str, costs: Sequence[float] | None) -> StagePlan:
    """Validate the pipeline's settings and split the layers; ``ValueError`` if impossible."""
    for what, value, known in (("schedule", schedule, SCHEDULES), ("balance", balance, BALANCE)):
        if value not in known:
            raise ValueError(f"unknown {what} {value!r}; expected one of {known}")
    if micro_batches < 1:
        raise ValueError(f"need at least one micro-batch, got {micro_batches}")
    if n_stages < 1 or size % n_stages:
        raise ValueError(f"{size} ranks cannot form replicas of {n_stages} pipeline stages: "
                         f"the number of ranks must be a multiple of the number of stages")
    shapes = chain_shapes(layers, as_shape(n_in))
    widths = [int(np.prod(s)) for s in shapes]
    n_params = param_counts(layers)
    costs = list(costs) if costs is not None else [float(c) for c in n_params]
    if len(costs) != len(layers):
        raise ValueError(f"got {len(costs)} layer costs for {len(layers)} layers")
    return StagePlan(split_stages(costs, n_stages), widths, costs, n_params, shapes)


def check_batches(n: int, batch_size: int, drop_last: bool, n_replicas: int,
                  micro_batches: int) -> None:
    """``ValueError`` unless every replica's part of every batch has ``micro_batches``."""
    steps = steps_per_epoch(n, batch_size, drop_last)
    if steps == 0:
        raise ValueError(f"no full batch of {batch_size} in {n} samples (drop_last)")
    smallest = min(batch_size, n - (steps - 1) * batch_size) // n_replicas  # the last is smallest
    if smallest < micro_batches:
        where = "" if n_replicas == 1 else f" per replica ({n_replicas} replicas)"
        raise ValueError(f"more micro-batches ({micro_batches}) than samples in a batch: the "
                         f"smallest batch has {smallest} samples{where}; use "
                         f"{setting('micro_batches')} <= {smallest}, a larger batch size, or "
                         f"{setting('drop_last')}")


def held_bytes(layers: Sequence[Layer], exclude: np.ndarray | None) -> int:
    """Bytes of the arrays ``layers`` cache for backward (each once), not views of ``exclude``."""
    bases = {}  # the arrays' own buffers, each once
    for layer in layers:
        for value in vars(layer).values():
            if isinstance(value, np.ndarray):
                base = value if value.base is None else value.base
                bases[id(base)] = base
    return sum(base.nbytes for base in bases.values()
               if exclude is None or not np.may_share_memory(base, exclude))
