"""Learning-rate schedules given in epochs, made schedules of the update count (what an
optimizer counts): a run knows its epochs, an optimizer only its updates. Pure."""

from __future__ import annotations

from collections.abc import Sequence

from .schedules import Schedule, make_schedule


def epoch_schedule(name: str, lr: float, per_epoch: int, epochs: int, *, warmup_steps: int = 0,
                   warmup_epochs: float = 0.0, step_epochs: int | None = None,
                   milestones: Sequence[int] = (), gamma: float = 0.1,
                   min_lr: float = 0.0) -> Schedule:
    """The schedule ``name`` (of :data:`mpidp.nn.SCHEDULES`, or ``"plateau"``: constant,
    which :class:`mpidp.run.early_stopping.ReduceOnPlateau` scales) from rate ``lr``, for a
    run of ``epochs`` epochs of ``per_epoch`` updates each. Settings in epochs become
    updates: the warmup (``warmup_steps`` updates, else ``warmup_epochs``), a decay by
    ``gamma`` every ``step_epochs`` (``step``) or after each of ``milestones`` (``multistep``),
    ``gamma`` per epoch (``exponential``), down to ``min_lr`` at the end of the run
    (``cosine``, ``polynomial``). The schedule counts from the warmup's end."""
    warmup = warmup_steps or int(round(warmup_epochs * per_epoch))
    total = max(epochs * per_epoch - warmup, 1)
    settings = {}
    if name == "step":
        settings = {"step_size": step_epochs * per_epoch, "gamma": gamma}
    elif name == "multistep":
        settings = {"milestones": [max(m * per_epoch - warmup, 0) for m in milestones],
                    "gamma": gamma}
    elif name == "exponential":
        settings = {"gamma": gamma ** (1.0 / per_epoch)}
    elif name == "cosine":
        settings = {"total": total, "min_lr": min_lr}
    elif name == "polynomial":
        settings = {"total": total, "end_lr": min_lr}
    return make_schedule("constant" if name == "plateau" else name, lr, warmup=warmup,
                         **settings)
