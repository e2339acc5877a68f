"""Gradient-exchange strategies by name, for :class:`~mpidp.DataParallel` and the CLI.

Importing this module starts no MPI: :data:`SYNCS` is a tuple of names, and
:func:`make_sync` imports the strategies (and so MPI) when first called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sync import Sync

SYNCS = ("allreduce", "per-layer", "overlapped", "compressed", "ps", "sharded-ps",
         "accumulate", "local-sgd")


def make_sync(name: str, optimizer_factory=None, bucket_bytes: int = 1 << 20,
              codec: str = "bfloat16", dedicated: bool = False, k: int = 4,
              ps_shared_memory: bool = True, ps_chunk_bytes: int = 1 << 20) -> Sync:
    """A strategy by name: ``allreduce`` (fused), ``per-layer``, ``overlapped`` (bucketed
    ``Iallreduce`` during backward), ``compressed`` (16-bit, error feedback), ``ps``
    (``dedicated`` server or not; through shared memory within nodes unless
    ``ps_shared_memory=False``; updates shipped in pieces of ``ps_chunk_bytes``),
    ``sharded-ps`` (needs ``optimizer_factory``),
    ``accumulate`` and ``local-sgd`` (every ``k`` steps)."""
    from .. import comm as C
    from .ps import ParameterServer, ShardedParameterServer
    from .sync import Accumulate, Compressed, LocalSGD, Overlapped, PerLayer, Sync
    if name == "allreduce":
        return Sync()
    if name == "per-layer":
        return PerLayer()
    if name == "overlapped":
        return Overlapped(bucket_bytes)
    if name == "compressed":
        return Compressed(codec)
    if name == "ps":
        return ParameterServer(dedicated, shared_memory=ps_shared_memory, chunk_bytes=ps_chunk_bytes)
    if name == "accumulate":
        return Accumulate(k)
    if name == "local-sgd":
        return LocalSGD(k)
    if name == "sharded-ps":
        if optimizer_factory is None:
            raise C.MpidpError("sharded-ps needs an optimizer factory (one optimizer per slice)")
        return ShardedParameterServer(optimizer_factory)
    raise C.MpidpError(f"unknown sync mode {name!r}; expected one of {SYNCS}")
