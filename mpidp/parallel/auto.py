"""The ``auto`` exchange: the fastest gradient exchange for this model on this network,
measured on the first training steps (docs/design.md#synchronisation-strategies).

After :data:`WARMUP` allreduce steps the candidates train :data:`TRIALS` steps each, in
turns; those within :data:`CLOSE` of the fastest run off, and the slowest rank's median
step time decides, alike on every rank. The choice (not checkpointed) and its figures
are in :attr:`Auto.report`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from time import perf_counter

import numpy as np

from .. import comm as C
from ..errors import setting
from .compress import FLOAT16_MAX, Compressed, Float16Overflow
from .modes import refuses_model
from .overlap import Overlapped, layer_buckets
from .sync import Buffers, Exchanged, Round, Setup, Sync

WARMUP = 2  # allreduce steps before the trials: first steps pay page faults and caches
TRIALS = 4  # steps per candidate, taken in turns; the median counts
CLOSE = 0.10  # candidates this near the fastest median (a share of it) run off


def _to_current(name: str) -> Callable:
    """A method of :class:`Auto` that calls the same method of the strategy in use."""
    return lambda self, *args: getattr(self.current, name)(*args)


class Auto(Sync):
    """Tries the candidates on the first steps, then delegates to the fastest; its settings
    are the candidates' (``codec`` None: bfloat16 and int8)."""

    name = "auto"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.choice: Sync | None = None  # the committed strategy
        self.report = ""

    def setup(self, s: Setup) -> Buffers:
        self.comm, self.root, self.model, self.timer = s.comm, s.root, s.model, s.timer
        self.n = s.model.n_params
        plain = Sync(self.node_aware)
        out = plain.setup(s)  # node-aware where it pays; its buffer is everyone's
        self.buf = out.grads
        offered: list[tuple[str, Sync]] = [("allreduce", plain)]
        if s.comm.size > 1:
            by_layout: dict[tuple, int] = {}  # the same buckets: the same strategy, tried once
            for size in sorted({self.bucket_bytes, max(1 << 16, self.n * self.buf.itemsize // 4)}):
                by_layout.setdefault(tuple(layer_buckets(s.model.layer_ranges, self.buf.size,
                                                         self.buf.itemsize, size)), size)
            offered += [(f"overlapped ({size / 2**20:.2g} MiB buckets)",
                         Overlapped(size, progress=self.progress)) for size in by_layout.values()]
            if s.model.dtype == np.float32:
                offered += [(f"compressed ({codec})", Compressed(codec, bucket_bytes=self.bucket_bytes))
                            for codec in ((self.codec,) if self.codec else ("bfloat16", "int8"))]
        # a candidate that refuses the model is not tried (a refusal depends on it alone)
        kept = offered[:1] + [(label, c) for label, c in offered[1:] if c.refuses(s.model) is None]
        shared = Setup(s.comm, s.root, s.model, s.timer, grads=self.buf)
        for _, c in kept[1:]:
            c.setup(shared)
        self.labels, self.candidates = [label for label, _ in kept], [c for _, c in kept]
        self.comm_s: list[float] = []  # the allreduce trials' exchange times
        self.times: list[list[float]] = [[] for _ in self.candidates]
        self.steps, self._t0, self._last = 0, None, False
        self.finalists: list[int] | None = None  # the run-off's candidates, once known
        self.dropped: dict[int, int] = {}  # candidate -> the step it overflowed float16 at
        if len(self.candidates) == 1:
            self.choice = plain
            self.report = "auto: allreduce (one rank: nothing to exchange)"
        self.current = plain
        return out

    def describe(self) -> str | None:
        head = (self.report if len(self.candidates) == 1
                else f"auto: trying {', '.join(self.labels)}")
        return "; ".join(filter(None, [head, self.candidates[0].describe()]))

    def undecided(self) -> str | None:
        """Why there is no choice yet (a run that ended during the trials); None once chosen."""
        if self.choice is not None:
            return None
        return (f"auto: no choice: the run ended after {self.steps} step(s), before the "
                f"trials of {', '.join(self.labels)} (in turns from step {WARMUP + 1}) could end; "
                f"they need {WARMUP + TRIALS * len(self.labels)} steps or more, so train longer for a choice")

    def refuses(self, model) -> str | None:
        """What a fused allreduce refuses (other candidates that refuse are not tried); a
        codec asked for with a model that is not float32."""
        if self.codec is not None and model.dtype != np.float32:
            return (f"auto with {setting('codec', self.codec)}: auto tries compression "
                    f"for float32 models only, and this model is "
                    f"{np.dtype(model.dtype).name}; leave the codec out")
        return refuses_model(model.layers, "allreduce")

    def _forwarder(self, hooks: dict[int, Callable | None]) -> Callable:
        """A hook calling the one of the strategy in use (``hooks``: by its ``id``), if any."""
        def forward(*args) -> None:
            if (hook := hooks.get(id(self.current))) is not None:
                hook(*args)
        return forward

    def on_layer_done(self) -> Callable[[int], None]:
        return self._forwarder({id(c): c.on_layer_done() for c in getattr(self, "candidates", ())})

    def on_layer_part(self) -> tuple[Callable[[int, int], None], int] | None:
        parts = {id(c): c.on_layer_part() or (None, 0) for c in getattr(self, "candidates", ())}
        pieces = [piece for hook, piece in parts.values() if hook is not None]
        if not pieces:
            return None
        return self._forwarder({i: hook for i, (hook, _) in parts.items()}), min(pieces)

    def _trial(self) -> int | None:
        """Index of the candidate that runs trial step ``self.steps``, or None (none runs)."""
        k = self.steps - WARMUP  # in turns, so that drift of the machine hits all alike
        first = TRIALS * len(self.candidates)
        if k < 0:
            return None
        if k < first:
            return k % len(self.candidates)
        j, run_off = k - first, self.finalists or []
        return run_off[j % len(run_off)] if j < TRIALS * len(run_off) else None

    def exchange(self, r: Round) -> Exchanged:
        self._last = r.last_of_epoch
        t = perf_counter()
        try:
            out = self.current.exchange(r)
        except Float16Overflow:  # on every rank, the gradients untouched: another way
            self._drop(r.step)
            out = self.current.exchange(r)
        if self.choice is None and self._trial() == 0:
            self.comm_s.append(perf_counter() - t)
        return out

    def _drop(self, step: int) -> None:
        """The current candidate overflowed float16 at ``step``: allreduce takes over."""
        i = self.candidates.index(self.current)
        self.dropped[i] = step
        self.current = self.candidates[0]
        if self.choice is not None:
            self.choice = self.current
            self.report += (f"; then {self.labels[i]} overflowed at step {step} (a gradient "
                            f"beyond {FLOAT16_MAX:g}): allreduce from that step on")
            if self.comm.rank == self.root:
                print(f"mpidp: auto: {self.labels[i]} overflowed at step {step}; allreduce "
                      "from now on", file=sys.stderr, flush=True)
        self.candidates[i].close()

    # what the strategy in use does
    update, at_boundary, before_checkpoint, after_checkpoint, after_restore = (
        _to_current(name) for name in ("update", "at_boundary", "before_checkpoint",
                                       "after_checkpoint", "after_restore"))

    @property
    def bytes_sent(self) -> int:
        return sum(c.bytes_sent for c in getattr(self, "candidates", ()))

    @bytes_sent.setter
    def bytes_sent(self, value: int) -> None:
        pass  # the candidates count their own

    def step_done(self) -> None:
        """Times the step and picks the next one's strategy. Collective when trials end."""
        now = perf_counter()
        if self.choice is None:
            k = self._trial()
            timed = k is not None and k not in self.dropped and self._t0 is not None
            if timed and not self._last:  # an epoch's last step is short: not timed
                self.times[k].append(now - self._t0)
            self.steps += 1
            nxt = self._trial()
            if nxt is None and self.steps > WARMUP and self.finalists is None:
                medians, _ = self._medians()
                best = float(np.min(medians))
                self.finalists = [i for i, t in enumerate(medians)
                                  if np.isfinite(t) and t <= best * (1 + CLOSE)]
                if len(self.finalists) < 2:
                    self.finalists = []  # a clear winner, or nothing timed to run off
                nxt = self._trial()
            if nxt is None and self.steps > WARMUP:
                self._decide()
            else:  # a dropped candidate's turns: allreduce, not timed
                self.current = self.candidates[0 if nxt is None or nxt in self.dropped else nxt]
        self._t0 = None  # a step is timed from its :meth:`step_begins`

    def step_begins(self) -> None:
        """Starts the step's clock (what runs between steps is not timed)."""
        self._t0 = perf_counter()

    def _medians(self) -> tuple[np.ndarray, float]:
        """The slowest rank's median step seconds per candidate, and of the allreduce
        trials' exchange. Collective."""
        medians = np.array([np.median(t) if t else np.inf for t in self.times]
                           + [np.median(self.comm_s) if self.comm_s else 0.0], np.float64)
        C.allreduce_(self.comm, medians, "max")  # the slowest rank's view decides
        medians[list(self.dropped)] = np.inf  # never chosen, never in a run-off
        return medians[:-1], float(medians[-1])

    def _decide(self) -> None:
        medians, comm_s = self._medians()
        among = self.finalists or list(range(len(medians)))  # a run-off decides among its own
        best = among[int(np.argmin(medians[among]))]
        self.choice = self.current = self.candidates[best]
        for i, c in enumerate(self.candidates):
            if i != best:
                c.close()
        rates = ", ".join(f"{label} {1 / t:.3g}" for label, t in zip(self.labels, medians)
                          if np.isfinite(t) and t > 0)
        P, m = self.comm.size, self.buf.nbytes
        link = (f"; an allreduce of {m / 1e6:.3g} MB took {comm_s * 1e3:.3g} ms, "
                f"{2 * (P - 1) / P * m / comm_s / 1e6:.3g} MB/s per rank") if comm_s > 0 else ""
        end = WARMUP + TRIALS * len(self.candidates)
        names = [self.labels[i] for i in self.finalists or ()]
        run_off = (f", then of {', '.join(names[:-1])} and {names[-1]} (within {CLOSE:.0%}) "
                   f"on steps {end + 1}-{end + TRIALS * len(names)}" if names else "")
        untimed = [label for i, (label, t) in enumerate(zip(self.labels, medians))
                   if not np.isfinite(t) and i not in self.dropped]
        dropped = "".join(f"; {self.labels[i]} overflowed at step {step} (a gradient beyond "
                          f"{FLOAT16_MAX:g}): dropped" for i, step in self.dropped.items())
        if len(untimed) + len(self.dropped) == len(self.labels):
            self.report = (f"auto: {self.labels[best]}, as no trial step could be timed (each "
                           "was an epoch's last step: too few steps per epoch)")
        else:
            self.report = (f"auto: {self.labels[best]}, the fastest on steps {WARMUP + 1}-{end}"
                           f"{run_off} (steps/s: {rates}{link})"
                           + (f"; not timed (each trial step an epoch's last): "
                              f"{', '.join(untimed)}" if untimed else "")) + dropped
        if self.comm.rank == self.root:
            print(f"mpidp: {self.report}", file=sys.stderr, flush=True)

    def close(self) -> None:
        for c in getattr(self, "candidates", ()):
            c.close()

    def free(self) -> None:
        for c in getattr(self, "candidates", ()):  # the first one's buffer is everyone's
            c.free()
