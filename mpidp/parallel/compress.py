"""The ``compressed`` exchange strategy (:class:`Compressed`): gradients summed as the codes
of :mod:`~mpidp.parallel.codecs`, in buckets started during backward, with error feedback."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np

from .. import comm as C
from ..data.partition import block_counts
from ..nn import Optimizer
from . import buffer, codecs
from .codecs import FLOAT16_MAX, JIT_CODECS, Codec, chunk_units, segments
from .overlap import layer_buckets
from .sync import Buffers, Exchanged, Round, Setup, Sync, global_sums

#: Values per exchange at most: one piece travels while the next is encoded (or summed).
PIECE = 1 << 18


def _piece_length(size: int) -> int:
    """Gradient values per exchange: at most :data:`PIECE` per rank, with no count or
    displacement of its messages beyond ``MAX_COUNT``."""
    limit = int(C.collectives.MAX_COUNT)
    return max(1, min(limit if size == 1 else size * (limit // size), size * PIECE))


class Float16Overflow(C.MpidpError):
    """A gradient, or a chunk's sum, beyond float16's 65504: raised on every rank before
    anything is decoded, so the buffer still holds this rank's gradients (for ``auto``)."""


class _Piece:
    """One exchange: gradient values ``s0 .. s1`` in ``size`` chunks (sizes differing by at
    most one); chunk ``j``'s codes at ``o + j * cu`` (``cu``: the largest chunk's units);
    this rank sums chunk ``rank`` (values ``lo .. hi``, ``mu`` units, codes from ``own``)."""

    def __init__(self, s0: int, s1: int, size: int, rank: int, o: int, at: int,
                 codec: str = "bfloat16") -> None:
        counts = block_counts(s1 - s0, size)
        starts = s0 + np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        units = np.array([chunk_units(int(k), codec) for k in counts], np.int64)
        self.s1, self.o, self.at = s1, o, at
        self.c, self.cu = int(counts[0]), int(units[0])  # the largest chunk: values, units
        self.m, self.mu = int(counts[rank]), int(units[rank])  # this rank's chunk
        self.lo, self.own, self.end = int(starts[rank]), o + rank * self.cu, o + size * self.cu
        self.hi = self.lo + self.m
        #: ``(values lo, values hi, codes lo)`` of every non-empty chunk
        self.runs = [(int(starts[j]), int(starts[j] + counts[j]), o + j * self.cu)
                     for j in range(size) if counts[j]]
        others = np.arange(size) != rank  # this rank's own chunk never travels to itself
        self.send = (units * others, np.arange(size, dtype=np.int64) * self.cu)
        slot = np.arange(size) - (np.arange(size) > rank)  # the other senders, packed
        self.slot = (slot * self.mu).astype(np.int64)  # where sender r's part starts
        self.recv = (self.mu * others.astype(np.int64), self.slot)
        self.sent = int(self.send[0].sum()) + self.cu  # units handed to MPI: out, then summed in


