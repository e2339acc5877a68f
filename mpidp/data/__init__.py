"""Data: samples of any shape ``(n, *sample_shape)`` read by row, partitioned, distributed
over the ranks and balanced (docs/design.md). Names are imported on first use: the pure
ones (``Partition``, ``RowReader``) start no MPI."""

from .._lazy import exports

_NAMES = {"Data": ".distribute", "Shard": ".distribute", "load": ".distribute",
          "shard_from_arrays": ".distribute", "Partition": ".partition", "Plan": ".balance",
          "RowReader": ".rows"}
__getattr__, __dir__ = exports(__name__, _NAMES)
__all__ = sorted(_NAMES)
