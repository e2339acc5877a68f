"""Loss and accuracy of one or several runs against epochs and seconds, each run labelled
from its configuration (``mpidp plot``, :func:`mpidp.cli.main.plot`). A run folder holds
``metrics.json`` (a finished run) or ``history.jsonl`` (a failed or killed run's epochs).
matplotlib is imported only when drawing."""

from __future__ import annotations

import json
import os
from typing import Any

from ..atomic import check_file, shown, write_atomic, write_error
from ..errors import setting
from .history import read as read_history

#: Configuration keys worth naming in a label, in this order, with their short names.
LABEL_KEYS = (("parallel", "parallel"), ("sync", "sync"), ("world_size", "P"),
              ("partition", "partition"), ("schedule", "schedule"),
              ("micro_batches", "m"), ("optimizer", "opt"), ("lr", "lr"),
              ("batch_size", "batch"), ("compress", "compress"), ("sync_every", "every"),
              ("dataset", "data"), ("model", "model"), ("hidden", "hidden"), ("seed", "seed"))
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "<", ">", "*")
NEED_MATPLOTLIB = ("mpidp plot needs matplotlib: pip install 'mpidp[bench]' "
                   "(or pip install matplotlib)")


def load_run(folder: str) -> dict:
    """``{"folder", "config", "epochs": [records], "finished": bool}`` from a run folder;
    ValueError naming the folder when it holds neither file, or no epoch yet."""
    metrics, jsonl = os.path.join(folder, "metrics.json"), os.path.join(folder, "history.jsonl")
    if os.path.isfile(metrics):
        try:
            with open(metrics, encoding="utf-8") as f:
                m = json.load(f)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{metrics}: not valid JSON ({exc}); the file is damaged: "
                             "write it again, or delete it to plot history.jsonl") from None
        if not isinstance(m, dict):
            raise ValueError(f"{metrics}: not the metrics of a run (a JSON object)")
        config = dict(m.get("config") or {})
        config.setdefault("world_size", m.get("world_size"))
        config.setdefault("sync", m.get("sync"))
        return {"folder": folder, "config": config,
                "epochs": _checked_epochs(m.get("history") or [], metrics), "finished": True}
    if not os.path.isfile(jsonl):
        raise ValueError(f"{folder}: no metrics.json or history.jsonl; give a folder that "
                         f"mpidp train wrote (its {setting('out')})")
    records = read_history(jsonl)
    config = next(({k: v for k, v in r.items() if k != "kind"} for r in reversed(records)
                   if r.get("kind") == "config"), {})
    epochs = [r for r in records if r.get("kind") == "epoch"]
    if not epochs:
        raise ValueError(f"{folder}: history.jsonl has no finished epoch yet")
    return {"folder": folder, "config": config, "epochs": _checked_epochs(epochs, jsonl),
            "finished": False}


#: The figures of an epoch record that are drawn or summed (numbers, or null when absent).
PLOTTED = ("epoch", "loss", "accuracy", "test_loss", "test_accuracy", "lr", "seconds",
           "elapsed_s")


def _checked_epochs(epochs: object, path: str) -> list[dict]:
    """``epochs`` as a list of epoch records; ValueError naming ``path``, the record and
    the field when it is not a list of objects whose drawn figures are numbers."""
    if not isinstance(epochs, list):
        raise ValueError(f"{path}: its history is {type(epochs).__name__}, not a list of "
                         f"epochs; the file is damaged")
    for i, e in enumerate(epochs):
        if not isinstance(e, dict):
            raise ValueError(f"{path}: epoch record {i + 1} is {type(e).__name__}, not an "
                             f"object; the file is damaged")
        for key in PLOTTED:
            v = e.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise ValueError(f"{path}: epoch record {i + 1} has {key} = {v!r}, not a "
                                 f"number; the file is damaged")
    return epochs


def elapsed(epochs: list[dict]) -> list[float]:
    """Seconds since the start at the end of each epoch: ``elapsed_s`` when recorded, else
    the running sum of each epoch's ``seconds``."""
    out, t = [], 0.0
    for e in epochs:
        t += float(e.get("seconds") or 0.0)
        out.append(float(e["elapsed_s"]) if e.get("elapsed_s") is not None else t)
    return out


def _short(v: Any) -> str:
    if isinstance(v, (list, tuple)):
        return ",".join(map(str, v))
    return f"{v:g}" if isinstance(v, float) else str(v)


