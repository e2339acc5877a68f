"""The data of a job with a dedicated parameter server: loaded over the workers only, the
server holding empty shards of the same description."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import comm as C
from .distribute import Data, Shard


def load_on_workers(comm: C.Comm, server: int, load: Callable[[C.Comm], Data],
                    dtype) -> Data:
    """``load(workers)`` on every rank of ``comm`` but ``server`` (``workers``: their own
    communicator); the server gets the same description with empty shards (features of
    ``dtype``). Collective; a worker's error reaches every rank, said once."""
    workers = C.split_off(comm, server)
    data, error = None, None
    if workers is not None:
        try:
            data = load(workers)
        except C.MpidpError as exc:
            error = str(exc)  # already agreed among the workers
    first_worker = 1 if server == 0 else 0
    error = C.bcast_obj(comm, error, root=first_worker)
    if error is not None:
        raise C.MpidpError(error)
    empty = C.bcast_obj(comm, _emptied(data, dtype) if comm.rank == first_worker else None,
                        root=first_worker)
    return data if data is not None else empty


def _emptied(data: Data, dtype) -> Data:
    """``data`` with no rows: its description, shards of none of its samples."""
    y = data.train.y

    def empty(shard: Shard) -> Shard:
        return Shard(np.empty((0, *data.sample_shape), dtype),
                     np.empty((0, *y.shape[1:]), y.dtype), 0, shard.n_total)

    return Data(empty(data.train), empty(data.test), data.name, data.n_features,
                data.n_outputs, data.classification, sample_shape=data.sample_shape,
                test_split=data.test_split,
                val=empty(data.val) if data.val is not None and data.val.n_total else None)
