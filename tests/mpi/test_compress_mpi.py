"""The chunked 16-bit exchange (``--sync compressed``) under MPI: bytes counted at the
communicator, sums bit for bit against a NumPy reference that adds every rank's codes in
rank order, both error-feedback residuals, skipped steps, float16 overflow, pieces of
``MAX_COUNT`` values, and bit-identical replicas in training.

Run as a script (``mpiexec -n P python tests/mpi/test_compress_mpi.py``), it prints every
rank's byte counts as JSON on rank 0: tests/parallel/test_compress.py launches it at 2, 4 and
8 ranks.
"""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import all_ranks, raises_everywhere

import mpidp
from mpidp import nn
from mpidp.comm import collectives as Coll
from mpidp.observe.metrics import StepTimer
from mpidp.parallel import buffer, codecs
from mpidp.parallel.codecs import decode, encode
from mpidp.parallel.compress import Compressed
from mpidp.parallel.sync import Round, Setup


class ByteCounter:
    """Forwards to a communicator, counting what this rank hands to MPI (``handed``: the
    buffers it passes, as ``bytes_sent`` counts them) and what leaves it (``leaving``: an
    ``Alltoallv``'s pieces for other ranks, an allgathered block once per other rank, a
    ring allreduce's ``2 (P-1)/P`` of its buffer). ``calls`` names every call made."""

    def __init__(self, comm, tally: ByteCounter | None = None) -> None:
        self._comm, self.size, self.rank = comm, comm.size, comm.rank
        self.handed, self.leaving, self.calls = 0, 0.0, []
        self._tally = self if tally is None else tally  # a duplicate counts into its origin
        self._attrs: dict = {}  # a communicator of its own: its companion is its own too

    def Get_attr(self, keyval):
        return self._attrs.get(keyval)

    def Set_attr(self, keyval, value) -> None:
        self._attrs[keyval] = value

    def Dup(self):
        self._tally.calls.append("Dup")
        return ByteCounter(self._comm.Dup(), self._tally)

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self._tally.calls.append(name)
            return attr(*args, **kwargs)
        return call

    def _count(self, name: str, handed: int, leaving: float) -> None:
        t = self._tally
        t.handed, t.leaving = t.handed + handed, t.leaving + leaving
        t.calls.append(name)

    def _alltoallv(self, name, send) -> None:
        buf, (counts, _) = send
        counts, item = np.asarray(counts), np.asarray(buf).itemsize
        self._count(name, int(counts.sum()) * item, int(counts.sum() - counts[self.rank]) * item)

    def Alltoallv(self, send, recv):
        self._alltoallv("Alltoallv", send)
        return self._comm.Alltoallv(send, recv)

    def Ialltoallv(self, send, recv):
        self._alltoallv("Ialltoallv", send)
        return self._comm.Ialltoallv(send, recv)

    def _allgather(self, name, send, recv) -> None:
        mine = np.asarray(recv).nbytes // self.size if send is MPI.IN_PLACE \
            else np.asarray(send).nbytes
        self._count(name, mine, mine * (self.size - 1))

    def Allgather(self, send, recv):
        self._allgather("Allgather", send, recv)
        return self._comm.Allgather(send, recv)

    def Iallgather(self, send, recv):
        self._allgather("Iallgather", send, recv)
        return self._comm.Iallgather(send, recv)

    def Allreduce(self, send, recv, op=MPI.SUM):
        nbytes = np.asarray(recv if send is MPI.IN_PLACE else send).nbytes
        self._count("Allreduce", nbytes, 2 * (self.size - 1) / self.size * nbytes)
        return self._comm.Allreduce(send, recv, op=op)


class _NoStep:
    """An optimizer that leaves the parameters alone: the tests read the sums."""

    def step_(self, params, grads, scale=1.0) -> None:
        pass


