"""Gradient-exchange strategies by name, for :class:`~mpidp.DataParallel` and the CLI.

Importing this module starts no MPI: :data:`SYNCS` is a tuple of names, and
:func:`make_sync` imports the strategies (and so MPI) when first called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sync import Sync

SYNCS = ("allreduce", "per-layer", "overlapped", "compressed", "ps", "sharded-ps",
         "accumulate", "local-sgd", "auto")


def make_sync(name: str, optimizer_factory=None, bucket_bytes: int = 1 << 20,
              codec: str | None = None, dedicated: bool = False, k: int = 4,
              ps_shared_memory: bool = True, ps_chunk_bytes: int = 1 << 20,
              node_aware: bool | None = None, overlap_progress: str = "test",
              overlap_finish: str = "backward") -> Sync:
    """A strategy by name: ``allreduce`` (fused), ``per-layer``, ``overlapped`` (bucket
    sums started during backward, moved by ``overlap_progress``: ``"test"`` or
    ``"thread"``, and complete by the end of backward or, ``overlap_finish="forward"``,
    during the next forward pass), ``compressed`` (reduce-scatter and allgather of ``codec``'s codes,
    bfloat16 unless given, error feedback, in buckets of ``bucket_bytes`` started during
    backward), ``ps``
    (``dedicated`` server or not; through shared memory within nodes unless
    ``ps_shared_memory=False``; updates shipped in pieces of ``ps_chunk_bytes``),
    ``sharded-ps`` (needs ``optimizer_factory``),
    ``accumulate`` and ``local-sgd`` (every ``k`` steps), ``auto`` (the fastest of
    allreduce, overlapped and compressed (``codec``, or bfloat16 and int8) on the first
    steps, :mod:`mpidp.parallel.auto`).
    ``node_aware`` (``allreduce``, ``accumulate``, ``auto``): None chooses node-aware reduction
    when ranks share nodes and there are several nodes, True forces it, False never."""
    from .. import comm as C
    from .compress import Compressed
    from .overlap import Overlapped
    from .ps import ParameterServer, ShardedParameterServer
    from .sync import NODE_AWARE, Accumulate, LocalSGD, PerLayer, Sync, node_aware_setting
    node_aware = node_aware_setting(node_aware)
    if overlap_finish != "backward" and name != "overlapped":
        raise C.MpidpError(f"overlap finish {overlap_finish!r} applies to --sync overlapped, "
                           f"not {name}")
    if codec is not None and name not in ("compressed", "auto"):
        raise C.MpidpError(f"codec {codec!r} (--compress) applies to --sync compressed or "
                           f"auto, not {name}")
    if overlap_progress != "test" and name not in ("overlapped", "auto"):
        raise C.MpidpError(f"overlap progress {overlap_progress!r} applies to --sync "
                           f"overlapped or auto, not {name}")
    if node_aware and name not in (*NODE_AWARE, "auto"):
        raise C.MpidpError(f"node-aware reduction applies to --sync {', '.join(NODE_AWARE)} "
                           f"or auto, not {name}")
    if name == "allreduce":
        return Sync(node_aware)
    if name == "auto":
        from .auto import Auto
        return Auto(bucket_bytes, codec, node_aware, overlap_progress)
    if name == "per-layer":
        return PerLayer()
    if name == "overlapped":
        return Overlapped(bucket_bytes, progress=overlap_progress, finish=overlap_finish)
    if name == "compressed":
        return Compressed("bfloat16" if codec is None else codec, bucket_bytes=bucket_bytes)
    if name == "ps":
        return ParameterServer(dedicated, shared_memory=ps_shared_memory, chunk_bytes=ps_chunk_bytes)
    if name == "accumulate":
        strategy = Accumulate(k)
        strategy.node_aware = node_aware
        return strategy
    if name == "local-sgd":
        return LocalSGD(k)
    if name == "sharded-ps":
        if optimizer_factory is None:
            raise C.MpidpError("sharded-ps needs an optimizer factory (one optimizer per slice)")
        return ShardedParameterServer(optimizer_factory)
    raise C.MpidpError(f"unknown sync mode {name!r}; expected one of {SYNCS}")