class Compressed(Sync):
    """Gradients exchanged as ``codec``'s codes (:mod:`.codecs`), reduce-scattered and
    gathered over P chunks per bucket, started during backward as
    :class:`~mpidp.parallel.overlap.Overlapped` does; bit-identical sums on every replica
    (docs/design.md#synchronisation-strategies). ``error_feedback`` keeps what rounding
    loses (not checkpointed; a dropped step leaves it); ``kernels``: NumPy's or numba's
    passes, the same bits. Settings: :class:`~mpidp.parallel.modes.CompressedSettings`.
    """

    name = "compressed"

    def setup(self, s: Setup) -> Buffers:
        out = super().setup(s)
        self._step = 0  # of the current exchange, for messages
        n, size, rank = self.n, s.comm.size, s.comm.rank
        buckets = layer_buckets(s.model.layer_ranges, n, self.buf.itemsize, self.bucket_bytes)
        #: ``(layer, pieces)`` per bucket in launch order: started once ``layer`` is done
        self.buckets: list[tuple[int, list[_Piece]]] = []
        at, o, r, step = 0, 0, 0, _piece_length(size)
        for layer, b0, b1 in buckets or [(0, 0, 0)]:
            self.buckets.append((layer, []))
            for s0 in range(b0, b1, step) if b1 > b0 else [b0]:
                p = _Piece(s0, min(s0 + step, b1), size, rank, o, at, self.codec)
                p.recv_at, r = r, r + (size - 1) * p.mu  # its own room: pieces overlap in time
                #: ``(values lo, values hi, codes lo, codes hi)`` of every block of every chunk
                p.blocks = [seg for run in p.runs for seg in segments(*run, self.codec)]
                self.buckets[-1][1].append(p)
                at, o = at + p.m, p.end
        self.pieces = [p for _, pieces in self.buckets for p in pieces]
        with C.excused("compiling the compression kernels"):  # seconds, the first time
            self.kernel = Codec(self.codec, jit=self._compiled(s.comm))
        self.layer_lo = [lo for lo, _ in s.model.layer_ranges]
        self.codes = np.zeros(o, np.uint16)  # this rank's codes, then the summed ones
        self.recv = np.zeros(r, np.uint16)  # the other ranks' codes of this rank's chunks
        self._starts = np.zeros(size, np.int64)  # where each rank's codes of a chunk start
        self.extras = np.zeros(buffer.N_EXTRA + 2, np.float64)  # | overflow | non-finite
        self.step_bytes = self.extras.nbytes + (  # one rank: its codes are the sums
            sum(p.sent for p in self.pieces) * 2 if size > 1 else 0)
        # what rounding lost, in use and next, kept apart so that a skipped (non-finite)
        # step leaves the residuals as they were instead of poisoning them
        self.residual, self._next, self.chunk_residual, self._chunk_next = (
            np.zeros(m if self.error_feedback else 0, np.float32) for m in (n, n, at, at))
        self.gather_comm = C.companion(s.comm) if size > 1 else None
        self._begin()
        return out

    def _compiled(self, comm: C.Comm) -> bool:
        """Whether the codec runs numba's kernels (alike on every rank), compiled on each.
        Collective unless the codec or ``kernels`` rules them out."""
        if self.kernels == "numpy" or self.codec not in JIT_CODECS:
            return False
        here = codecs.numba_available()
        if self.kernels == "numba":
            C.agree(comm, None if here else "compression kernels 'numba': numba cannot be "
                    "imported (pip install numba); use kernels 'auto' or 'numpy'")
            C.run_agreed(comm, codecs.compile_kernels, self.codec, self.buf.dtype)
            return True
        # auto: compiled where every rank can import numba and compile the kernels
        why = codecs.compile_error(self.codec, self.buf.dtype) if here else "no numba"
        if here and why is not None:
            warnings.warn(f"compression kernels: numba's failed to compile on rank "
                          f"{comm.rank} ({why}); every rank runs NumPy's passes",
                          RuntimeWarning, stacklevel=2)
        return not C.allreduce_max(comm, [0.0 if why is None else 1.0])[0]

    def _begin(self) -> None:
        """Nothing started: the state of every step's start."""
        self.launched = 0  # buckets started
        self.started = 0  # pieces started of the next bucket
        self.scattering: list = []  # the Ialltoallv of each started piece, in order
        self.summed = 0  # pieces of those whose chunk this rank has summed
        self.gathering: list = []  # the Iallgather of each summed piece, in order
        self.decoded = 0  # pieces of those whose sums are in the gradient buffer already
        self.nonfinite = self.overflow = False

    def on_layer_done(self) -> Callable[[int], None]:
        return self._layer_done

    def on_layer_part(self) -> tuple[Callable[[int, int], None], int] | None:
        # one rank: nothing travels, codes are encoded when backward ends
        return None if self.comm.size == 1 else (self._layer_done, _piece_length(self.comm.size))

    def _layer_done(self, i: int, done: int | None = None) -> None:
        """Backward finished layer ``i`` (or, with ``done``, its first ``done`` values)."""
        self._advance(wait=False)  # first what has arrived: its gather starts at once
        if self.launched < len(self.buckets) and self.buckets[self.launched][0] == i:
            self._launch(upto=None if done is None else self.layer_lo[i] + done)

    def exchange(self, r: Round) -> Exchanged:
        self._step = r.step
        with self.timer.communicate(self.name, bytes=self.step_bytes):
            finite = self.reduce()
        got = global_sums(self.buf, self.n)
        got.finite = finite if r.checks else None
        return got

    def update(self, optimizer: Optimizer, count: int) -> None:
        if self.error_feedback:  # applied: this step's rounding residuals count
            self.residual, self._next = self._next, self.residual
            self.chunk_residual, self._chunk_next = self._chunk_next, self.chunk_residual
        super().update(optimizer, count)

    def at_boundary(self) -> bool:
        return self.launched == 0 and self.started == 0

    def reduce(self) -> bool:
        """The global sums into ``self.buf`` on every rank; returns whether they (and the
        extras) are finite. Starts the buckets backward has not, completes them all.
        Collective: per piece an ``Ialltoallv`` and an ``Iallgather``; one ``Allreduce``."""
        n = self.n
        self._advance(wait=False)
        while self.launched < len(self.buckets):
            self._launch()
        self._advance(wait=True)
        extras = self.extras
        extras[...] = (*self.buf[n:], self.overflow, self.nonfinite)
        C.allreduce_sum_(self.comm, extras)
        gathering, pieces, decoded = self.gathering, self.pieces, self.decoded
        self._begin()
        if extras[buffer.N_EXTRA]:
            C.wait_all(gathering)
            raise Float16Overflow(
                f"float16 gradient compression overflowed at step {self._step}: a gradient "
                f"exceeds {FLOAT16_MAX:g}; use bfloat16 or no compression")
        with np.errstate(invalid="ignore"):  # float16 NaN codes: casts warn
            for j in range(decoded, len(pieces)):
                if gathering:
                    C.wait_all(gathering[j:j + 1])
                self._decode(pieces[j])
        self.buf[n:] = extras[:buffer.N_EXTRA]
        self.bytes_sent += self.step_bytes
        return not extras[buffer.N_EXTRA + 1] and bool(np.isfinite(extras[:buffer.N_EXTRA]).all())

    def _launch(self, upto: int | None = None) -> None:
        """Encode the next bucket's pieces not started yet (those ending by ``upto``, when
        given) and start their reduce-scatters."""
        g, codes, k, ef = self.buf[:self.n], self.codes, self.kernel, self.error_feedback
        f16, alone = self.codec == "float16", self.comm.size == 1
        scan = f16 or alone  # else the owners scan the sums (always: one dot per block)
        _, pieces = self.buckets[self.launched]
        ready = [p for p in pieces[self.started:] if upto is None or p.s1 <= upto]
        self.started += len(ready)
        if self.started == len(pieces):
            self.launched, self.started = self.launched + 1, 0
        with np.errstate(over="ignore", invalid="ignore"):
            for p in ready:
                for lo, hi, ca, cb in p.blocks:
                    bad, beyond = k.encode_sum_(g[lo:hi], codes[ca:cb],
                                                self.residual[lo:hi] if ef else None,
                                                self._next[lo:hi] if ef else None, scan)
                    self.nonfinite, self.overflow = self.nonfinite or bad, self.overflow or beyond
                if not alone:
                    recv = self.recv[p.recv_at:p.recv_at + (self.comm.size - 1) * p.mu]
                    self.scattering.append(C.ialltoallv_(self.comm, codes[p.o:p.end], p.send,
                                                         recv, p.recv))
                    self._advance(wait=False)  # moves what has started while the next encodes

    def _advance(self, wait: bool) -> None:
        """Sum the chunks whose codes have all arrived (in launch order) and start their
        gathers; with ``wait``, every started piece's."""
        if not self.scattering:
            return
        if not wait:
            C.test_some(self.scattering)
            if self.gathering:
                C.test_some(self.gathering)
                self._decode_arrived()
        while self.summed < len(self.scattering):
            request = self.scattering[self.summed:self.summed + 1]
            if wait:
                C.wait_all(request)
            elif request[0] != C.MPI_REQUEST_NULL:
                return
            p = self.pieces[self.summed]
            self.summed += 1
            with np.errstate(over="ignore", invalid="ignore"):
                self._sum_chunk(p)
            self.gathering.append(C.iallgather_in_place(self.gather_comm,
                                                        self.codes[p.o:p.end]))

    def _decode(self, p: _Piece) -> None:
        """The sums of piece ``p`` (every chunk's codes gathered) into the gradient buffer."""
        for a, b, ca, cb in p.blocks:
            self.kernel.decode_(self.codes[ca:cb], self.buf[a:b])

    def _decode_arrived(self) -> None:
        """Decode the gathered pieces, in order, while backward runs (not float16's: see
        :class:`Float16Overflow`)."""
        if self.codec == "float16":
            return
        with np.errstate(invalid="ignore"):
            while self.decoded < len(self.gathering) and self.gathering[self.decoded] == C.MPI_REQUEST_NULL:
                self._decode(self.pieces[self.decoded])
                self.decoded += 1

    def _sum_chunk(self, p: _Piece) -> None:
        """Rank-order float32 sums of the P codes of this rank's chunk of ``p``, plus the
        chunk residual, encoded back into ``self.codes``; the codec's verdict noted."""
        k, codes, ef, starts = self.kernel, self.codes, self.error_feedback, self._starts
        for a, b, ca, cb in segments(0, p.m, 0, self.codec):  # offsets in the chunk
            starts[:] = p.recv_at + p.slot + ca  # rank order: the sum never depends on arrival
            starts[self.comm.rank] = -1  # this rank's own codes, in place
            bad, beyond = k.sum_encode_(codes[p.own + ca:p.own + cb], self.recv, starts, b - a,
                                        self.chunk_residual[p.at + a:p.at + b] if ef else None,
                                        self._chunk_next[p.at + a:p.at + b] if ef else None)
            self.nonfinite, self.overflow = self.nonfinite or bad, self.overflow or beyond
