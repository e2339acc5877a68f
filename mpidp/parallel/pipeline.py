"""Pipeline (model) parallelism: consecutive layers on consecutive ranks, micro-batched.
Rank ``r`` is stage ``r % S`` of replica ``r // S``; the replicas of a stage (hybrid) sum
gradients with one ``Allreduce`` per step (docs/design.md#pipeline-and-hybrid)."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from .. import comm as C
from ..digest import dtype_name, settings_of
from ..nn import Layer, Loss, Optimizer, Sequential
from ..nn.layers import layer_spec
from ..nn.optim import Segments
from ..observe.metrics import StepTimer
from ..run import checkpoint as ckpt
from ..run.nonfinite import Policy, all_finite
from ..run.stats import StepStats
from . import buffer
from . import stages as St
from .data_parallel import STATE_RULE, TrainerBase, out_of_sync
from .evaluation import global_sums, n_correct, score_sums
from .modes import refuses_model

_TAG_F, _TAG_B = 21, 22  # activations forward, gradients backward (order kept per tag)


@dataclass
class PipeCounters:
    """Per-rank figures since the last :meth:`reset`: messages and bytes, every op (tracing), and
    the peak bytes cached for backward (``peak_activation_bytes``: with outputs being sent)."""

    p2p_bytes: int = 0
    p2p_messages: int = 0
    allreduce_bytes: int = 0
    peak_cached_bytes: int = 0
    peak_activation_bytes: int = 0
    trace: list[tuple[str, int, float, float, float]] = field(default_factory=list)

    def reset(self) -> None:
        self.p2p_bytes = self.p2p_messages = self.allreduce_bytes = 0
        self.peak_cached_bytes = self.peak_activation_bytes = 0
        self.trace.clear()


class Pipeline(TrainerBase):
    """Train ``layers`` (input width ``n_in``) as a pipeline of ``n_stages`` stages over ``comm``.
    Collective, with the same arguments on every rank (bad ones raise on every rank).

    layers : the whole model's layers, unbound, alike on every rank; only this rank's
        stage is allocated (``self.model``).
    n_stages : stages per pipeline (default ``comm.size``), a divisor of ``comm.size``.
    micro_batches : micro-batches per batch (sizes differing by at most one).
    schedule : ``"gpipe"`` (all forwards, then all backwards) or ``"1f1b"``.
    balance : stage split by ``"params"`` or ``"time"`` (measured on rank 0); or ``costs``.
    trace : record every op's start, end and CPU seconds in ``counters.trace``.
    on_nonfinite : as :class:`~mpidp.DataParallel`'s, one verdict for all stages.
    """

    def __init__(self, layers: Sequence[Layer], n_in: int, optimizer: Optimizer, loss: Loss,
                 comm: C.Comm | None = None, *, n_stages: int | None = None,
                 micro_batches: int = 1, schedule: str = "1f1b",
                 dtype: npt.DTypeLike = np.float32, balance: str = "params",
                 costs: Sequence[float] | None = None, abort_on_error: bool = True,
                 trace: bool = False, on_nonfinite: str = "stop") -> None:
        comm = comm if comm is not None else C.world()
        C.agree_same(comm, "Pipeline", {  # before any collective that could then hang
            "layers": [layer_spec(layer) for layer in layers], "n_in": n_in,
            "optimizer": settings_of(optimizer), "loss": settings_of(loss),
            "n_stages": n_stages, "micro_batches": micro_batches, "schedule": schedule,
            "dtype": dtype_name(dtype), "balance": balance, "costs": costs,
            "on_nonfinite": on_nonfinite, "trace": trace})
        n_stages = comm.size if n_stages is None else int(n_stages)
        dtype = np.dtype(dtype)
        if refused := refuses_model(layers, "pipeline"):
            raise C.MpidpError(refused)
        if balance == "time" and costs is None:
            costs = C.root_decides(comm, St.measure_costs, layers, n_in, dtype=dtype)
        self.plan = C.run_agreed(comm, St.plan_stages, layers, n_in, n_stages, comm.size,
                                 micro_batches, schedule, balance, costs)
        seen = C.allgather_counts(comm, self.plan.fingerprint(micro_batches, dtype.num,
                                                              St.SCHEDULES.index(schedule)))
        if len(set(seen.tolist())) > 1:
            raise C.MpidpError("ranks disagree on the pipeline (layers, widths, stage split, "
                               "micro-batches, schedule or dtype): pass the same on every rank")
        if abort_on_error:
            C.install_abort_hook()
        self.n_stages, self.n_replicas = n_stages, comm.size // n_stages
        self.stage, self.replica = comm.rank % n_stages, comm.rank // n_stages
        self.pipe = C.split(comm, self.replica, self.stage)  # one replica's stages
        self.dp = C.split(comm, self.stage, self.replica)  # this stage in every replica
        self.world, self.optimizer, self.loss = comm, optimizer, loss
        self.micro_batches, self.schedule = micro_batches, schedule
        self.lo, self.hi = self.plan.bounds[self.stage], self.plan.bounds[self.stage + 1]
        self.layers = list(layers)
        self.model = Sequential(self.layers[self.lo:self.hi], self.plan.shapes[self.lo], dtype)
        # whole tensors' norms: this stage's partials summed over the stages (replicas hold
        # equal copies of their stage after the gradient Allreduce, so not over them)
        optimizer.place(Segments.of(self.layers), self.param_offset,
                        None if n_stages == 1 else lambda a: C.allreduce_sum_(self.pipe, a))
        self.policy = Policy(on_nonfinite)
        self.stop_requested: bool | None = None  # this rank asks to stop (set by the loop)
        self._buf = buffer.new(self.model.n_params, dtype)
        self.model.use_grad_buffer(self._buf)
        self.ops = St.schedule(schedule, n_stages, self.stage, micro_batches)
        self.n_slots = St.max_in_flight(self.ops)
        self.first, self.last = self.stage == 0, self.stage == n_stages - 1
        self.timer, self.counters, self.tracing = StepTimer(), PipeCounters(), trace
        self.global_step = 0

    # --- parameters -------------------------------------------------------------------

    @property
    def param_offset(self) -> int:
        """Where this stage's parameters start in the whole model's flat parameter vector."""
        return int(sum(self.plan.n_params[:self.lo]))

    def init_(self, rng: np.random.Generator | int) -> Pipeline:
        """Initialise this stage exactly as ``Sequential(layers).init_(rng)`` would (earlier
        stages' draws go to scratch layers). Collective."""
        rng = np.random.default_rng(rng)  # a Generator is returned as it is
        for layer in self.layers[:self.lo]:
            scratch = copy.copy(layer)
            scratch.bind({k: np.empty(s, self.model.dtype)
                          for k, s in layer.param_shapes().items()}, {})
            scratch.init_(rng)
        for layer in self.model.layers:
            layer.init_(rng)
        C.bcast_(self.dp, self.model.params, 0)  # replicas start bit-identical
        return self

    def gather_params(self, root: int = 0) -> np.ndarray | None:
        """The whole model's flat parameters on stage ``root`` of each replica. Collective."""
        return C.gatherv(self.pipe, self.model.params, root)

    def in_sync(self) -> bool:
        """True on every rank iff every stage is bit-identical across replicas. Collective."""
        return not C.allreduce_max(self.world, [out_of_sync(self.dp, self.model) is not None])[0]

    def check_replicas(self) -> None:
        """Raise :class:`mpidp.MpidpError` on every rank, naming the ranks whose stage
        differs from replica 0's. Collective."""
        if self.in_sync():
            return
        S = self.n_stages  # world rank r holds stage r % S; replica 0's copy is rank r % S
        for what, held, why in (("parameters differ", self.model.params, "replicas are out of sync"),
                                ("layer state differs", self.model.state, STATE_RULE)):
            hashes = C.allgather_counts(self.world, C.checksum(held))
            bad = [r for r in range(self.world.size) if hashes[r] != hashes[r % S]]
            if bad:
                raise C.MpidpError(f"{what} from replica 0's on ranks {bad}: {why}")

    def epoch_totals(self, totals: np.ndarray) -> np.ndarray:
        """The last stage's ``(loss, count, correct)`` sums on every rank. Collective."""
        return C.bcast_(self.pipe, totals, self.n_stages - 1)

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds: parameters, gradients, optimizer state, peak activations."""
        return {"param_bytes": int(self.model.params.nbytes), "grad_bytes": int(self._buf.nbytes),
                "optimizer_bytes": sum(int(a.nbytes) for a in self.optimizer.state.values()),
                "activation_bytes": int(self.counters.peak_activation_bytes)}

    # --- one step ---------------------------------------------------------------------

    def step(self, X: np.ndarray | None, y: np.ndarray | None, n: int | None = None,
             last_of_epoch: bool = False) -> StepStats:
        """One step on this replica's batch of ``n`` samples (``X`` on the first stage, ``y`` on
        the last). Collective. ``loss_sum`` and ``correct``: the last stage's (NaN, 0 elsewhere)."""
        n = _batch_len(X, y, n)
        sizes = St.micro_batch_sizes(n, self.micro_batches)  # same check on every stage
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self._run = _StepState(X, y, sizes, starts, [None] * self.n_slots)
        self.model.grads[...] = 0
        t_step = time.perf_counter()
        for kind, i in self.ops:
            (self._forward if kind == "F" else self._backward)(i)
        with self.timer.communicate("wait for sends"):
            C.wait_all([r for reqs, _ in self._run.sends for r in reqs])
        buf, k = self._buf, self.model.n_params
        buffer.put(buf, k, self._run.loss_sum, n, self._run.correct, False)  # stop: _agree
        if self._poison:  # fault injection: this stage's gradient contribution is NaN
            buf[0], self._poison = np.nan, False
        if self.n_replicas > 1:
            with self.timer.communicate("allreduce", bytes=int(buf.nbytes)):
                C.allreduce_sum_(self.dp, buf)
            self.counters.allreduce_bytes += buf.nbytes
        loss_sum, count, correct = buffer.totals(buf, k)
        loss_sum = loss_sum if self.last else float("nan")  # only the last stage has a loss
        finite, stop = self._agree(buf)
        skipped = count > 0 and not self.policy.apply(finite, loss_sum, self.global_step)
        with self.timer.compute(local=False):
            if count and not skipped:
                self.optimizer.step_(self.model.params, self.model.grads, scale=1.0 / count)
        if self.tracing:
            self.counters.trace.append(("step", -1, t_step, time.perf_counter(), 0.0))
        self.timer.end_step(n)
        self.global_step += 1
        return StepStats(loss_sum, count, correct if self.last else 0, skipped, stop)

    def _agree(self, buf: np.ndarray) -> tuple[bool, bool]:
        """``(finite, stop)`` alike on every rank: every stage's sums finite; some rank asked
        to stop. Collective (one ``Allreduce``) unless there is nothing to agree on."""
        if not self.policy.checks and self.stop_requested is None:
            return True, False
        k = self.model.n_params
        mine = not self.policy.checks or (
            all_finite(buf[:k]) and (not self.last or all_finite(buf[k:])))
        flags = np.array([int(not mine), int(bool(self.stop_requested))], np.int32)
        C.allreduce_(self.world, flags, "max")
        return not flags[0], bool(flags[1])

    def _slot(self) -> list[Layer]:
        """Shallow copies of this stage's layers: a micro-batch's own activation caches."""
        return [copy.copy(layer) for layer in self.model.layers]

    def _forward(self, i: int) -> None:
        run = self._run
        lo, size = int(run.starts[i]), int(run.sizes[i])
        x = run.X[lo:lo + size] if self.first else np.empty(
            (size, *self.plan.shapes[self.lo]), self.model.dtype)
        self._exchange(None if self.first else x, self.stage - 1, _TAG_F)
        slot = run.slots[i % self.n_slots] = self._slot()
        t, cpu = time.perf_counter(), time.process_time()
        with self.timer.compute("forward", local=True, micro_batch=i, stage=self.stage):
            for layer in slot:
                x = layer.forward(x)
            if self.last:
                yb = run.y[lo:lo + size]
                run.loss_sum += self.loss.forward(x, yb)
                run.correct += n_correct(self.loss, x, yb)
                run.dy[i] = self.loss.backward()
        self._trace("F", i, t, cpu)
        if not self.last:
            self._send(x, self.stage + 1, _TAG_F)
        run.alive[i] = St.held_bytes(slot, run.X) + (run.dy[i].nbytes if self.last else 0)
        self._note_memory()

    def _backward(self, i: int) -> None:
        run = self._run
        dy = run.dy.pop(i) if self.last else np.empty(
            (int(run.sizes[i]), *self.plan.shapes[self.hi]), self.model.dtype)
        self._exchange(None if self.last else dy, self.stage + 1, _TAG_B)
        slot = run.slots[i % self.n_slots]
        t, cpu = time.perf_counter(), time.process_time()
        with self.timer.compute("backward", local=True, micro_batch=i, stage=self.stage):
            for j, layer in enumerate(reversed(slot)):  # the model's input needs no gradient
                dy = layer.backward(dy, accumulate=True,
                                    need_input_grad=not self.first or j < len(slot) - 1)
        self._trace("B", i, t, cpu)
        run.slots[i % self.n_slots] = None  # drop this micro-batch's activations
        run.alive.pop(i)
        if not self.first:
            self._send(dy, self.stage - 1, _TAG_B)

    def _send(self, buf: np.ndarray, dest: int, tag: int) -> None:
        buf = np.ascontiguousarray(buf)
        with self.timer.communicate("send", bytes=int(buf.nbytes), to=dest):
            self._run.sends.append((C.isend(self.pipe, buf, dest, tag), buf))
        self.counters.p2p_bytes += buf.nbytes
        self.counters.p2p_messages += 1

    def _exchange(self, buf: np.ndarray | None, source: int, tag: int) -> None:
        """Receive this op's input into ``buf`` (None: none); drop the sends done (the step
        waits for the rest at its end, so that stages keep their own pace)."""
        run = self._run
        with self.timer.communicate("receive" if buf is not None else "test sends"):
            run.sends = [(reqs, b) for reqs, b in run.sends if not C.test_all(reqs)]
            if buf is not None:
                C.wait_all(C.irecv(self.pipe, buf, source, tag))

    def _note_memory(self) -> None:
        run, c = self._run, self.counters
        cached = sum(run.alive.values())
        c.peak_cached_bytes = max(c.peak_cached_bytes, cached)
        c.peak_activation_bytes = max(c.peak_activation_bytes,
                                      cached + sum(b.nbytes for _, b in run.sends))

    def _trace(self, kind: str, i: int, t: float, cpu: float) -> None:
        if self.tracing:
            self.counters.trace.append((kind, i, t, time.perf_counter(), time.process_time() - cpu))

    # --- checkpoints (the same file data-parallel training writes) --------------------

    def save_checkpoint(self, directory: str, state: ckpt.State, keep: int,
                        run_id: str | None = None) -> None:
        """Write replica 0's whole model and optimizer state on world rank 0 as the file
        data-parallel training writes (any shape resumes it). Collective."""
        params, opt = None, {}
        if self.replica == 0:
            state.totals = self.epoch_totals(np.array(state.totals, np.float64)).tolist()
            params = C.gatherv(self.pipe, self.model.params, 0)
            opt = {k: C.gatherv(self.pipe, v, 0) for k, v in sorted(self.optimizer.state.items())}
        whole = copy.copy(self.optimizer)  # this stage's type and step, the whole state
        whole.state = opt
        C.root_decides(self.world, ckpt.save_flat, directory, params, whole, state, keep, run_id=run_id)

    def restore(self, directory: str) -> tuple[str, ckpt.State] | None:
        """Load the newest good checkpoint in ``directory`` (of any shape, or of data-parallel
        training): each stage receives its slice. Collective. ``(path, state)``, or None."""
        n_total, dtype = int(sum(self.plan.n_params)), self.model.dtype
        held: dict = {}

        def load_on_root():
            if (found := ckpt.read_latest(directory)) is None:  # none, or no folder
                return None
            path, meta, arrays = found
            # read_latest checked that each optimizer state is one value per parameter
            ckpt.check_fits(path, meta, n_total, dtype, self.optimizer)
            held["arrays"] = arrays
            return path, meta

        if (found := C.root_decides(self.world, load_on_root)) is None:
            return None
        path, meta = found
        arrays, b = held.pop("arrays", {}), self.plan.bounds
        counts = [int(sum(self.plan.n_params[lo:hi])) for lo, hi in zip(b[:-1], b[1:])]

        def my_slice(key: str) -> np.ndarray:  # replica 0's stages receive it, then copy it
            part = (C.scatterv_rows(self.pipe, arrays.get(key), counts, (), dtype)
                    if self.replica == 0 else np.empty(counts[self.stage], dtype))
            return C.bcast_(self.dp, part, 0)

        self.model.params[...] = my_slice("params")
        self.optimizer.state = {k: my_slice(f"opt.{k}") for k in sorted(meta["optimizer"]["state"])}
        self.optimizer.t = meta["optimizer"]["t"]
        state = ckpt.state_of(meta)
        if state.best is not None and self.world.rank == 0:
            state.best["file"] = arrays["best"].tobytes()
        self.global_step = state.global_step
        return path, state

    # --- evaluation -------------------------------------------------------------------

    def evaluate(self, X: np.ndarray | None, y: np.ndarray | None, n: int | None = None,
                 batch_size: int = 4096) -> StepStats:
        """Loss and scores over every replica's ``n`` samples, alike on every rank. Collective."""
        n = _batch_len(X, y, n)
        total = np.zeros(3, np.float64)
        sums = score_sums(self.world, self.loss, y if self.last else None, self.plan.widths[-1])
        for lo in range(0, n, batch_size):
            size = min(batch_size, n - lo)
            x = X[lo:lo + size] if self.first else C.recv_(self.pipe, np.empty(
                (size, *self.plan.shapes[self.lo]), self.model.dtype), self.stage - 1, _TAG_F)
            for layer in self._slot():
                x = layer.forward(x)
            if self.last:
                yb = y[lo:lo + size]
                total += (self.loss.forward(x, yb), size, n_correct(self.loss, x, yb))
                sums.add(x, yb)
            else:
                C.wait_all(C.isend(self.pipe, np.ascontiguousarray(x), self.stage + 1, _TAG_F))
        total, vector = global_sums(self.dp, total, sums)  # over the replicas
        both = C.bcast_(self.pipe, np.concatenate([total, vector]), self.n_stages - 1)
        return StepStats(float(both[0]), int(both[1]), int(both[2]), scores=sums.scores(both[3:]))


@dataclass
class _StepState:
    """What one step keeps between its ops."""

    X: np.ndarray | None
    y: np.ndarray | None
    sizes: np.ndarray
    starts: np.ndarray
    slots: list
    dy: dict = field(default_factory=dict)
    alive: dict = field(default_factory=dict)
    sends: list = field(default_factory=list)
    loss_sum: float = 0.0
    correct: int = 0


def _batch_len(X, y, n) -> int:
    if X is not None or y is not None:
        return len(X if X is not None else y)
    if n is None:
        raise ValueError("pass X, y or the batch length n")
    return int(n)
