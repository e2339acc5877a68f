"""The MPI world: communicators, their construction, what the library is, and what this process is
doing (the watchdog's view). Importing it starts MPI; only :mod:`mpidp.comm` imports mpi4py."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any

import numpy as np
from mpi4py import MPI

from ..errors import MpidpError

# --- what this process is doing, as the watchdog sees it: computing, waiting in an MPI call (every
# call of mpidp.comm marks itself with watched()), or excused (work that may outlast a step)

COMPUTING, IN_MPI, EXCUSED, USER_CODE = 0, 1, 2, 3
STATE_NAMES = ("computing", "waiting in MPI", "excused", "running user code")

#: Names of the watched calls, in definition order (identical in every process).
CALLS: list[str] = ["(nothing yet)"]


class _Mark:
    """This process's state, read by the watchdog thread (plain attributes: cheap)."""

    __slots__ = ("state", "call", "since", "step", "excuse", "spanned")

    def __init__(self) -> None:
        self.state, self.call, self.step, self.excuse = COMPUTING, 0, -1, ""
        self.spanned = False  # the MPI call under way is inside an excused span
        self.since = time.monotonic()


MARK = _Mark()


def watched(what: str):
    """Decorator for the MPI calls of :mod:`mpidp.comm`: marks this rank waiting in ``what`` during the
    call (a nested call keeps the outer mark). In an excused span it still counts as waiting in
    MPI (a silent rank is found a timeout after it starts) but may last ten timeouts."""
    CALLS.append(what)
    code = len(CALLS) - 1

    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            m = MARK
            if m.state == IN_MPI:  # nested in another watched call: the outer one counts
                return fn(*args, **kwargs)
            outer, outer_since = m.state, m.since
            m.state, m.call, m.since, m.spanned = IN_MPI, code, time.monotonic(), outer == EXCUSED
            try:
                return fn(*args, **kwargs)
            finally:  # back to computing, or to the excused span (whose clock runs on)
                m.state, m.spanned = outer, False
                m.since = outer_since if outer == EXCUSED else time.monotonic()
        return call
    return wrap


def set_step(step: int) -> None:
    """Record the training step this rank is at (shown in the watchdog's report)."""
    MARK.step = step


@contextlib.contextmanager
def excused(what: str, state: int = EXCUSED):
    """Work that may take longer than a step (writing a checkpoint): other ranks waiting
    meanwhile are not a stall, up to ten timeouts (``state`` USER_CODE: one, named)."""
    m = MARK
    prev = m.state, m.excuse
    m.state, m.excuse, m.since = state, what, time.monotonic()
    try:
        yield
    finally:
        (m.state, m.excuse), m.since = prev, time.monotonic()


def _no_finalize() -> None:
    raise RuntimeError("it calls MPI.Finalize(), which would leave the other ranks waiting")


@contextlib.contextmanager
def user_code(what: str):
    """A user's code run on every rank (a module they import): watched as computing is (one timeout),
    named ``what``, with ``MPI.Finalize()`` raising RuntimeError, not ending MPI under the other ranks."""
    real, MPI.Finalize = MPI.Finalize, _no_finalize
    try:
        with excused(what, USER_CODE):
            yield
    finally:
        MPI.Finalize = real


Comm = MPI.Comm
SHM_DIR = "/dev/shm"  # where MPICH (and Open MPI) keep shared-memory segments on Linux


def world() -> Comm:
    """``MPI.COMM_WORLD``."""
    return MPI.COMM_WORLD


def self_comm() -> Comm:
    """``MPI.COMM_SELF``: a communicator of this rank alone."""
    return MPI.COMM_SELF


def mpi_info(comm: Comm | None = None) -> dict[str, Any]:
    """MPI vendor, version, library string, world size and processor names (rank 0's view)."""
    comm = comm or MPI.COMM_WORLD
    vendor, version = MPI.get_vendor()
    return {
        "vendor": vendor,
        "vendor_version": ".".join(map(str, version)),
        "mpi_standard": "{}.{}".format(*MPI.Get_version()),
        "library": MPI.Get_library_version().strip().splitlines()[0],
        "mpi4py": __import__("mpi4py").__version__,
        "world_size": comm.size,
        "processor": MPI.Get_processor_name(),
    }


@watched("a Comm.Dup")
def duplicate(comm: Comm) -> Comm:
    """``comm.Dup()``: the same ranks, in collectives that never match those of ``comm``. Collective."""
    return comm.Dup()


def _free_kept(comm: Comm, keyval: int, kept: Comm | dict) -> None:
    """MPI's callback when ``comm`` is freed (collectively, on every rank): free what was
    kept on it, its companion or the pairs :func:`node_split` made. Must not raise into MPI."""
    parts = [c for pair in kept.values() for c in pair if c is not None] if isinstance(kept, dict) else [kept]
    for part in parts:
        with contextlib.suppress(Exception):  # MPI is freeing comm: nothing to report to
            part.Free()


