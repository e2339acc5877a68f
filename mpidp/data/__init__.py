"""Data: samples of any shape ``(n, *sample_shape)``; sources read by row
(:mod:`~.sources`, :mod:`~.rows`; built-in image and signal sets in :mod:`~.datasets`),
partitions (pure, :mod:`~.partition`), distribution over the ranks (:mod:`~.distribute`:
``Scatterv`` or each rank its own rows), load balance (:mod:`~.balance`) and CRC-32 in pieces
(:mod:`~.crc32`). Names are imported on first use: the pure ones (``Partition``,
``RowReader``) start no MPI."""

from .._lazy import exports

_NAMES = {"Data": ".distribute", "Shard": ".distribute", "load": ".distribute",
          "shard_from_arrays": ".distribute", "Partition": ".partition", "Plan": ".balance",
          "RowReader": ".rows"}
__getattr__, __dir__ = exports(__name__, _NAMES)
__all__ = sorted(_NAMES)
