"""Synchronous data parallelism: every rank holds the whole model; one in-place
``Allreduce`` per step combines gradient sums, the loss sum and the sample counts."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import comm as C
from ..metrics import StepTimer
from ..nn import Loss, Optimizer, Sequential

INIT_SYNC = ("bcast", "seed")
_EXTRA = 3  # loss sum, sample count, correct predictions, appended to the gradient buffer


@dataclass
class StepStats:
    """Global figures of one step or evaluation: summed loss, samples and correct ones."""

    loss_sum: float
    count: int
    correct: int

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else float("nan")


class DataParallel:
    """Train ``model`` with ``optimizer`` on ``loss``, replicated over ``comm``.

    Parameters
    ----------
    init_sync : ``"bcast"`` copies ``root``'s parameters to every rank (one ``Bcast``);
        ``"seed"`` trusts that every rank initialised identically and verifies it with a
        checksum (one small ``Allreduce``), raising on every rank if not.
    abort_on_error : install :func:`mpidp.comm.abort_on_error` so an exception on one rank
        ends the job instead of leaving the others waiting.

    Notes
    -----
    The gradient of a step is ``sum of per-sample gradients over the global batch /
    global sample count``, so any split of the batch over ranks (uneven, some empty)
    gives the single-process update up to floating-point summation order.
    """

    def __init__(self, model: Sequential, optimizer: Optimizer, loss: Loss,
                 comm: C.Comm | None = None, init_sync: str = "bcast", root: int = 0,
                 abort_on_error: bool = True) -> None:
        if init_sync not in INIT_SYNC:
            raise C.MpidpError(f"unknown init sync {init_sync!r}; expected one of {INIT_SYNC}")
        self.model, self.optimizer, self.loss = model, optimizer, loss
        self.comm = comm if comm is not None else C.world()
        self.root = root
        self.timer = StepTimer()
        if abort_on_error:
            C.abort_on_error()
        # grads | loss_sum | count | correct: ONE buffer, so ONE Allreduce per step
        self._buf = np.zeros(model.n_params + _EXTRA, model.dtype)
        model.use_grad_buffer(self._buf)
        self.sync_params(init_sync)

    def sync_params(self, how: str = "bcast") -> None:
        """Make every rank's parameters equal ``root``'s (``bcast``) or check they are (``seed``)."""
        if how == "bcast":
            C.bcast_(self.comm, self.model.params, self.root)
        else:
            C.assert_in_sync(self.comm, self.model.params, self.root)

    def in_sync(self) -> bool:
        """True on every rank iff all replicas' parameters are bit-identical. Collective."""
        return C.params_in_sync(self.comm, self.model.params)

    def _local_pass(self, X: np.ndarray, y: np.ndarray, train: bool) -> tuple[float, int]:
        out = self.model.forward(X)
        loss_sum = self.loss.forward(out, y)
        if train:
            self.model.backward(self.loss.backward())
        labelled = self.loss.classification or y.dtype.kind in "iu"
        return loss_sum, self.loss.n_correct(out, y) if labelled else 0

    def step(self, X: np.ndarray, y: np.ndarray) -> StepStats:
        """One synchronous step on this rank's part ``X`` ``(n_local, n_features)`` of the
        global batch (``n_local`` may be 0). Collective. Returns the global batch's stats."""
        buf, n = self._buf, self.model.n_params
        with self.timer.compute():
            loss_sum, correct = self._local_pass(X, y, train=True)
            buf[n:] = (loss_sum, len(X), correct)
        with self.timer.communicate():
            C.allreduce_sum_(self.comm, buf)
        with self.timer.compute():
            count = int(round(float(buf[n + 1])))
            if count:
                grads = self.model.grads
                grads *= 1.0 / count
                self.optimizer.step_(self.model.params, grads)
        self.timer.end_step(len(X))
        return StepStats(float(buf[n]), count, int(round(float(buf[n + 2]))))

    def evaluate(self, X: np.ndarray, y: np.ndarray, batch_size: int = 4096) -> StepStats:
        """Loss and correct predictions over every rank's ``(X, y)``. Collective (1 Allreduce)."""
        total = np.zeros(3, np.float64)
        for s in range(0, len(X), batch_size):
            loss_sum, correct = self._local_pass(X[s:s + batch_size], y[s:s + batch_size], False)
            total += (loss_sum, len(X[s:s + batch_size]), correct)
        C.allreduce_sum_(self.comm, total)
        return StepStats(float(total[0]), int(total[1]), int(total[2]))
