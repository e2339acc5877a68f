"""Partitioning during training: :class:`Plan` applies a :class:`~.partition.Partition` inside
:func:`mpidp.fit` (``cost`` and ``adaptive`` rebalance every epoch's batches, moving rows by
``Alltoallv``; the global batches stay the same), and the load-balance figures. A rank's wait at
step ``s`` is estimated as ``max_q compute[q, s] - compute[r, s]`` from the per-step times
allgathered at epoch end; the rest of the ``Allreduce`` time is communication proper."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import numpy as np

from .. import comm as C
from ..nn.sparse import CSR
from ..observe.metrics import STEP_FIELDS, StepTimer
from . import partition as Pt
from .distribute import Shard
from .partition import Partition

_F = {name: i for i, name in enumerate(STEP_FIELDS)}


def _move_X(comm: C.Comm, X, send: np.ndarray, recv: np.ndarray):
    if not isinstance(X, CSR):
        return C.alltoallv_rows(comm, X, send, recv)
    lengths = X.row_lengths()
    new_len = C.alltoallv_rows(comm, lengths, send, recv)
    dest = np.repeat(np.arange(comm.size), send)
    nnz_send = np.bincount(dest, weights=lengths, minlength=comm.size).astype(np.int64)
    nnz_recv = C.alltoall_counts(comm, nnz_send)[:, comm.rank]
    indices = C.alltoallv_rows(comm, X.indices, nnz_send, nnz_recv)
    data = C.alltoallv_rows(comm, X.data, nnz_send, nnz_recv)
    return CSR(np.concatenate([[0], np.cumsum(new_len)]), indices, data, X.n_cols)


def redistribute(comm: C.Comm, shard: Shard, owner: np.ndarray) -> tuple[Shard, int]:
    """Move rows so that this rank holds exactly the positions ``owner`` ``(n_total,)`` (the
    same on every rank) gives it. Collective. Returns the new shard (rows by increasing
    position; untouched when nothing moves) and how many rows changed rank (on every rank)."""
    dest = np.asarray(owner, np.int64)[shard.positions]
    order = np.argsort(dest, kind="stable")
    send = np.bincount(dest, minlength=comm.size).astype(np.int64)
    matrix = C.alltoall_counts(comm, send)
    moved = int(matrix.sum() - np.trace(matrix))
    if moved == 0:
        return shard, 0
    recv = matrix[:, comm.rank]
    pos = C.alltoallv_rows(comm, shard.positions[order], send, recv)
    y = C.alltoallv_rows(comm, shard.y[order], send, recv)
    X = _move_X(comm, shard.X[order], send, recv)
    by_pos = np.argsort(pos, kind="stable")
    pos = pos[by_pos]
    return Shard(X[by_pos], y[by_pos], int(pos[0]) if len(pos) else 0, shard.n_total, pos), moved


class Plan:
    """Applies a :class:`Partition` during :func:`mpidp.fit`. Every rank holds one and takes
    the same decisions from the same (allgathered) measurements."""

    def __init__(self, comm: C.Comm, partition: Partition | None, n: int, batch_size: int,
                 seed: int, shuffle: bool = True, drop_last: bool = False) -> None:
        self.comm, self.partition, self.n, self.batch_size = comm, partition, n, batch_size
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        if partition is not None:
            C.run_agreed(comm, partition.check, n, comm.size)
        self.uniform = partition is None or partition.costs is None  # every sample costs the same
        self.costs = np.ones(n) if self.uniform else partition.costs
        caps = partition.capacities if partition is not None else None
        self.capacities = np.ones(comm.size) if caps is None else np.asarray(caps, np.float64)
        self.owner: np.ndarray | None = None
        self.moved, self.history_caps = 0, []

    @property
    def strategy(self) -> str | None:
        return self.partition.strategy if self.partition is not None else None

    def _wanted(self, epoch: int) -> np.ndarray | None:
        if self.partition is None:
            return None
        if self.strategy == "adaptive" and self.uniform:
            # equal costs: blocks proportional to the measured speeds balance every batch
            # in expectation, and rows move only when the speeds change (not every epoch)
            return Pt.assign("weighted", self.n, self.comm.size, capacities=self.capacities)
        if self.strategy in Pt.PER_BATCH:
            order = Pt.epoch_order(self.n, epoch, self.seed, self.shuffle)
            return Pt.balance_batches(order, self.batch_size, self.costs, self.capacities)
        return self.owner if self.owner is not None else self.partition.owner(self.n, self.comm.size)

    def _apply(self, shard: Shard, owner: np.ndarray | None, tracer=None) -> Shard:
        if owner is None or (self.owner is not None and np.array_equal(owner, self.owner)):
            return shard
        t0 = time.perf_counter()
        shard, moved = redistribute(self.comm, shard, owner)
        if tracer is not None:
            tracer.add("move rows", "partition", "comm", t0, time.perf_counter(), rows=moved)
        self.owner, self.moved = owner, self.moved + moved
        return shard

    def _remeasured(self, work: np.ndarray, seconds: np.ndarray) -> None:
        self.capacities = Pt.adaptive_capacities(work, seconds, self.capacities)
        self.history_caps.append(self.capacities.round(4).tolist())

    def batches(self, shard: Shard, epoch: int, timer: StepTimer,
                first: int = 0, with_index: bool = False) -> Iterator[tuple]:
        """Yield ``(X, y)`` of this rank's part of each global batch of ``epoch`` from step
        ``first`` on (a resumed epoch), moving rows first when the owners change. Notes each
        step's cost on ``timer``. Collective. ``with_index``: yield ``(X, y, index)``, with
        ``index`` ``(n_local,)`` int64 the rows' global positions in the set."""
        steps = Pt.steps_per_epoch(self.n, self.batch_size, self.drop_last)
        every = self.partition.adapt_every if self.strategy == "adaptive" else None
        s = first
        while s < steps:
            shard = self._apply(shard, self._wanted(epoch), timer.tracer)
            self.shard = shard
            stop = min(steps, s + every) if every else steps
            for idx in itertools.islice(self._local(shard, epoch, s), stop - s):
                timer.note_cost(float(self.costs[shard.positions[idx]].sum()))
                with timer.compute("gather rows"):  # per-sample local work too
                    X, y = shard.X[idx], shard.y[idx]
                yield (X, y, shard.positions[idx]) if with_index else (X, y)
            s = stop
            if every and s < steps:  # re-measure from every rank's work and seconds since the last
                rows = timer.recent(every)
                mine = [rows[:, _F["cost"]].sum(), rows[:, _F["compute_s"]].sum()]
                self._remeasured(*C.allgather_rows(self.comm, mine).T)
        self.shard = shard

    def _local(self, shard: Shard, epoch: int, first: int):
        if shard.contiguous and not self.shuffle:
            return itertools.islice(Pt.local_batches(
                self.n, self.batch_size, shard.start, shard.stop, epoch, self.seed, False,
                self.drop_last), first, None)
        return Pt.owned_batches(self.n, self.batch_size, shard.positions, epoch, self.seed,
                                self.shuffle, self.drop_last, first)

    def end_epoch(self, timer: StepTimer) -> dict:
        """Gather the epoch's per-step rows (one ``Allgather``), return the figures (same on
        every rank) and re-measure ``adaptive`` capacities. Collective."""
        rows = timer.take_records()
        everyone = C.allgather_rows(self.comm, rows.reshape(-1))
        records = everyone.reshape(self.comm.size, len(rows), len(STEP_FIELDS))
        figures = balance_figures(records)
        if self.strategy == "adaptive" and len(rows):
            # the whole epoch, or with adapt_every k the steps since the last re-measurement
            every = self.partition.adapt_every or len(rows)
            last = records[:, (len(rows) - 1) // every * every:]
            self._remeasured(last[:, :, _F["cost"]].sum(axis=1),
                             last[:, :, _F["compute_s"]].sum(axis=1))
        figures.update(strategy=self.strategy or "as loaded", moved_samples=self.moved,
                       capacities=self.capacities.round(4).tolist())
        return figures


def balance_figures(records: np.ndarray) -> dict:
    """Load-balance figures from every rank's per-step rows ``(size, steps, STEP_FIELDS)``:
    ``imbalance`` (mean over steps of ``max/mean`` compute), ``efficiency`` (``sum mean / sum
    max``), both from CPU time too; per rank samples, cost, compute, wait, communication,
    update, idle fraction and ``speed``; ``rate`` (cost per second of critical path),
    ``ideal_rate`` (summed speeds), ``attainable_rate`` (``W / (W / sum(speed) + fixed_s)``,
    ``fixed_s`` the smallest communication + update per step, summed)."""
    size, steps = records.shape[:2]
    c, cpu = records[:, :, _F["compute_s"]], records[:, :, _F["compute_cpu_s"]]
    comm, upd = records[:, :, _F["comm_s"]], records[:, :, _F["update_s"]]
    wait = c.max(axis=0, keepdims=True) - c if steps else c
    proper = np.maximum(comm - wait, 0.0)
    total = c + comm + upd

    def ratios(t):
        mean, top = t.mean(axis=0), t.max(axis=0)
        ok = mean > 0
        imb = float(np.mean(top[ok] / mean[ok])) if ok.any() else 1.0
        return imb, float(mean.sum() / top.sum()) if top.sum() > 0 else 1.0

    imbalance, efficiency = ratios(c)
    imbalance_cpu, efficiency_cpu = ratios(cpu)
    cost = records[:, :, _F["cost"]].sum(axis=1)
    speed = np.where(c.sum(axis=1) > 0, cost / np.maximum(c.sum(axis=1), 1e-300), 0.0)
    critical = float(total.max(axis=0).sum()) if steps else 0.0
    fixed = float((proper + upd).min(axis=0).sum()) if steps else 0.0
    balanced = cost.sum() / speed.sum() if speed.sum() > 0 else 0.0
    per_rank = [{"rank": r, "samples": int(records[r, :, _F["samples"]].sum()),
                 "cost": float(cost[r]), "compute_s": float(c[r].sum()),
                 "compute_cpu_s": float(cpu[r].sum()), "wait_s": float(wait[r].sum()),
                 "comm_s": float(proper[r].sum()), "update_s": float(upd[r].sum()),
                 "idle_fraction": float(wait[r].sum() / total[r].sum()) if total[r].sum() else 0.0,
                 "speed": float(speed[r])} for r in range(size)]
    return {"steps": int(steps), "imbalance": imbalance, "efficiency": efficiency,
            "imbalance_cpu": imbalance_cpu, "efficiency_cpu": efficiency_cpu,
            "slowest_rank": int(np.argmax(c.sum(axis=1))) if steps else 0,
            "rate": float(cost.sum() / critical) if critical else 0.0,
            "ideal_rate": float(speed.sum()), "fixed_s": fixed,
            "attainable_rate": float(cost.sum() / (balanced + fixed)) if balanced + fixed > 0
            else 0.0, "per_rank": per_rank}


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole else "n/a"


def format_balance(fig: dict, per_rank: bool = True) -> str:
    """The load-balance summary lines, and (``per_rank``) the raw rates and a per-rank table.
    The share quoted is ``rate / ideal_rate`` (on one rank: the forward and backward's share
    of the step time), beside ``attainable_rate / ideal_rate`` (:func:`balance_figures`)."""
    rate, ideal = fig["rate"], fig.get("ideal_rate") or 0.0
    if len(fig["per_rank"]) == 1:
        lines = [f"load balance ({fig['strategy']}): one rank, nothing to balance"]
        if ideal:
            lines[0] += (f"; forward and backward took {_share(rate, ideal)} of the step time, "
                         "the optimizer update and the collective the rest")
    else:
        lines = [f"load balance ({fig['strategy']}): imbalance {fig['imbalance']:.3f} "
                 f"(cpu {fig['imbalance_cpu']:.3f}), efficiency {fig['efficiency']:.1%} "
                 f"(cpu {fig['efficiency_cpu']:.1%}), slowest rank {fig['slowest_rank']}"]
        if ideal:
            lines.append(f"  training ran at {_share(rate, ideal)} of the ranks' combined "
                         "compute speed (communication, the optimizer update and waiting for "
                         "slower ranks took the rest); a split of the rows in proportion to "
                         f"the ranks' speeds would reach {_share(fig['attainable_rate'], ideal)}")
    if per_rank:
        lines += [f"  throughput {fig['rate']:.4g} cost/s; {fig.get('fixed_s', 0.0):.3f} s of "
                  "communication + update that no split can shorten",
                  "rank  samples        cost  compute_s  wait_s  comm_s  idle"]
        lines += [f"{d['rank']:>4}  {d['samples']:>7}  {d['cost']:>10.0f}  "
                  f"{d['compute_s']:>9.3f}  {d['wait_s']:>6.3f}  {d['comm_s']:>6.3f}  "
                  f"{d['idle_fraction']:>4.0%}" for d in fig["per_rank"]]
    return "\n".join(lines)
