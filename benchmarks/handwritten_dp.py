"""The reference to beat: a minimal hand-written data-parallel MLP in mpi4py + NumPy.

Written independently of mpidp (it imports nothing from it), as a competent person would
write it in a page: one flat float32 parameter buffer and one flat gradient buffer (with
the loss sum and sample count appended), forward/backward in plain NumPy on this rank's
share of the global batch, ONE in-place ``Allreduce`` per step, then SGD with the global
gradient sum divided by the global sample count.

Model (the standard benchmark workload of docs/benchmarks.md): ``784 -> 1024 -> 1024 -> 10``, ReLU,
softmax cross-entropy, plain SGD. Batches: positions ``0 .. n_total-1`` in a seeded
per-epoch permutation; a rank owns positions ``start .. stop-1`` and trains on the ones
of each global batch that fall in its block.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import numpy as np
from mpi4py import MPI

SIZES = (784, 1024, 1024, 10)


class HandwrittenDP:
    """Replicated MLP ``sizes[0] -> ... -> sizes[-1]``; ``step`` is collective over ``comm``."""

    def __init__(self, comm: MPI.Comm, sizes: Sequence[int] = SIZES, lr: float = 0.05,
                 seed: int = 0, dtype: type = np.float32) -> None:
        self.comm, self.lr, self.comm_s = comm, lr, 0.0
        shapes = [s for a, b in zip(sizes[:-1], sizes[1:]) for s in ((a, b), (b,))]
        self.n_params = sum(int(np.prod(s)) for s in shapes)
        self.params = np.empty(self.n_params, dtype)
        self.buf = np.zeros(self.n_params + 2, dtype)  # grad sums | loss sum | count
        self.grads = self.buf[:self.n_params]
        self.layers = self._views(self.params, shapes)  # [(W, b), ...]
        self.dlayers = self._views(self.grads, shapes)
        rng = np.random.default_rng(seed)
        for W, b in self.layers:  # He initialisation
            W[...] = rng.standard_normal(W.shape) * np.sqrt(2.0 / W.shape[0])
            b[...] = 0
        comm.Bcast(self.params, root=0)

    @staticmethod
    def _views(flat: np.ndarray, shapes: list) -> list[tuple[np.ndarray, np.ndarray]]:
        views, offset = [], 0
        for shape in shapes:
            size = int(np.prod(shape))
            views.append(flat[offset:offset + size].reshape(shape))
            offset += size
        return list(zip(views[::2], views[1::2]))

    def step(self, X: np.ndarray, y: np.ndarray) -> float:
        """One SGD step on the local rows ``X`` ``(n_local, 784)`` float32, ``y`` ``(n_local,)``
        int labels. Collective. Returns the global batch's mean loss."""
        acts, last = [X], len(self.layers) - 1
        for i, (W, b) in enumerate(self.layers):
            h = acts[-1] @ W  # (n, n_out)
            h += b
            if i < last:
                np.maximum(h, 0, out=h)  # ReLU in place: acts[i+1] > 0 is its derivative mask
            acts.append(h)
        z = acts.pop()  # logits (n, 10)
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        s = e.sum(axis=1, keepdims=True)
        rows = np.arange(len(y))
        loss_sum = float(np.log(s).sum() - z[rows, y].sum())
        d = e / s  # dL/dz = softmax - onehot, (n, 10)
        d[rows, y] -= 1
        for i in range(last, -1, -1):
            (W, _), (dW, db) = self.layers[i], self.dlayers[i]
            np.matmul(acts[i].T, d, out=dW)  # gradient SUM over the local rows
            np.sum(d, axis=0, out=db)
            if i:  # no gradient for the input layer's input
                d = d @ W.T
                d *= acts[i] > 0
        self.buf[-2:] = loss_sum, len(X)
        t = time.perf_counter()
        self.comm.Allreduce(MPI.IN_PLACE, self.buf, op=MPI.SUM)
        self.comm_s += time.perf_counter() - t
        count = float(self.buf[-1])
        if count:
            self.grads *= self.lr / count  # global sum / global count, times lr
            self.params -= self.grads
        return float(self.buf[-2]) / count if count else float("nan")


def local_batches(n_total: int, batch_size: int, start: int, stop: int, seed: int = 0,
                  epoch: int = 0) -> Iterator[np.ndarray]:
    """Endless local row indices (``0 .. stop-start-1``) of each global batch, epoch after
    epoch: a seeded permutation of all ``n_total`` positions per epoch, cut into batches."""
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(n_total)
        for s in range(0, n_total, batch_size):
            pos = order[s:s + batch_size]
            yield pos[(pos >= start) & (pos < stop)] - start
        epoch += 1
