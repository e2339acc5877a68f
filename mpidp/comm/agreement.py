"""Collective decisions: every rank reaches the same verdict, so every rank raises the same
error (or none) and nobody is left waiting in a later collective; and the checksums that
prove replicas bit-identical (:func:`checksum`, pure, from :mod:`mpidp.digest`)."""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
from mpi4py import MPI

from ..digest import checksum
from ..errors import MpidpError
from .runtime import Comm, watched


@watched("an agreement Allreduce")
def agree(comm: Comm, error: str | None) -> None:
    """Raise the same :class:`MpidpError` on every rank if any rank's ``error`` is set (None:
    fine), naming the lowest failing rank's problem and the failed ranks. Collective."""
    flag = np.array([0 if error is None else 1], np.int32)
    comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
    if not flag[0]:
        return
    errors = comm.allgather(error)  # small control message, only on the failure path
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    rank, msg = failed[0]
    where = f"rank {rank}" if len(failed) == 1 else f"ranks {[r for r, _ in failed]}"
    raise MpidpError(msg if len(failed) == comm.size else f"{msg} (on {where})")


def _attempt(fn, *args, **kwargs) -> tuple[Any, str | None, Exception | None]:
    """``(fn's result, None, None)``, or ``(None, its failure described, the exception if a bug)``."""
    try:
        return fn(*args, **kwargs), None, None
    except (ValueError, OSError) as exc:
        return None, str(exc) or type(exc).__name__, None
    except Exception as bug:  # noqa: BLE001 - agreed on, then re-raised by the caller
        return None, f"{type(bug).__name__}: {str(bug) or type(bug).__name__}", bug


def run_agreed(comm: Comm, fn, *args, **kwargs) -> Any:
    """Call ``fn`` on every rank and return its result; if it raises on any rank, every rank
    raises (collective): bad input (``ValueError``/``OSError``) as :class:`MpidpError`, a bug
    (any other exception) unchanged on the rank that hit it, as :class:`MpidpError` elsewhere."""
    result, error, bug = _attempt(fn, *args, **kwargs)
    try:
        agree(comm, error)
    except MpidpError:
        if bug is not None:
            raise bug from None
        raise
    return result


def root_decides(comm: Comm, fn, *args, root: int = 0, **kwargs) -> Any:
    """Run ``fn`` on ``root`` only; its result (pickled: keep it small) or its failure (as in
    :func:`run_agreed`) reaches every rank. Collective. The watchdog sees ``root`` as doing
    the work around the call (computing, or an excused span), the others as waiting in MPI."""
    result, error, bug = _attempt(fn, *args, **kwargs) if comm.rank == root else (None, None, None)
    result, error = _decision(comm, (result, error), root)
    if error is None:
        return result
    if bug is not None:
        raise bug
    raise MpidpError(error)


@watched("a root decision (Bcast)")
def _decision(comm: Comm, verdict: tuple, root: int) -> tuple:
    return comm.bcast(verdict, root=root)


@watched("the replica checksum Allreduce")
def params_in_sync(comm: Comm, params: np.ndarray) -> bool:
    """True on every rank iff all ranks hold bit-identical ``params``. Collective, 1 Allreduce."""
    return _same_everywhere(comm, np.array([checksum(params)], np.int64))


def _same_everywhere(comm: Comm, h: np.ndarray) -> bool:
    """Whether every rank holds int64 ``h`` (as long everywhere): one Allreduce."""
    buf = np.concatenate([h, -h])
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return bool(np.array_equal(buf[:len(h)], -buf[len(h):]))


@watched("the replica checksum Allreduce")
def assert_in_sync(comm: Comm, params: np.ndarray, root: int = 0) -> None:
    """Raise :class:`MpidpError` on every rank, naming the ranks whose ``params`` differ from
    ``root``'s, unless all are bit-identical. Collective."""
    bad = replicas_differ(comm, [params], root)[0]
    if bad:
        raise MpidpError(f"parameters differ from rank {root}'s on ranks {bad}: replicas are "
                         f"out of sync")


@watched("the replica checksum Allreduce")
def replicas_differ(comm: Comm, arrays: list[np.ndarray], root: int = 0) -> list[list[int]]:
    """For each of ``arrays`` (as many on every rank), the ranks whose copy differs from
    ``root``'s; all lists empty when every copy is bit-identical. Collective: one Allreduce
    of checksums, and an allgather of them only when some differ."""
    h = np.array([checksum(a) for a in arrays], np.int64)
    if _same_everywhere(comm, h):
        return [[] for _ in arrays]
    hashes = comm.allgather(h.tolist())  # failure path only
    return [[r for r, mine in enumerate(hashes) if mine[i] != hashes[root][i]]
            for i in range(len(arrays))]


@watched("an agreement Allreduce (arguments)")
def agree_same(comm: Comm, where: str, items: dict[str, Any]) -> None:
    """Raise the same :class:`MpidpError` on every rank unless every rank passed equal
    ``items`` (name -> a value whose ``repr`` identifies it; names may differ too). Collective:
    one ``Allreduce`` of a digest; the message names each differing item, its values and the
    ranks holding each."""
    # a digest of their reprs: the same size on every rank, whatever it passed
    mine = repr([(k, repr(v)) for k, v in items.items()]).encode()
    if _same_everywhere(comm, np.array([checksum(np.frombuffer(mine, np.uint8))])):
        return
    shown = comm.allgather({k: repr(v) for k, v in items.items()})  # failure path only
    names = dict.fromkeys(k for values in shown for k in values)
    parts = []
    for k in (k for k in names if len({values.get(k) for values in shown}) > 1):
        seen = [values.get(k, "not passed") for values in shown]
        cut, field = _where_they_differ(list(dict.fromkeys(seen)))
        groups = {v: [r for r, w in enumerate(seen) if w == v] for v in dict.fromkeys(seen)}
        parts.append(f"{k} is " + ", ".join(
            f"{cut(v)} on rank {r[0]}" if len(r) == 1 else f"{cut(v)} on ranks {r}"
            for v, r in groups.items()) + field)
    raise MpidpError(f"{where}: every rank must pass the same arguments, but " + "; ".join(parts))


def _where_they_differ(values: list[str], width: int = 80):
    """How to show each of the distinct reprs ``values`` in ``width`` characters (from the
    field holding their first difference, or a little before the difference, when they are
    long) and the words naming that field (``name=`` or ``'name':``; empty if none)."""
    if all(len(v) <= width for v in values):
        return (lambda v: v), ""
    at = len(os.path.commonprefix(values))
    fields = list(re.finditer(r"(\w+)=|'(\w+)': ", values[0][:at]))
    start = max(fields[-1].start() if fields else 0, at - width // 2, 0)

    def cut(v: str) -> str:
        v = ("..." if start else "") + v[start:]
        return v if len(v) <= width else v[:width - 3] + "..."
    name = fields and (fields[-1].group(1) or fields[-1].group(2))
    return cut, f" (they differ first at its field {name})" if name else ""
