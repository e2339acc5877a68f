"""What a training step or an evaluation reports, the same for every trainer."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    """Global figures of one step or evaluation: summed loss, samples and correct ones."""

    loss_sum: float
    count: int
    correct: int
    skipped: bool = False  # non-finite, update dropped (on_nonfinite="skip")
    stop: bool = False  # some rank asked to stop (SIGTERM/SIGUSR1), agreed by every rank

    @property
    def loss(self) -> float:
        return self.loss_sum / self.count if self.count else float("nan")

    @property
    def accuracy(self) -> float:
        return self.correct / self.count if self.count else float("nan")