_COMPANION = MPI.Comm.Create_keyval(delete_fn=_free_kept)
_NODE_SPLITS = MPI.Comm.Create_keyval(delete_fn=_free_kept)
_TAGS = MPI.Comm.Create_keyval()  # per communicator: the next tag of :func:`fresh_tag`


def companion(comm: Comm) -> Comm:
    """A duplicate of ``comm`` that never matches its collectives: made on the first call
    (collective then), the same one later, kept on ``comm`` and freed with it."""
    if (dup := comm.Get_attr(_COMPANION)) is None:
        dup = duplicate(comm)
        comm.Set_attr(_COMPANION, dup)
    return dup


def fresh_tag(comm: Comm, first: int, count: int) -> int:
    """A tag among ``first .. first + count - 1`` for the next user of ``comm``, in turn: the
    same on every rank that asks in the same order. Local."""
    k = comm.Get_attr(_TAGS) or 0
    comm.Set_attr(_TAGS, k + 1)
    return first + k % count


@watched("a Comm.Split")
def split(comm: Comm, color: int, key: int) -> Comm:
    """The ranks of ``comm`` with this rank's ``color``, ordered by ``key``. Collective."""
    return comm.Split(color, key)


@watched("a Comm.Split")
def split_off(comm: Comm, rank: int) -> Comm | None:
    """A communicator of every rank but ``rank`` (None on ``rank``). Collective."""
    sub = comm.Split(MPI.UNDEFINED if comm.rank == rank else 0, key=comm.rank)
    return None if sub == MPI.COMM_NULL else sub


@contextlib.contextmanager
def split_groups(comm: Comm, size: int):
    """Groups of ``size`` consecutive ranks of ``comm`` (``0..size-1``, the next ``size`` ...), freed on
    leaving; None on the ``comm.size % size`` last ranks. Collective to enter, over each group to leave."""
    spare = comm.rank >= comm.size - comm.size % size
    sub = split(comm, MPI.UNDEFINED if spare else comm.rank // size, comm.rank)
    try:
        yield None if sub == MPI.COMM_NULL else sub
    finally:
        if sub != MPI.COMM_NULL:
            sub.Free()


@watched("a Comm.Split")
def node_split(comm: Comm, first: int = 0) -> tuple[Comm, Comm | None]:
    """``(node, leaders)``: the ranks of ``comm`` on this rank's node (``first`` as rank 0) and,
    on each node's rank 0, the node leaders (None elsewhere). Collective; made once per
    ``comm`` and ``first``, freed with ``comm``."""
    per_node = _forced_per_node(comm)
    if (splits := comm.Get_attr(_NODE_SPLITS)) is None:
        splits = {}
        comm.Set_attr(_NODE_SPLITS, splits)
    if (pair := splits.get((first, per_node))) is None:
        key = -1 if comm.rank == first else comm.rank
        node = _node(comm, key, per_node)
        leaders = comm.Split(0 if node.rank == 0 else MPI.UNDEFINED, key=key)
        pair = splits[first, per_node] = (node, leaders if node.rank == 0 else None)
    return pair


#: For tests on one host: every ``k`` consecutive ranks are one "node" (unset: MPI's nodes).
RANKS_PER_NODE = "MPIDP_RANKS_PER_NODE"


def _forced_per_node(comm: Comm) -> int:
    """``MPIDP_RANKS_PER_NODE`` (0: unset). Collective: a bad value, or one that differs
    between ranks, raises the same :class:`MpidpError` on every rank."""
    raw = os.environ.get(RANKS_PER_NODE, "").strip()
    whole = raw.isascii() and raw.isdigit() and int(raw) >= 1
    mine = (min(int(raw), 1 << 31) if whole else -1) if raw else 0
    seen = np.array([mine, -mine], np.int64)
    comm.Allreduce(MPI.IN_PLACE, seen, op=MPI.MAX)
    high, low = int(seen[0]), -int(seen[1])  # over the ranks
    if low < 0:
        raise MpidpError(f"{RANKS_PER_NODE} must be a whole number >= 1"
                         + (f", got {raw!r}" if mine < 0 else " (on some rank it is not)"))
    if low != high:
        raise MpidpError(f"{RANKS_PER_NODE} must be the same on every rank: " + (
            "it is set on some only" if low == 0 else f"{low} on some, {high} on others"))
    return high


def _node(comm: Comm, key: int, per_node: int | None = None) -> Comm:
    """The ranks of ``comm`` on this rank's node, ordered by ``key`` (``per_node``: the
    forced size, when already known). Collective."""
    per_node = _forced_per_node(comm) if per_node is None else per_node
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=key)
    if not per_node or node.size != comm.size:  # several real nodes: it cannot cut finer
        return node
    node.Free()
    return comm.Split(comm.rank // per_node, key=key)


@watched("a Comm.Split")
def local_ranks(comm: Comm) -> int:
    """How many ranks of ``comm`` share this rank's node. Collective."""
    local = _node(comm, comm.rank)
    n = local.size
    local.Free()
    return n
