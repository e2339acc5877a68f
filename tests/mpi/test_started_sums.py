"""Sums of a buffer's parts started one at a time (``mpidp.comm.StartedSums``): each part
equals the sum over the ranks of that part, the same bits on every rank, whatever order
the sums complete in; at two ranks one exchange per part, each rank sending its part once."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import CountingComm, all_ranks, raises_everywhere

from mpidp import comm as C
from mpidp.comm import progress

PARTS = [(0, 1), (1, 40), (40, 41), (41, 1000), (1000, 1003)]


def _values(comm, n=1003, seed=5):
    """Every rank's vector (``(size, n)`` float64, random, not integer-valued)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((comm.size, n)) * 10.0 ** rng.integers(-3, 4, (comm.size, n))


def _reference(all_values):
    """The sums in rank order, one element at a time (the plain NumPy formula)."""
    out = all_values[0].copy()
    for row in all_values[1:]:
        out += row
    return out


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("finish", ["wait_all", "wait_any", "advance"])
def test_each_part_is_the_sum_over_ranks(comm, finish):
    values = _values(comm)
    sums = C.StartedSums(C.companion(comm), values[comm.rank].copy())
    for lo, hi in PARTS[::-1]:  # started last part first, as backward does
        sums.start(lo, hi)
    if finish == "wait_all":
        sums.wait_all()
    elif finish == "wait_any":
        while sums.live:
            sums.wait_any()
    else:
        while sums.live:
            sums.advance()
    ok = all(sums.done(i) for i in range(len(PARTS)))
    got = sums.buf
    exact = comm.size <= 2  # two numbers add the same in either order
    close = (np.array_equal(got, _reference(values)) if exact
             else np.allclose(got, _reference(values), rtol=1e-13, atol=0))
    all_ranks(comm, ok and close, f"rank {comm.rank}: sums differ from the reference")
    gathered = comm.allgather(got.tobytes())
    all_ranks(comm, all(g == gathered[0] for g in gathered), "ranks hold different bits")
    sums.clear()
    all_ranks(comm, sums.live == 0 and not sums.requests)


@pytest.mark.mpi(min_size=2)
def test_two_ranks_exchange_each_part_once(comm):
    """At two ranks a part is one Isend and one Irecv of its whole size (a ring allreduce's
    bytes at P = 2: n per rank); more ranks sum by the library's Iallreduce."""
    sub = comm.Split(0 if comm.rank < 2 else 1, comm.rank)
    try:
        counting = CountingComm(sub)
        values = _values(sub)
        sums = C.StartedSums(counting, values[sub.rank].copy())
        for lo, hi in PARTS:
            sums.start(lo, hi)
        sums.wait_all()
        calls = [c for c in counting.calls if c in ("Isend", "Irecv", "Iallreduce")]
        if sub.size == 2:
            want = ["Irecv", "Isend"] * len(PARTS)
        else:
            want = ["Iallreduce"] * len(PARTS)
        exact = np.array_equal(sums.buf, _reference(values)) if sub.size <= 2 else \
            np.allclose(sums.buf, _reference(values), rtol=1e-13, atol=0)
        all_ranks(comm, calls == want and exact,
                  f"rank {comm.rank}: calls {calls}, sums exact {exact}")
    finally:
        sub.Free()


@pytest.mark.mpi(min_size=2)
def test_parts_beyond_one_message_go_by_iallreduce(comm, monkeypatch):
    """A part over the largest message count is summed by the library, still exactly."""
    monkeypatch.setattr(progress, "MAX_COUNT", 50)
    counting = CountingComm(C.companion(comm))
    values = _values(comm)
    sums = C.StartedSums(counting, values[comm.rank].copy())
    for lo, hi in PARTS:
        sums.start(lo, hi)
    sums.wait_all()
    big = sum(hi - lo > 50 for lo, hi in PARTS) if comm.size == 2 else len(PARTS)
    got = sum(c == "Iallreduce" for c in counting.calls)
    ok = np.allclose(sums.buf, _reference(values), rtol=1e-13, atol=0)
    all_ranks(comm, got == big and ok, f"rank {comm.rank}: {got} Iallreduce, sums ok {ok}")


@pytest.mark.mpi(min_size=1)
def test_misuse_is_named(comm):
    sums = C.StartedSums(C.companion(comm), np.ones(8))
    raises_everywhere(comm, C.MpidpError, sums.wait_any, "no started sum")
    sums.start(0, 8)
    if comm.size > 1:
        raises_everywhere(comm, C.MpidpError, sums.clear, "still in flight")
    sums.wait_all()
    sums.clear()
    all_ranks(comm, np.all(sums.buf == comm.size), "sum of ones")


