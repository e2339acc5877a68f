"""Gradient sums that travel during backward: buckets of finished layers reduced while
the layers before them are still being differentiated."""

from __future__ import annotations

from collections.abc import Callable

from .. import comm as C
from .sync import Buffers, Setup, Sync

PROGRESS = ("test", "thread")


class Overlapped(Sync):
    """Bucketed in-place sums started during backward, as soon as a bucket's layers are
    done (last layers first); all are complete before the update. The same sums as one
    fused ``Allreduce`` up to the order of floating-point additions.

    Parameters
    ----------
    bucket_bytes : a bucket closes once its layers hold at least this many bytes of
        gradients (whole layers; the first bucket also carries the loss and counts). A
        size beyond the whole gradient makes one bucket, started when backward ends: the
        fused allreduce, for links where overlap does not pay.
    progress : how the started sums move while backward computes. ``"test"`` (the
        default): an ``Iallreduce`` per bucket, advanced by ``MPI_Testsome`` at every
        layer boundary of backward; between boundaries the operating system still moves
        what MPI has handed to it (socket buffers over TCP). ``"thread"``: a
        communication thread runs one blocking ``Allreduce`` per bucket
        (:class:`mpidp.comm.BackgroundAllreduce`), so a bucket also moves during one
        long layer, at the cost of a core polling in MPI meanwhile; it needs
        ``MPI_THREAD_MULTIPLE``.

    Notes
    -----
    Buckets are ``(layer, lo, hi)`` in launch order: bucket ``k`` starts when backward has
    finished ``layer`` and sums ``buf[lo:hi]``. A layer that announces its gradient in
    parts (a ``Dense`` larger than ``bucket_bytes``, ``on_layer_part``) starts its bucket
    in parts: a sum of each stretch of at least ``bucket_bytes`` that is final, and one
    of the bucket's rest when the layer is done. A bucket not started by a backward hook
    (a trainer that passes none) is started by :meth:`reduce`, so every element is summed
    exactly once per step. Nothing is in flight between steps: the thread, if any, lives
    from a step's first bucket to its :meth:`reduce`.

    What overlap can hide is bounded by the model: a bucket starts only when its layers'
    gradients are final, and the first layer's are final only when backward ends, so
    forward, the backward of the last layers before the first large bucket, and the first
    layer's transfer are never hidden. Communication also costs CPU time (copies, the
    operating system's network stack), which overlap takes from the computation when the
    cores are all busy: on a fast link that can cost more than it hides.
    """

    name = "overlapped"

    def __init__(self, bucket_bytes: int = 1 << 20, progress: str = "test") -> None:
        super().__init__()
        if bucket_bytes <= 0:
            raise C.MpidpError(f"bucket size must be > 0 bytes, got {bucket_bytes}")
        if progress not in PROGRESS:
            raise C.MpidpError(f"unknown overlap progress {progress!r}; expected one of {PROGRESS}")
        self.bucket_bytes, self.progress = int(bucket_bytes), progress
        self.reducer: C.BackgroundAllreduce | None = None
        self.requests: list = []
        self.launched = 0  # buckets started this step
        self.sent_to = 0  # the next bucket's values from here on are not started yet
        self._completed0 = 0  # the reducer's count of sums when this step's first started
        self._sums = 0  # sums started this step
        self._ends: list[int] = []  # per bucket started: this step's sums up to its last

    def setup(self, s: Setup) -> Buffers:
        self.close()  # set up again: the previous thread's communicator goes
        out = super().setup(s)
        self.buckets = layer_buckets(s.model.layer_ranges, self.buf.size, self.buf.itemsize,
                                self.bucket_bytes)
        self.starts = {layer: (lo, hi) for layer, lo, hi in self.buckets}
        self.layer_lo = [lo for lo, _ in s.model.layer_ranges]
        self.sent_to = self._first_lo()
        if self.progress == "thread":
            self.reducer = C.BackgroundAllreduce(s.comm, name="mpidp-overlapped")
        return out

    @property
    def reduced(self) -> int:
        """Buckets of this step whose sums (all of its parts) are complete already
        (instrumentation)."""
        starts = [0, *self._ends[:-1]]
        if self.reducer is not None:  # the thread completes the sums in order
            done = self.reducer.completed - self._completed0
            return sum(end <= done for end in self._ends)
        C.test_some(self.requests)
        free = [r == C.MPI_REQUEST_NULL for r in self.requests]
        return sum(all(free[a:b]) for a, b in zip(starts, self._ends))

    def on_layer_done(self) -> Callable[[int], None]:
        def launch(i: int) -> None:
            if self.launched < len(self.buckets) and self.buckets[self.launched][0] == i:
                self._launch()
            elif self.requests:
                C.test_some(self.requests)  # between layers: let the started sums move
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
            elif self.requests:
                C.test_some(self.requests)
        return launch, piece

    def _launch(self) -> None:
        """Start the rest of the next bucket (all of it unless parts went ahead)."""
        _, _, hi = self.buckets[self.launched]
        if self.sent_to < hi:
            self._start(self.sent_to, hi)
        self._ends.append(self._sums)
        self.launched += 1
        self.sent_to = hi if self.launched == len(self.buckets) else self.buckets[self.launched][1]

    def _start(self, lo: int, hi: int) -> None:
        """Start the sum of ``buf[lo:hi]``."""
        if self.reducer is not None:
            if self._sums == 0:  # this step's first sum
                self._completed0 = self.reducer.completed
            self.reducer.submit(self.buf[lo:hi])
        else:
            self.requests.append(C.iallreduce_sum_(self.comm, self.buf[lo:hi]))
            C.test_some(self.requests)
        self._sums += 1

    def reduce(self) -> None:
        while self.launched < len(self.buckets):
            self._launch()
        self.launched, self._sums, self._ends = 0, 0, []
        self.sent_to = self._first_lo()
        if self.reducer is not None:
            self.reducer.wait()
        else:
            C.wait_all(self.requests)
            self.requests = []
        self.bytes_sent += self.buf.nbytes

    def _first_lo(self) -> int:
        """Where the first bucket starts (0 before setup or with no buckets)."""
        buckets = getattr(self, "buckets", None)
        return buckets[0][1] if buckets else 0

    def at_boundary(self) -> bool:
        return self.launched == 0 and not self.requests and self.sent_to == self._first_lo() and (
            self.reducer is None or self.reducer.pending == 0)

    def close(self) -> None:
        """End the communication thread, if any, and free its communicator. Collective."""
        if self.reducer is not None:
            self.reducer.close()
            self.reducer = None


def layer_buckets(ranges: list[tuple[int, int]], size: int, itemsize: int,
             bucket_bytes: int) -> list[tuple[int, int, int]]:
    """``(layer, lo, hi)`` per bucket, last layers first: whole layers (``ranges`` are
    their ``[lo, hi)`` in the gradient buffer of ``size`` elements of ``itemsize`` bytes)
    until a bucket holds ``bucket_bytes``; the first reaches to the buffer's end (the
    extras), the last starts at 0. No bucket is empty."""
    out, hi, nbytes = [], size, 0
    for i in range(len(ranges) - 1, -1, -1):
        lo = ranges[i][0]
        nbytes += (ranges[i][1] - lo) * itemsize
        if (nbytes >= bucket_bytes or i == 0) and lo < hi:
            out.append((i, lo, hi))
            hi, nbytes = lo, 0
    return out
