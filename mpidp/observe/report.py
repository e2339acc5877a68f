"""What rank 0 says of a run on the console: its start (:func:`announce`), a line per
epoch (:class:`EpochReport`) and its end (:func:`summary`)."""

from __future__ import annotations

from .. import comm as C
from .metrics import format_timings
from .watch import say


def announce(comm: C.Comm, mode: str, data, *lines: str) -> None:
    """The first lines: ``mode`` on how many ranks of which MPI, the data (a
    :class:`mpidp.Data`), then ``lines``."""
    mpi = C.mpi_info(comm)
    shape = data.sample_shape
    features = (f"{data.n_features} features" if len(shape) == 1
                else f"samples of shape {'x'.join(map(str, shape))}")
    say(comm, f"mpidp train: {mode} on {comm.size} rank(s), "
        f"{' '.join(mpi['library'].split())} (mpi4py {mpi['mpi4py']})",
        f"data: {data.name}, {data.train.n_total} train / {data.test.n_total} test samples, "
        f"{features}, {data.n_outputs} outputs", *lines)


class EpochReport:
    """``on_epoch``: one line per epoch of ``epochs`` on rank 0 of ``comm``: the training
    loss (and accuracy), each held-out set's loss and accuracy or R^2, the seconds taken
    and the steps skipped for NaN/Inf."""

    def __init__(self, comm: C.Comm, epochs: int) -> None:
        self.comm, self.epochs = comm, epochs

    def __call__(self, r: dict) -> None:
        acc = "" if r.get("accuracy") is None else f"  acc {r['accuracy']:.4f}"
        held = ""
        for name in ("val", "test"):
            if f"{name}_loss" in r:
                held += f"  {name} loss {r[f'{name}_loss']:.4f}"
            if r.get(f"{name}_accuracy") is not None:
                held += f"  {name} acc {r[f'{name}_accuracy']:.4f}"
            elif r.get(f"{name}_r2") is not None:
                held += f"  {name} r2 {r[f'{name}_r2']:.4f}"
        secs = "" if r.get("seconds") is None else f"  ({r['seconds']:.2f}s)"
        skipped = f"  skipped {r['skipped']} steps (NaN/Inf)" if r.get("skipped") else ""
        say(self.comm, f"epoch {r['epoch']:>3}/{self.epochs}  loss {r['loss']:.4f}{acc}{held}"
            f"{secs}{skipped}")


def summary(metrics: dict, size: int, out: str, replicas: str) -> list[str]:
    """The last lines of a run of ``size`` ranks whose ``metrics`` were written to
    ``out``: the final figures (and the best validation epoch's), how the replicas
    compare, each rank's timings over the whole run, and the files written."""
    last, best = metrics["history"][-1], metrics.get("best")
    final = f"final: loss {last['loss']:.4f}"
    if last.get("test_accuracy") is not None:
        final += f", test accuracy {last['test_accuracy']:.4f}"
    test = metrics.get("scores", {}).get("test", {})
    if "f1_macro" in test:
        final += f", macro F1 {test['f1_macro']:.4f}"
    elif test.get("r2") is not None:
        final += f", test R^2 {test['r2']:.4f}"
    if best:
        final += (f"; best validation loss {best['val_loss']:.4f} at epoch {best['epoch']} "
                  f"({best['file']})")
    per_epoch = [h["balance"]["per_rank"] for h in metrics["history"]  # this world's epochs
                 if len(h.get("balance", {}).get("per_rank", ())) == size]
    wait = [sum(e[r]["wait_s"] for e in per_epoch) for r in range(size)] if per_epoch else None
    return [final, f"replicas: {replicas}", "per rank, whole run:",
            format_timings(metrics["timings"], wait),
            f"wrote {out}/: model.npz, metrics.json, config.toml, history.jsonl"
            f"{', ' + best['file'] if best else ''} ({metrics['wall_s']:.1f}s)"]