def labels(runs: list[dict]) -> list[str]:
    """One label per run: the configuration keys whose values differ between the runs that
    record them (always ``sync`` or ``parallel``, and ``P``), e.g. ``sync=ps P=2``; the folder name
    is added where two labels would be equal; ``(killed)`` for runs without metrics.json."""
    cfgs = [r["config"] for r in runs]
    keys = []
    for key, short in LABEL_KEYS:
        values = {json.dumps(c[key], sort_keys=True) for c in cfgs if c.get(key) is not None}
        always = key == "world_size" or (key == "sync" and all(
            c.get("parallel", "data") == "data" for c in cfgs))
        if len(values) > 1 or (always and values):
            keys.append((key, short))
    if not any(k == "parallel" for k, _ in keys) and any(
            c.get("parallel", "data") != "data" for c in cfgs):
        keys.insert(0, ("parallel", "parallel"))
    out = [" ".join(f"{s}={_short(c[k])}" for k, s in keys if c.get(k) is not None)
           for c in cfgs]
    same = [not lab or out.count(lab) > 1 for lab in out]
    for i, r in enumerate(runs):
        if same[i]:
            out[i] = f"{out[i]} [{os.path.basename(os.path.normpath(r['folder']))}]".strip()
    return [lab + ("" if r["finished"] else " (killed)") for lab, r in zip(out, runs)]


def draw(runs: list[dict], out: str, x: str = "both", title: str | None = None) -> list[str]:
    """Draw loss (top), accuracy and, when the runs record a changing one, the learning rate
    against epochs and/or seconds into ``out``: training solid, test dashed in the same
    colour. Returns the legend's entries (beside the axes: it hides no curve)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    xs = ["epochs", "seconds"] if x == "both" else [x]
    rows = [("loss", "test_loss"), ("accuracy", "test_accuracy")]
    if len({e.get("lr") for run in runs for e in run["epochs"]} - {None}) > 1:
        rows.append(("lr", None))  # a schedule moved the rate: show it
    fig, axes = plt.subplots(len(rows), len(xs), figsize=(5.5 * len(xs) + 2.5, 3.5 * len(rows)),
                             squeeze=False)
    losses: list[float] = []
    n = len(runs)
    for i, (run, label) in enumerate(zip(runs, labels(runs))):
        color = f"C{i % 10}"
        ep = run["epochs"]
        xvals = {"epochs": [e.get("epoch", j + 1) for j, e in enumerate(ep)],
                 "seconds": elapsed(ep)}
        # earlier runs wider and underneath, a marker each: equal curves stay visible
        lw = 1.0 + 2.5 * (n - 1 - i) / max(n - 1, 1)
        mark = MARKERS[i % len(MARKERS)] if len(ep) <= 30 else None
        for col, name in enumerate(xs):
            for row, (train, test) in enumerate(rows):
                ax = axes[row][col]
                for key, style in ((train, "-"), (test, "--")):
                    if key is None:
                        continue
                    ys = [e.get(key) for e in ep]
                    if all(v is None for v in ys):
                        continue
                    losses += [v for v in ys if row == 0 and v is not None]
                    ax.plot(xvals[name], [float("nan") if v is None else v for v in ys],
                            style, color=color, marker=mark, ms=2 + lw, lw=lw, zorder=2 + i,
                            label=f"{label}, {'train' if key == train else 'test'}")
    positive = [v for v in losses if v > 0]  # spanning over a factor of 20: a log axis
    for col, name in enumerate(xs):
        if positive and max(positive) / min(positive) > 20:
            axes[0][col].set_yscale("log")
        for row, ylabel in enumerate(("loss", "accuracy", "learning rate")[:len(rows)]):
            axes[row][col].set(ylabel=ylabel, xlabel="epoch" if name == "epochs" else "seconds")
            axes[row][col].grid(alpha=0.3)
            if name == "epochs":
                axes[row][col].xaxis.set_major_locator(MaxNLocator(integer=True))
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
               title="solid: train, dashed: test")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fmt = os.path.splitext(out)[1][1:].lower() or "png"
    try:  # atomically: a failure leaves no half-written image
        try:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        except OSError as exc:
            raise write_error(exc, out, setting("out")) from None
        write_atomic(out, lambda f: fig.savefig(f, format=fmt, dpi=110, bbox_inches="tight"),
                     what=setting("out"))
    finally:
        plt.close(fig)
    return names


#: The file written when ``out`` names a folder.
IN_A_FOLDER = "plot.png"


def output_path(out: str) -> str:
    """The image file ``out`` means: ``out``, ``OUT/plot.png`` for a folder, ``out.png``
    without an extension. ValueError naming the fix for a format matplotlib cannot write, or
    a place where no file can be written."""
    if os.path.isdir(out) or out.endswith(os.sep):
        out = os.path.join(out, IN_A_FOLDER)
    elif not os.path.splitext(out)[1]:
        out += ".png"
    from matplotlib.backend_bases import FigureCanvasBase
    formats = FigureCanvasBase.get_supported_filetypes()
    ext = os.path.splitext(out)[1][1:].lower()
    if ext not in formats:
        raise ValueError(f"{setting('out')} {shown(out)}: matplotlib cannot write .{ext} "
                         f"images; give one of " + ", ".join(f".{f}" for f in sorted(formats)))
    check_file(out, setting("out"), IN_A_FOLDER)
    return out


def need_matplotlib() -> None:
    """Raise ImportError with the command that installs matplotlib when it is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(NEED_MATPLOTLIB) from exc