def _strategy(comm, n: int, codec: str = "bfloat16", error_feedback: bool = True,
              dtype=np.float64, bucket_bytes: int = 1 << 30, kernels: str = "auto") -> Compressed:
    """A strategy for a stand-in model of three layers of about ``n/3`` values each."""
    cuts = [0, n // 3, 2 * n // 3, n]
    model = SimpleNamespace(n_params=n, dtype=np.dtype(dtype), params=np.zeros(n, dtype),
                            layer_ranges=list(zip(cuts[:-1], cuts[1:])))
    sync = Compressed(codec, error_feedback, bucket_bytes, kernels=kernels)
    sync.setup(Setup(comm, 0, model, StepTimer()))
    return sync


def _step(sync: Compressed, grads: np.ndarray, step: int, apply: bool = True,
          checks: bool = True):
    """One exchange of this rank's ``grads`` ``(n,)``; the update (which makes the step's
    residuals count) only when ``apply`` and the sums are finite. Returns the verdict and
    the sums ``(n,)`` float64."""
    n = sync.n
    sync.buf[:n] = grads
    buffer.put(sync.buf, n, 1.0, 2, 1, False)
    got = sync.exchange(Round(_NoStep(), checks, step))
    sums = sync.buf[:n].astype(np.float64)
    if apply and got.finite is not False:
        sync.update(_NoStep(), got.count)
    return got, sums


def _coded(x: np.ndarray, codec: str, segments) -> np.ndarray:
    """``x`` (float32 ``(n,)``) encoded and decoded by the reference codec, each segment
    ``(a, b)`` on its own (an int8 segment's groups start at ``a``; a 16-bit code depends
    on its value only)."""
    out = np.empty_like(x)
    for a, b in segments or [(0, len(x))]:
        out[a:b] = decode(encode(x[a:b], codec), codec, b - a)
    return out


def _segments(sync: Compressed) -> list[tuple[int, int]]:
    """The value ranges that the strategy encodes each on its own."""
    return sorted((a, b) for p in sync.pieces for a, b, _, _ in p.blocks)


def _reference(grads: np.ndarray, codec: str, error_feedback: bool = True,
               skip: tuple[int, ...] = (), dtype=np.float64, segments=None) -> np.ndarray:
    """The sums every step ``(T, n)`` from every rank's gradients ``(T, P, n)`` by the
    reference codec: each rank encodes gradient + residual; per element the P decoded codes
    are added in float32 in rank order, plus the owner's residual, and encoded again
    (int8: in the strategy's ``segments``). Residuals do not move at the steps in ``skip``."""
    T, P, n = grads.shape
    res, chunk_res = np.zeros((P, n), np.float32), np.zeros(n, np.float32)
    out = np.zeros((T, n))
    with np.errstate(invalid="ignore", over="ignore"):
        for t in range(T):
            wide = grads[t].astype(dtype)
            x = (wide + res).astype(np.float32) if error_feedback else wide.astype(np.float32)
            sent = [_coded(x[r], codec, segments) for r in range(P)]
            total = sent[0]
            for r in range(1, P):
                total = total + sent[r]
            if P > 1 and error_feedback:
                total = total + chunk_res
            summed = _coded(total, codec, segments) if P > 1 else sent[0]
            out[t] = summed
            if error_feedback and t not in skip:
                res = x - np.stack(sent)
                if P > 1:
                    chunk_res = total - summed
    return out


def _grads(comm, T: int, n: int, codec: str, seed: int = 0) -> np.ndarray:
    """Gradients ``(T, P, n)``, the same on every rank, over many magnitudes (so that the
    order of a float32 sum of three or more shows in its last bits)."""
    rng = np.random.default_rng(seed)
    lo, hi = (-5, 3) if codec == "float16" else (-12, 9)
    scale = 10.0 ** rng.integers(lo, hi, (T, comm.size, n))
    return rng.standard_normal((T, comm.size, n)) * scale


def _same_everywhere(comm, a: np.ndarray) -> bool:
    return len(set(comm.allgather(np.ascontiguousarray(a).tobytes()))) == 1


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("codec", ["bfloat16", "float16", "int8"])
@pytest.mark.parametrize("n", [0, 1, 3, 5, 1000, 70001])
@pytest.mark.parametrize("bucket_bytes", [1 << 30, 1])
def test_sums_are_the_rank_order_reference_bit_for_bit(comm, codec, n, bucket_bytes):
    """One bucket, or one per layer (every value then has another owner): the same sums."""
    T = 4
    grads = _grads(comm, T, n, codec)
    for ef in (True, False):
        sync = _strategy(comm, n, codec, ef, bucket_bytes=bucket_bytes)
        if bucket_bytes == 1 and n >= 3:
            all_ranks(comm, len(sync.buckets) == 3, f"{len(sync.buckets)} buckets")
        got = np.stack([_step(sync, grads[t, comm.rank], t)[1] for t in range(T)])
        want = _reference(grads, codec, ef, segments=_segments(sync))
        all_ranks(comm, np.array_equal(got, want),
                  f"n={n} ef={ef}: {np.sum(got != want)} sums differ from the reference")
        all_ranks(comm, _same_everywhere(comm, got), "every rank decodes the same codes")


numba_kernels = pytest.mark.skipif(not codecs.numba_available(), reason="numba not installed")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("codec", ["bfloat16", "int8"])
@pytest.mark.parametrize("kernels", ["numpy", pytest.param("numba", marks=numba_kernels)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_both_kernels_give_the_reference_sums(comm, codec, kernels, dtype):
    """NumPy's passes and the compiled kernels: the reference's sums, for float32 and
    float64 models, one bucket or one per layer, with and without feedback."""
    T, n = 3, 70001
    grads = _grads(comm, T, n, codec, seed=5)
    for bucket_bytes in (1 << 30, 1):
        for ef in (True, False):
            sync = _strategy(comm, n, codec, ef, dtype, bucket_bytes, kernels)
            all_ranks(comm, sync.kernel.jit == (kernels == "numba"), "kernels not as asked")
            got = np.stack([_step(sync, grads[t, comm.rank], t)[1] for t in range(T)])
            want = _reference(grads, codec, ef, dtype=dtype, segments=_segments(sync))
            all_ranks(comm, np.array_equal(got, want),
                      f"{kernels} ef={ef}: {np.sum(got != want)} sums differ from the reference")


@pytest.mark.mpi(min_size=2)
def test_numba_kernels_missing_on_one_rank(comm, monkeypatch):
    """'numba' is refused on every rank, naming the option and the fix; 'auto' runs
    NumPy's passes on every rank alike."""
    if comm.rank == comm.size - 1:
        monkeypatch.setattr(codecs, "numba_available", lambda: False)
    raises_everywhere(comm, mpidp.MpidpError, lambda: _strategy(comm, 99, kernels="numba"),
                      "compression kernels 'numba': numba cannot be imported")
    sync = _strategy(comm, 99)
    all_ranks(comm, not sync.kernel.jit, "auto must fall back on every rank")
    got = _step(sync, np.arange(99.0) * comm.rank, 0)[1]
    all_ranks(comm, _same_everywhere(comm, got), "every rank decodes the same codes")


@numba_kernels
@pytest.mark.mpi(min_size=2)
def test_numba_kernels_that_fail_to_compile_on_one_rank(comm, monkeypatch):
    """numba importable everywhere, but its kernels fail on one rank: 'auto' runs NumPy's
    passes on every rank alike (that rank warns why); 'numba' fails on every rank."""
    def broken(codec, dtype):
        raise RuntimeError("no LLVM here")
    if comm.rank == comm.size - 1:
        monkeypatch.setattr(codecs, "compile_kernels", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sync = _strategy(comm, 99)
    all_ranks(comm, not sync.kernel.jit, "auto must fall back on every rank")
    said = [str(w.message) for w in caught if "compression kernels" in str(w.message)]
    all_ranks(comm, bool(said) == (comm.rank == comm.size - 1) and
              all("no LLVM here" in m for m in said), f"warnings: {said}")
    got = _step(sync, np.arange(99.0) * comm.rank, 0)[1]
    all_ranks(comm, _same_everywhere(comm, got), "every rank decodes the same codes")
    raises_everywhere(comm, Exception, lambda: _strategy(comm, 99, kernels="numba"),
                      "no LLVM here")


@pytest.mark.mpi(min_size=1)
def test_float32_buffers_and_blocks_too(comm):
    n, T = 3 * (1 << 16) + 17, 3  # several blocks per pass
    grads = _grads(comm, T, n, "bfloat16", seed=1).astype(np.float32)
    sync = _strategy(comm, n, dtype=np.float32)
    got = np.stack([_step(sync, grads[t, comm.rank], t)[1] for t in range(T)])
    all_ranks(comm, np.array_equal(got, _reference(grads, "bfloat16", dtype=np.float32)))


def measure(comm, steps: int = 3, codec: str = "bfloat16") -> dict:
    """Byte counts of ``steps`` exchanges of a tiny float32 model's gradient (n = 7210 in
    two buckets, one per layer; uneven chunks at 3 or 8 ranks), counted at the
    communicator."""
    counter = ByteCounter(comm)
    model = nn.mlp(64, (96,), 10, dtype=np.float32).init_(0)
    sync = Compressed(codec, bucket_bytes=1)
    sync.setup(Setup(counter, 0, model, StepTimer()))
    counter.handed, counter.leaving, counter.calls = 0, 0.0, []
    rng = np.random.default_rng(comm.rank)
    sums = []
    for t in range(steps):
        sums.append(_step(sync, rng.standard_normal(sync.n), t)[1])
    return {"rank": comm.rank, "size": comm.size, "n": sync.n, "steps": steps, "codec": codec,
            "handed": counter.handed, "leaving": counter.leaving, "calls": counter.calls,
            "bytes_sent": sync.bytes_sent, "allreduce_bytes": int(sync.buf.nbytes),
            "sums": sum(float(np.sum(s)) for s in sums)}


def check_bytes(row: dict) -> list[str]:
    """What is wrong with one rank's :func:`measure` (empty when nothing)."""
    P, n, steps = row["size"], row["n"], row["steps"]
    wrong = []
    if row["handed"] != row["bytes_sent"]:
        wrong.append(f"handed {row['handed']} bytes to MPI but bytes_sent says {row['bytes_sent']}")
    k = 5 if P > 1 else 1  # per step and piece (two buckets): the scatters, the gathers;
    calls = row["calls"]  # the Allreduce once both scatters started
    want = ["Iallgather", "Iallgather", "Ialltoallv", "Ialltoallv", "Allreduce"][-k:]
    steps_calls = [calls[i * k:(i + 1) * k] for i in range(steps)]
    if len(calls) != k * steps or any(sorted(c[:-1]) != want[:-1] or c[-1] != "Allreduce"
                                      for c in steps_calls):
        wrong.append(f"calls {calls}")
    # of a float32 ring allreduce's bytes: half (16 bits), a quarter and the scales (int8;
    # a chunk of this tiny model pads its codes by up to 3 bytes, its scales by a group)
    lo, hi = (0.245, 0.275) if row.get("codec") == "int8" else (0.49, 0.51)
    if P > 1:
        ring = 2 * (P - 1) / P * n * 4  # bytes a float32 ring allreduce sends per rank
        ratio = row["leaving"] / steps / ring
        if not lo < ratio < hi:
            wrong.append(f"sends {ratio:.4f} of a float32 ring allreduce's bytes")
        if not lo < row["bytes_sent"] / (steps * row["allreduce_bytes"]) < hi:
            wrong.append(f"bytes_sent {row['bytes_sent']} against allreduce's "
                         f"{steps * row['allreduce_bytes']}")
    elif row["leaving"] != 0 or row["bytes_sent"] != steps * 8 * (buffer.N_EXTRA + 2):
        wrong.append(f"one rank: leaving {row['leaving']}, bytes_sent {row['bytes_sent']}")
    return wrong


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("codec", ["bfloat16", "float16", "int8"])
def test_bytes_counted_at_the_communicator_are_half_a_float32_ring(comm, codec):
    wrong = check_bytes(measure(comm, codec=codec))
    all_ranks(comm, not wrong, f"rank {comm.rank}: {'; '.join(wrong)}")


@pytest.mark.mpi(min_size=1)
def test_a_skipped_step_leaves_both_residuals_as_they_were(comm):
    n, T, bad = 1000, 5, 2
    grads = _grads(comm, T, n, "bfloat16", seed=3)
    grads[bad, comm.size - 1, 7] = np.nan  # the last rank's gradient at step 2
    sync = _strategy(comm, n)
    sums = []
    for t in range(T):
        before = sync.residual.copy(), sync.chunk_residual.copy()
        got, s = _step(sync, grads[t, comm.rank], t)
        sums.append(s)
        all_ranks(comm, got.finite is (t != bad), f"step {t}: verdict {got.finite}")
        if t == bad:  # the trainer's policy drops it: no update
            all_ranks(comm, np.array_equal(sync.residual, before[0])
                      and np.array_equal(sync.chunk_residual, before[1]))
    want = _reference(grads, "bfloat16", skip=(bad,))
    good = [t for t in range(T) if t != bad]
    all_ranks(comm, np.array_equal(np.stack(sums)[good], want[good]))
    got, _ = _step(sync, grads[bad, comm.rank], T, checks=False)
    all_ranks(comm, got.finite is None, "no verdict when the policy checks nothing")


@pytest.mark.mpi(min_size=1)
def test_a_non_finite_loss_is_a_non_finite_verdict(comm):
    sync = _strategy(comm, 10)
    sync.buf[:10] = 1.0
    buffer.put(sync.buf, 10, np.nan if comm.rank == 0 else 1.0, 1, 0, False)
    all_ranks(comm, sync.exchange(Round(_NoStep(), True, 0)).finite is False)


def _residual_total(comm, sync: Compressed) -> np.ndarray:
    """Every rank's residual plus every owner's chunk residual, as one vector ``(n,)``."""
    total = sync.residual.astype(np.float64)
    for p in sync.pieces:
        total[p.lo:p.hi] += sync.chunk_residual[p.at:p.at + p.m]
    return comm.allreduce(total, op=MPI.SUM)


@pytest.mark.mpi(min_size=1)
def test_error_feedback_loses_nothing_for_good(comm):
    """What was applied over the steps plus what the residuals hold is the sum of the true
    gradients (to float32 rounding), so the applied sum tracks it within one rounding."""
    n, T = 2000, 12
    grads = _grads(comm, T, n, "bfloat16", seed=5)
    sync = _strategy(comm, n)
    applied = sum(_step(sync, grads[t, comm.rank], t)[1] for t in range(T))
    true = grads.sum(axis=(0, 1))
    held = _residual_total(comm, sync)
    scale = np.abs(grads).sum(axis=1).max(axis=0)  # per element: the largest step's |sum|
    all_ranks(comm, np.all(np.abs(applied + held - true) <= 1e-6 * T * comm.size * scale))
    per_step = np.abs(grads.sum(axis=1)).max(axis=0) + scale
    all_ranks(comm, np.all(np.abs(applied - true) <= (comm.size + 1) * 2.0 ** -8 * per_step))


@pytest.mark.mpi(min_size=1)
def test_int8_error_feedback_loses_nothing_for_good(comm):
    """int8 rounds to a 127th of each group's largest magnitude, yet what was applied plus
    what the residuals hold is the true sum, and the applied sum stays within a few levels
    of it however many steps pass (each rank's residual and each owner's is under one)."""
    n, T, P = 3000, 30, comm.size
    grads = np.random.default_rng(6).standard_normal((T, P, n))
    sync = _strategy(comm, n, "int8")
    applied = sum(_step(sync, grads[t, comm.rank], t)[1] for t in range(T))
    true = grads.sum(axis=(0, 1))
    held = _residual_total(comm, sync)
    all_ranks(comm, np.all(np.abs(applied + held - true) <= 1e-5 * T * P))
    level = np.abs(grads).max() * P / 127  # one level of the largest group sum, or more
    all_ranks(comm, np.all(np.abs(applied - true) <= (P + 1) * level),
              f"{np.abs(applied - true).max()} against {(P + 1) * level}")


@pytest.mark.mpi(min_size=1)
def test_without_feedback_rounding_accumulates(comm):
    """A gradient bfloat16 cannot hold (1 + 2**-9 rounds to 1): without feedback every step
    loses its 2**-9; with it the total stays within one rounding."""
    n, T = 4, 40
    g = np.full(n, 1 + 2.0 ** -9)
    err = {}
    for ef in (True, False):
        sync = _strategy(comm, n, error_feedback=ef)
        applied = sum(_step(sync, g, t)[1] for t in range(T))
        err[ef] = float(np.abs(applied - T * comm.size * g).max())
    all_ranks(comm, err[False] >= T * comm.size * 2.0 ** -9 * 0.99, f"{err}")
    all_ranks(comm, err[True] <= (comm.size + 1) * comm.size * 2.0 ** -8, f"{err}")


MESSAGE = ("float16 gradient compression overflowed at step 7: a gradient exceeds 65504; "
           "use bfloat16 or no compression")


@pytest.mark.mpi(min_size=1)
def test_float16_overflow_of_one_rank_is_an_error_on_every_rank(comm):
    sync = _strategy(comm, 100, "float16")
    g = np.ones(100)
    g[42] = 7e4 if comm.rank == comm.size - 1 else 1.0
    err = raises_everywhere(comm, mpidp.MpidpError, lambda: _step(sync, g, 7), "overflowed")
    all_ranks(comm, str(err) == MESSAGE, str(err))


@pytest.mark.mpi(min_size=2)
def test_float16_overflow_of_a_partial_sum_is_an_error_on_every_rank(comm):
    sync = _strategy(comm, 100, "float16")
    g = np.ones(100)
    g[99] = 4e4  # fits float16 on every rank; two or more of them do not
    err = raises_everywhere(comm, mpidp.MpidpError, lambda: _step(sync, g, 7), "overflowed")
    all_ranks(comm, str(err) == MESSAGE, str(err))


@pytest.fixture
def small_limit(monkeypatch):
    monkeypatch.setattr(Coll, "MAX_COUNT", 7)  # where the collectives and the strategy read it
    return 7


@pytest.mark.mpi(min_size=1)
def test_vectors_beyond_max_count_go_in_pieces(comm, small_limit):
    n, T = 50, 3
    grads = _grads(comm, T, n, "bfloat16", seed=7)
    counter = ByteCounter(comm)
    sync = _strategy(counter, n)
    counter.handed = 0
    got = np.stack([_step(sync, grads[t, comm.rank], t)[1] for t in range(T)])
    all_ranks(comm, len(sync.pieces) > 1 and all(p.end - p.o <= 7 for p in sync.pieces))
    all_ranks(comm, np.array_equal(got, _reference(grads, "bfloat16")))
    all_ranks(comm, counter.handed == sync.bytes_sent, f"{counter.handed} vs {sync.bytes_sent}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("codec", ["bfloat16", "int8"])
def test_buckets_go_in_pieces_of_at_most_piece_values(comm, codec, monkeypatch):
    """A bucket larger than ``PIECE`` values per rank goes in several exchanges, each
    started as soon as it is encoded: the same sums as the reference (int8: in the
    pieces' segments)."""
    from mpidp.parallel import compress as Z
    monkeypatch.setattr(Z, "PIECE", 100)
    n, T = 1000 * comm.size + 17, 3
    grads = _grads(comm, T, n, codec, seed=8)
    sync = _strategy(comm, n, codec)
    got = np.stack([_step(sync, grads[t, comm.rank], t)[1] for t in range(T)])
    all_ranks(comm, len(sync.pieces) >= 10 and all(p.hi - p.lo <= 100 for p in sync.pieces))
    want = _reference(grads, codec, segments=_segments(sync))
    all_ranks(comm, np.array_equal(got, want), f"{np.sum(got != want)} sums differ")


@pytest.mark.mpi(min_size=1)
def test_collectives_refuse_counts_beyond_max_count(comm, small_limit):
    P = comm.size
    big = (np.full(P, 8, np.int64), np.arange(P, dtype=np.int64) * 8)
    buf = np.zeros(8 * P, np.uint16)
    raises_everywhere(comm, mpidp.MpidpError, lambda: Coll.ialltoallv_(comm, buf, big, buf.copy(), big),
                      "exceeds one MPI call (counts and displacements are C ints, at most 7)")


def _shard(comm, n=150):
    """Uneven shards; with 2+ ranks the last rank has no samples."""
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((n, 6)).astype(np.float32), rng.integers(0, 3, n)
    workers = max(comm.size - 1, 1)
    cuts = np.cumsum([0] + [(2 * i + 1) * n // workers ** 2 for i in range(workers)])
    cuts[-1] = n
    rows = np.arange(cuts[comm.rank], cuts[comm.rank + 1]) if comm.rank < workers else np.arange(0)
    return mpidp.shard_from_arrays(comm, X[rows], y[rows])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("codec", ["bfloat16", "float16", "int8"])
def test_replicas_stay_bit_identical_in_training(comm, codec):
    shard = _shard(comm)
    model = nn.mlp(6, (12, 8), 3, dtype=np.float32).init_(4)
    dp = mpidp.DataParallel(model, nn.Adam(0.01), nn.SoftmaxCrossEntropy(), comm,
                            sync=Compressed(codec))
    hist = mpidp.fit(dp, shard, 3, 16, seed=2)
    all_ranks(comm, _same_everywhere(comm, model.params), "parameters differ between ranks")
    all_ranks(comm, hist[-1]["loss"] < hist[0]["loss"] and dp.global_step > 10)


@pytest.mark.mpi(min_size=1)
@numba_kernels
@pytest.mark.parametrize("codec", ["bfloat16", "int8"])
def test_numba_and_numpy_kernels_train_the_same_model(comm, codec):
    models = []
    for kernels in ("numpy", "numba"):
        model = nn.mlp(6, (12, 8), 3, dtype=np.float32).init_(4)
        dp = mpidp.DataParallel(model, nn.Adam(0.01), nn.SoftmaxCrossEntropy(), comm,
                                sync=Compressed(codec, kernels=kernels))
        mpidp.fit(dp, _shard(comm), 3, 16, seed=2)
        models.append(model.params.copy())
    all_ranks(comm, np.array_equal(models[0].view(np.uint32), models[1].view(np.uint32)),
              "the compiled kernels trained another model")
    all_ranks(comm, _same_everywhere(comm, models[1]), "parameters differ between ranks")


@pytest.mark.mpi(min_size=1)
def test_buckets_started_during_backward_train_the_same_model_as_one(comm):
    """A bucket per layer, each started by backward's hook as its layer finishes, gives
    the same parameters, bit for bit, as one bucket started when backward ends."""
    params = []
    for bucket_bytes in (1, 1 << 30):
        model = nn.mlp(6, (12, 8), 3, dtype=np.float32).init_(4)
        sync = Compressed("bfloat16", bucket_bytes=bucket_bytes)
        dp = mpidp.DataParallel(model, nn.Adam(0.01), nn.SoftmaxCrossEntropy(), comm, sync=sync)
        launched = []

        def logged(i, hook=dp._on_layer_done, sync=sync, launched=launched):
            hook(i)
            launched.append((i, sync.launched))
        dp._on_layer_done = logged
        mpidp.fit(dp, _shard(comm), 2, 16, seed=2)
        params.append(model.params.copy())
        if bucket_bytes == 1:  # Dense layers 4, 2, 0 each start their bucket in backward
            want = [(4, 1), (3, 1), (2, 2), (1, 2), (0, 3)]
            all_ranks(comm, len(sync.buckets) == 3 and launched[:5] == want, f"{launched[:5]}")
        all_ranks(comm, sync.at_boundary())
    all_ranks(comm, np.array_equal(params[0], params[1]), "bucket size changed the sums")



@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("codec", ["bfloat16", "float16", "int8"])
def test_pieces_start_in_parts_of_a_layer_and_sums_decode_during_backward(comm, codec, monkeypatch):
    """Pieces of 8 values per rank: ``Dense(10, 12)``'s gradient is announced in parts,
    the first pieces of its bucket start before the layer is done, and (made to arrive
    at once here) the gathered sums are decoded while backward still runs, except with
    float16. Training gives the parameters of whole layers with every sum decoded when
    backward ends, up to the rounding of the row blocks' products."""
    from mpidp.parallel import compress as Z
    monkeypatch.setattr(Z, "PIECE", 8)
    rng = np.random.default_rng(5)
    X, y = rng.standard_normal((96, 10)).astype(np.float32), rng.integers(0, 3, 96)
    rows = np.array_split(np.arange(96), comm.size)[comm.rank]
    params, early = [], []
    for parts in (True, False):
        model = nn.mlp(10, (12,), 3, dtype=np.float32).init_(4)
        sync = Compressed(codec, bucket_bytes=1)
        dp = mpidp.DataParallel(model, nn.Adam(0.01), nn.SoftmaxCrossEntropy(), comm, sync=sync)
        if parts:
            hook, piece = dp._on_layer_part

            def logged(i, done, hook=hook, sync=sync):
                before = len(sync.scattering)
                hook(i, done)
                sync._advance(wait=True)  # every rank is here: let the started pieces arrive
                MPI.Request.Waitall(sync.gathering)
                sync._decode_arrived()
                early.append((i, len(sync.scattering) - before, sync.decoded))
            dp._on_layer_part = (logged, piece)
        else:
            dp._on_layer_part = (lambda i, done: None, 0)
        mpidp.fit(dp, mpidp.shard_from_arrays(comm, X[rows], y[rows]), 1, 32, seed=2)
        params.append(model.params.copy())
    started = sum(k for i, k, _ in early if i == 0)
    all_ranks(comm, piece == 8 * comm.size and started > 0, f"{early}")
    decoded = max(d for _, _, d in early)
    all_ranks(comm, decoded == 0 if codec == "float16" else decoded > 0, f"{early}")
    # the products of row blocks may round differently from one product (BLAS): ulps only,
    # where a value sent twice or never would be off by a gradient's size
    diff = np.abs(params[0] - params[1]).max()
    all_ranks(comm, np.allclose(params[0], params[1], rtol=1e-6, atol=1e-7),
              f"parts changed the sums: {diff:.3g} of {np.abs(params[1]).max():.3g}")


@pytest.mark.mpi(min_size=2)
def test_strategies_built_again_share_one_duplicate_communicator(comm):
    """Setting up strategy after strategy on one communicator (a test suite, a notebook)
    must not use up the MPI library's communicators: they share one duplicate."""
    first = _strategy(comm, 10).gather_comm
    others = [_strategy(comm, 10).gather_comm for _ in range(3)]
    all_ranks(comm, first is not None and all(g is first for g in others))
    all_ranks(comm, MPI.Comm.Compare(first, comm) == MPI.CONGRUENT)  # same ranks, not comm


if __name__ == "__main__":
    world = MPI.COMM_WORLD
    row = measure(world)
    rows = world.gather({**row, "wrong": check_bytes(row)}, root=0)
    if world.rank == 0:
        print(json.dumps(rows))
