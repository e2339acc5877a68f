"""Gradient sums that travel during backward: buckets of finished layers reduced while
the layers before them are still being differentiated."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .. import comm as C
from ..errors import setting
from .sync import Buffers, Setup, Sync

WINDOW = 8  # sums in flight at once when they finish during forward


class Overlapped(Sync):
    """Bucketed in-place sums started during backward as a bucket's layers are done (last
    layers first): one fused ``Allreduce``'s sums up to the order of additions. Settings
    (:class:`~mpidp.parallel.modes.OverlappedSettings`, whose help says what each does):
    ``bucket_bytes``, :func:`layer_buckets`' size; ``progress`` ``"test"``
    (:class:`mpidp.comm.StartedSums`) or ``"thread"`` (:class:`mpidp.comm.BackgroundAllreduce`);
    ``finish`` ``"backward"`` or ``"forward"`` (at most ``WINDOW`` sums in flight)."""

    name = "overlapped"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reducer: C.BackgroundAllreduce | None = None
        self.sums: C.StartedSums | None = None  # progress "test": the sums started
        self._completed0 = 0  # the reducer's count of sums when this step's first started
        self._forget()

    def _forget(self) -> None:
        """No sum started or arriving, no update open (made, or a lost rank's sums dropped)."""
        self.stretches: list[_Stretch] = []  # finish "forward": this step's sums, as queued
        self.queue: list[_Stretch] = []  # to start, in order (at most WINDOW in flight)
        self.late: list[_Stretch] = []  # held until the last bucket's parts are queued
        self.apply = None  # the update being applied piece by piece, while sums arrive
        self._whole: list[Callable[[], None]] = []  # called once that update has settled
        self.tail_lo: int | None = None  # the first bucket's tail, started ahead of it
        self.launched = 0  # buckets started this step
        self.sent_to = self._first_lo()  # from here on the next bucket is not started yet
        self._sums = 0  # sums started this step
        self._ends: list[int] = []  # per bucket started: this step's sums up to its last

    def setup(self, s: Setup) -> Buffers:
        self.close()  # set up again: the previous thread's communicator goes
        out = super().setup(s)
        self.buckets = layer_buckets(s.model.layer_ranges, self.buf.size, self.buf.itemsize,
                                self.bucket_bytes)
        self.layer_lo = [lo for lo, _ in s.model.layer_ranges]
        self.sent_to = self._first_lo()
        if self.progress == "thread":
            self.reducer = C.BackgroundAllreduce(s.comm, name="mpidp-overlapped")
        elif self.finish == "forward" and s.comm.size > 2:
            # started at moments that differ between ranks, still arriving between steps:
            # on a communicator of this object's own, never matched with another's sums
            self.sums = C.StartedSums(s.comm, self.buf, private=True)
        else:  # two ranks: point-to-point on the companion, under a tag of their own
            self.sums = C.StartedSums(C.companion(s.comm) if s.comm.size == 2 else s.comm,
                                      self.buf)
        return out

    @property
    def reduced(self) -> int:
        """Buckets of this step whose sums are complete already (finish "backward")."""
        if self.reducer is not None:  # the thread completes the sums in order
            done = self.reducer.completed - self._completed0
            return sum(end <= done for end in self._ends)
        if self.sums is None:
            return 0
        self.sums.advance()
        return sum(all(self.sums.done(i) for i in range(a, b))
                   for a, b in zip([0, *self._ends[:-1]], self._ends))

    def on_layer_done(self) -> Callable[[int], None]:
        def launch(i: int) -> None:
            if self.finish == "forward" and self.tail_lo is None and self.launched == 0 \
                    and self.buckets[0][0] != i:  # the last layer and the loss and counts
                self.tail_lo = self.layer_lo[i]
                self._start(self.tail_lo, self.buckets[0][2])
            if self.launched < len(self.buckets) and self.buckets[self.launched][0] == i:
                self._launch()
            else:
                self._advance()  # between layers: let the started sums move
        return launch

    def on_layer_part(self) -> tuple[Callable[[int, int], None], int] | None:
        if self.comm.size == 1:
            return None
        piece = max(1, self.bucket_bytes // self.buf.itemsize)

        def launch(i: int, done: int) -> None:
            if self.launched < len(self.buckets) and self.buckets[self.launched][0] == i:
                end = min(self.layer_lo[i] + done, self.buckets[self.launched][2])
                if end - self.sent_to >= piece:  # a bucket's worth is final: send it now
                    self._start(self.sent_to, end)
                    self.sent_to = end
            else:
                self._advance()
        return launch, piece

    def _launch(self) -> None:
        """Start the rest of the next bucket (all of it unless parts went ahead)."""
        hi = self._bucket_hi()
        if self.sent_to < hi:
            self._start(self.sent_to, hi)
        self._ends.append(self._sums)
        self.launched += 1
        self.sent_to = hi if self.launched == len(self.buckets) else self.buckets[self.launched][1]
        if self.finish == "forward" and self.launched == len(self.buckets):
            self.queue += sorted(self.late, key=lambda s: s.lo)  # in the order forward reads
            self.late = []
            self._advance()

    def _start(self, lo: int, hi: int) -> None:
        """Start the sum of ``buf[lo:hi]`` (finish "forward": queue it)."""
        if self.finish == "forward":
            blo, bhi = self.buckets[self.launched][1], self._bucket_hi()
            stretch = _Stretch(lo, hi)
            self.stretches.append(stretch)
            held = (self.launched < len(self.buckets) - 1 and hi <= self.n
                    and lo - blo >= (bhi - blo) // 2)
            (self.late if held else self.queue).append(stretch)
            self._advance()
        elif self.reducer is not None:
            if self._sums == 0:  # this step's first sum
                self._completed0 = self.reducer.completed
            self.reducer.submit(self.buf[lo:hi])
        else:
            self.sums.start(lo, hi)
        self._sums += 1

    def _advance(self) -> None:
        """Let the started sums move; start queued ones (up to ``WINDOW`` in flight); apply
        the open update to every part whose sum is complete."""
        if self.sums is None:
            return
        self.sums.advance()
        if self.finish != "forward":
            return
        while self.queue and self.sums.live < WINDOW:
            s = self.queue.pop(0)
            s.index = self.sums.start(s.lo, s.hi)
        if self.apply is not None:
            for s in self.stretches:
                if not s.applied and self._arrived(s):
                    if s.lo < self.n:
                        self.apply(self.buf, s.lo, min(s.hi, self.n))
                    s.applied = True

    def _complete(self, done: Callable[[], bool]) -> None:
        """Advance (waiting on the oldest sum in flight) until ``done()``."""
        self._advance()
        while not done():
            if not self.sums.live:
                raise C.MpidpError("overlapped: a part of the gradient was never started")
            self.sums.wait_any()
            self._advance()

    def _arrived(self, s: _Stretch) -> bool:
        """Stretch ``s``'s sum is complete (as of the last test of the sums in flight)."""
        return s.index is not None and self.sums.done(s.index)

    def _settled(self, s: _Stretch) -> bool:
        """Nothing more to do for ``s``: applied, or complete with no update open."""
        return s.applied or (self.apply is None and self._arrived(s))

    def settle(self) -> None:
        if self.finish != "forward" or not self.stretches:
            return
        self._complete(lambda: all(self._settled(s) for s in self.stretches))
        self.sums.clear()
        self.stretches, self.apply, whole, self._whole = [], None, self._whole, []
        for fn in whole:
            fn()

    def when_whole(self, fn: Callable[[], None]) -> None:
        if self.apply is None:
            fn()
        else:
            self._whole.append(fn)

    def abandon(self) -> None:
        for part in (self.sums, self.reducer):
            if part is not None:
                part.abandon()
        self.sums = self.reducer = None
        self._forget()

    def on_forward(self) -> tuple[Callable[[int, int | None], None], int] | None:
        if self.finish != "forward":
            return None
        ranges = self.model.layer_ranges

        def ready(i: int, upto: int | None) -> None:
            if not self.stretches:
                return
            lo, hi = ranges[i]
            hi = hi if upto is None else min(hi, lo + upto)
            if lo < hi:
                self._complete(lambda: all(self._settled(s) for s in self.stretches
                                           if s.lo < hi and s.hi > lo))
        # the same parts every step, arrived or not: the sums do not depend on timing
        return ready, max(1, self.bucket_bytes // self.buf.itemsize)

    def refuses_run(self, optimizer, on_nonfinite: str) -> str | None:
        if self.finish != "forward":
            return None
        head = (f"overlapped sums that finish during forward ({setting('finish', 'forward')}) "
                "update each part as it arrives")
        if why := optimizer.refuses_pieces():
            return f"{head}, but {why}: use {setting('finish', 'backward')}"
        if on_nonfinite != "ignore":
            return (f"{head}, before the whole gradient can be judged, so on_nonfinite "
                    f"{on_nonfinite!r} cannot hold: use {setting('on_nonfinite', 'ignore')} "
                    f"or {setting('finish', 'backward')}")
        return None

    def update(self, optimizer, count: int) -> None:
        if self.finish != "forward":
            return super().update(optimizer, count)
        with self.timer.compute():
            self.apply = optimizer.update_in_pieces_(self.model.params, 1.0 / count)
            self._advance()

    def reduce(self) -> None:
        while self.launched < len(self.buckets):
            self._launch()
        self.launched, self._sums, self._ends, self.tail_lo = 0, 0, [], None
        self.sent_to = self._first_lo()
        if self.finish == "forward":  # wait only for the sum holding the loss and counts
            self._complete(lambda: all(self._arrived(s) for s in self.stretches if s.hi > self.n))
        elif self.reducer is not None:
            self.reducer.wait()
        else:
            self.sums.wait_all()
            self.sums.clear()
        self.bytes_sent += self.buf.nbytes

    def _bucket_hi(self) -> int:
        """Where the bucket being started ends: before the tail that went ahead of it."""
        tail = self.launched == 0 and self.tail_lo is not None
        return self.tail_lo if tail else self.buckets[self.launched][2]

    def _first_lo(self) -> int:
        """Where the first bucket starts (0 before setup or with no buckets)."""
        buckets = getattr(self, "buckets", None)
        return buckets[0][1] if buckets else 0

    def at_boundary(self) -> bool:
        in_flight = self.finish != "forward" and (  # "forward": a checkpoint settles them
            (self.sums is not None and self.sums.live > 0)
            or (self.reducer is not None and self.reducer.pending > 0))
        return self.launched == 0 and not in_flight and self.sent_to == self._first_lo()

    def close(self) -> None:
        """Complete the sums still arriving; end the communication thread. Collective."""
        self.settle()
        if self.sums is not None and not self.sums.live:
            self.sums.close()
            self.sums = None
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None


@dataclass(slots=True, eq=False)
class _Stretch:
    """One sum of ``buf[lo:hi]`` (finish "forward"): ``index`` among the started sums once
    started, ``applied`` once the open update has used it."""

    lo: int
    hi: int
    index: int | None = None
    applied: bool = False


def layer_buckets(ranges: list[tuple[int, int]], size: int, itemsize: int,
             bucket_bytes: int) -> list[tuple[int, int, int]]:
    """``(layer, lo, hi)`` per bucket, last layers first: whole layers (``ranges``: their
    ``[lo, hi)`` in a buffer of ``size`` items of ``itemsize`` bytes) until a bucket holds
    ``bucket_bytes``; the first reaches to the buffer's end, the last starts at 0."""
    out, hi, nbytes = [], size, 0
    for i in range(len(ranges) - 1, -1, -1):
        lo = ranges[i][0]
        nbytes += (ranges[i][1] - lo) * itemsize
        if (nbytes >= bucket_bytes or i == 0) and lo < hi:
            out.append((i, lo, hi))
            hi, nbytes = lo, 0
    return out
