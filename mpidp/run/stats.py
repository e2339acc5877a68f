"""What a training step or an evaluation reports, the same for every trainer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(repr=False)
class StepStats:
    """Global figures of one step or evaluation over all ranks: :attr:`loss` and :attr:`accuracy`
    are means over ``count`` samples of the sums ``loss_sum`` and ``correct``; an evaluation
    also gives ``scores`` (:mod:`mpidp.observe.scores`)."""

    loss_sum: float
    count: int
    correct: int
    skipped: bool = False  # non-finite, update dropped (on_nonfinite="skip")
    stop: bool = False  # some rank asked to stop (a signal or a callback), agreed by every rank
    scores: dict | None = None  # an evaluation's figures (mpidp.observe.scores), global

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else float("nan")

    def __repr__(self) -> str:
        flags = "".join(f", {k}=True" for k in ("skipped", "stop") if getattr(self, k))
        return (f"StepStats(loss={self.loss:.6g}, accuracy={self.accuracy:.6g}, "
                f"count={self.count}, loss_sum={self.loss_sum:.6g}, "
                f"correct={self.correct}{flags})")