@pytest.mark.mpi(min_size=2)
def test_two_ranks_hold_the_same_bits_even_for_nans(comm):
    """Each rank's own NaN (a payload of its rank) meets the other's: x86 keeps the first
    operand's payload, so both ranks must add in the same order to stay identical."""
    sub = comm.Split(0 if comm.rank < 2 else 1, comm.rank)
    try:
        bits = np.array([0x7FF8000000000001 + sub.rank, 0, 0], np.uint64)
        values = bits.view(np.float64).copy()
        values[1:] = [1.5, -2.0]
        sums = C.StartedSums(C.companion(sub), values)
        sums.start(0, 3)
        sums.wait_all()
        got = sub.allgather(sums.buf.view(np.uint64).tolist())
        ok = all(g == got[0] for g in got) and np.isnan(sums.buf[0])
        all_ranks(comm, ok, f"rank {comm.rank}: {got}")
    finally:
        sub.Free()


@pytest.mark.mpi(min_size=2)
def test_sums_on_one_communicator_never_take_each_others_messages(comm):
    """Two at once on one communicator, started in opposite orders on the two ranks (as
    sums started when windows free up can be): each has a tag of its own."""
    sub = comm.Split(0 if comm.rank < 2 else 1, comm.rank)
    try:
        a_values, b_values = _values(sub, 1003, 1), _values(sub, 517, 2)
        shared = C.companion(sub)
        a = C.StartedSums(shared, a_values[sub.rank].copy())
        b = C.StartedSums(shared, b_values[sub.rank].copy())
        order = [(a, 0, 1003), (b, 0, 517)]
        for sums, lo, hi in (order if sub.rank == 0 else order[::-1]):
            sums.start(lo, hi)
        b.wait_all()
        a.wait_all()
        exact = sub.size > 2 or (np.array_equal(a.buf, _reference(a_values))
                                 and np.array_equal(b.buf, _reference(b_values)))
        all_ranks(comm, exact and (sub.size != 2 or a.tag != b.tag), f"rank {comm.rank}")
    finally:
        sub.Free()


@pytest.mark.mpi(min_size=2)
def test_scratch_is_made_at_the_first_exchange_and_released(comm):
    sums = C.StartedSums(C.companion(comm), np.ones(64))
    before = sums.scratch is None
    sums.start(0, 64)
    sums.wait_all()
    made = (sums.scratch is not None) == (comm.size == 2)
    sums.release()
    again = sums.scratch is None
    sums.start(0, 32)
    sums.wait_all()
    all_ranks(comm, before and made and again, "scratch not made or not released")
    all_ranks(comm, np.all(sums.buf[:32] == comm.size ** 2) and np.all(sums.buf[32:] == comm.size))


@pytest.mark.mpi(min_size=1)
def test_bad_buffers_and_parts_are_named(comm):
    shared = C.companion(comm)
    raises_everywhere(comm, C.MpidpError, lambda: C.StartedSums(shared, np.ones((4, 4))[:, 1]),
                      "contiguous 1-D")
    raises_everywhere(comm, C.MpidpError, lambda: C.StartedSums(shared, np.ones((2, 3))),
                      "contiguous 1-D")
    sums = C.StartedSums(shared, np.ones(8))
    for part in ((3, 2), (-1, 4), (0, 9)):
        raises_everywhere(comm, C.MpidpError, lambda part=part: sums.start(*part), "not within")
    all_ranks(comm, sums.live == 0 and not sums.requests)


@pytest.mark.mpi(min_size=1)
def test_a_companion_is_freed_with_its_communicator(comm):
    """Built on communicators made and freed again and again, companions do not use up
    the library's communicators (MPICH has about 2000)."""
    firsts = []
    for _ in range(1500):
        sub = comm.Dup()
        dup = C.companion(sub)
        firsts.append(C.companion(sub) is dup)
        sub.Free()
    all_ranks(comm, all(firsts) and dup == MPI.COMM_NULL, "companion kept or made twice")


@pytest.mark.mpi(min_size=1)
def test_private_sums_have_a_communicator_of_their_own_until_closed(comm):
    sums = C.StartedSums(comm, np.ones(16), private=True)
    other = sums.comm != comm and MPI.Comm.Compare(sums.comm, comm) == MPI.CONGRUENT
    sums.start(0, 16)
    sums.wait_all()
    sums.close()
    all_ranks(comm, other and sums.comm == MPI.COMM_NULL and sums.scratch is None,
              "no duplicate, or not freed")
    all_ranks(comm, np.all(sums.buf == comm.size))
