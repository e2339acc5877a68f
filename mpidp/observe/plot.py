"""Loss and accuracy of one or several runs against epochs and seconds, each run labelled
from its configuration, or a sweep's metric against each setting its trials vary
(``mpidp plot``, :func:`mpidp.cli.main.plot`). A run folder holds
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
        m = _json(metrics, ": write it again, or delete it to plot history.jsonl")
        if not isinstance(m, dict):
            raise ValueError(f"{metrics}: not the metrics of a run (a JSON object)")
        config = {"world_size": m.get("world_size"), "sync": m.get("sync"), **(m.get("config") or {})}
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
PLOTTED = ("epoch", "loss", "accuracy", "test_loss", "test_accuracy", "lr", "seconds", "elapsed_s")


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
            if (v := e.get(key)) is not None and not _number(v):
                raise ValueError(f"{path}: epoch record {i + 1} has {key} = {v!r}, not a "
                                 f"number; the file is damaged")
    return epochs


def _json(path: str, fix: str = "") -> Any:
    """The JSON in ``path``; ValueError naming it, as damaged (and ``fix``), if it is not."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); the file is damaged{fix}") from None


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
    out = [" ".join(f"{s}={_short(c[k])}" for k, s in keys if c.get(k) is not None) for c in cfgs]
    return [(f"{lab} [{os.path.basename(os.path.normpath(r['folder']))}]".strip()
             if not lab or out.count(lab) > 1 else lab) + ("" if r["finished"] else " (killed)")
            for lab, r in zip(out, runs)]


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
        ep = run["epochs"]
        xvals = {"epochs": [e.get("epoch", j + 1) for j, e in enumerate(ep)],
                 "seconds": elapsed(ep)}
        # earlier runs wider and underneath, a marker each: equal curves stay visible
        lw = 1.0 + 2.5 * (n - 1 - i) / max(n - 1, 1)
        mark = MARKERS[i % len(MARKERS)] if len(ep) <= 30 else None
        for col, name in enumerate(xs):
            for row, (train, test) in enumerate(rows):
                for key, style in ((train, "-"), (test, "--")):
                    ys = [e.get(key) for e in ep]
                    if key is None or all(v is None for v in ys):
                        continue
                    losses += [v for v in ys if row == 0 and v is not None]
                    axes[row][col].plot(
                        xvals[name], [float("nan") if v is None else v for v in ys], style,
                        color=f"C{i % 10}", marker=mark, ms=2 + lw, lw=lw, zorder=2 + i,
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
    _save(fig, out)
    return names


def _save(fig, out: str) -> None:
    """Lay ``fig`` out tight, write it to ``out`` atomically, and close it."""
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fmt = os.path.splitext(out)[1][1:].lower() or "png"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        write_atomic(out, lambda f: fig.savefig(f, format=fmt, dpi=110, bbox_inches="tight"))
    except OSError as exc:  # the folder's failure or the write's, named alike
        raise write_error(exc, out, setting("out")) from None
    finally:
        plt.close(fig)


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


# --- a sweep: its metric against each setting the trials vary --------------------------

#: The file ``mpidp sweep`` writes at its end, in the sweep's folder.
SWEEP = "sweep.json"


def is_sweep(folder: str) -> bool:
    """Whether ``folder`` is a sweep's (``sweep.json``, or the plan of one still running)
    rather than a run's."""
    return not os.path.isfile(os.path.join(folder, "metrics.json")) and any(
        os.path.isfile(os.path.join(folder, f)) for f in (SWEEP, "sweep-plan.json"))


def load_sweep(folder: str) -> dict:
    """The summary ``mpidp sweep`` wrote in ``folder`` (``{"select", "best", "trials"}``);
    ValueError naming the file when it is missing (a sweep not finished) or damaged."""
    path = os.path.join(folder, SWEEP)
    if not os.path.isfile(path):
        raise ValueError(f"{folder}: the sweep has not finished ({SWEEP} is written at its "
                         "end); run it to the end, or plot its trials' folders")
    summary = _json(path)
    trials = summary.get("trials") if isinstance(summary, dict) else None
    if not isinstance(trials, list) or not isinstance(summary.get("select"), str) or not all(
            isinstance(t, dict) and isinstance(t.get("settings"), dict) for t in trials):
        raise ValueError(f"{path}: not the summary of a sweep; the file is damaged")
    return summary


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def sweep_series(summary: dict, metric: str | None = None) -> list[dict]:
    """One panel per setting the trials vary (all their settings when none varies):
    ``{"setting", "axis": "linear" | "log" | "category", "x", "y", "trials",
    "categories"}``, the finished trials that have ``metric`` (default: the sweep's
    ``select``), in trial order. A setting some trial leaves unset, or with a value that
    is not a number, is drawn as categories (``"(not set)"`` for the unset); numbers
    spanning over a factor of 20, all above 0, on a log axis."""
    metric = metric or summary["select"]
    trials = sorted(summary["trials"], key=lambda t: t.get("index", 0))
    names = list(dict.fromkeys(k for t in trials for k in t["settings"]))
    varied = [k for k in names if len({json.dumps(t["settings"].get(k), sort_keys=True)
                                       for t in trials}) > 1] or names
    shown_ = [t for t in trials if t.get("status") == "ok" and _number(
        (t.get("result") or {}).get(metric)) and (t["result"][metric] == t["result"][metric])]
    out = []
    for name in varied:
        every = [t["settings"].get(name) for t in trials]
        series = {"setting": name, "x": [t["settings"].get(name) for t in shown_],
                  "y": [t["result"][metric] for t in shown_],
                  "trials": [t.get("index") for t in shown_], "categories": None,
                  "axis": "linear"}
        if not all(_number(v) for v in every):
            label = {id(t): "(not set)" if name not in t["settings"] else _short(t["settings"][name])
                     for t in trials}
            series.update(axis="category", x=[label[id(t)] for t in shown_],
                          categories=list(dict.fromkeys(label.values())))
        elif min(every) > 0 and max(every) / min(every) > 20:
            series["axis"] = "log"
        out.append(series)
    return out


def draw_sweep(summary: dict, out: str, title: str | None = None) -> list[dict]:
    """Draw the sweep's metric against each varied setting (:func:`sweep_series`), one
    panel each, the best trial starred, into ``out``. Returns the series drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    metric = summary["select"]
    panels = sweep_series(summary)
    if not any(p["y"] for p in panels):
        raise ValueError(f"the sweep has no finished trial with {metric}: nothing to plot")
    best = (summary.get("best") or {}).get("trial")
    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.5 * rows), squeeze=False)
    unseen = len(summary["trials"]) - len(panels[0]["y"])
    for ax, p in zip(axes.flat, panels):
        xs = [p["categories"].index(x) for x in p["x"]] if p["axis"] == "category" else p["x"]
        ax.plot(xs, p["y"], "o", color="C0", zorder=2)
        by: dict = {}  # the mean at each value: a line through the repeats
        for x, y in zip(xs, p["y"]):
            by.setdefault(x, []).append(y)
        keys = sorted(by)
        ax.plot(keys, [sum(by[k]) / len(by[k]) for k in keys],
                "_" if p["axis"] == "category" else "-", ms=30, color="C0", alpha=0.5)
        for x, y, i in zip(xs, p["y"], p["trials"]):
            if i == best:
                ax.plot([x], [y], "*", ms=15, color="C3", zorder=3, label=f"best: trial {i}")
                ax.legend(fontsize=8)
        if p["axis"] == "category":
            ax.set_xticks(range(len(p["categories"])), p["categories"], rotation=30,
                          ha="right" if len(p["categories"]) > 4 else "center")
            ax.set_xlim(-0.5, len(p["categories"]) - 0.5)
        elif p["axis"] == "log":
            ax.set_xscale("log")
        ax.set(xlabel=p["setting"], ylabel=metric)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title or f"{metric} of {len(summary['trials'])} trials"
                 + (f" ({unseen} failed or without it: not shown)" if unseen else ""))
    _save(fig, out)
    return panels
