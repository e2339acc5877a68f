"""Small helpers shared by the benchmark plots: oversubscription marks, error bars from
repeats, legends outside the data, log axes where values span orders of magnitude."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

#: How runs with more ranks than cores look: hollow markers, hatched bars, a grey band.
OVER_HATCH = "///"
OVER_NOTE = "oversubscribed: more ranks than cores"


def cores(report: dict | None = None) -> int:
    """Cores of the machine that ran the benchmark: ``report["cores"]`` (or
    ``env.cpus``) when recorded, else this machine's count (the replot runs there too)."""
    report = report or {}
    return int(report.get("cores") or report.get("env", {}).get("cpus") or os.cpu_count() or 1)


def oversubscribed(P: int, n_cores: int) -> bool:
    """True when ``P`` ranks share fewer than ``P`` cores."""
    return P > n_cores


def p_label(P: int, n_cores: int) -> str:
    """``P=4 (oversubscribed, 2 cores)`` or ``P=2``."""
    return f"P={P} (oversubscribed, {n_cores} cores)" if oversubscribed(P, n_cores) else f"P={P}"


def shade_oversubscribed(ax, n_cores: int, x_max: float) -> None:
    """Grey band over the ranks counts above ``n_cores`` (x axis = P), labelled."""
    if x_max <= n_cores:
        return
    ax.axvspan(n_cores + 0.5, x_max + 0.5, color="0.92", zorder=0)
    ax.text(n_cores + 0.55, 0.02, f"P > {n_cores} cores:\noversubscribed", fontsize=7,
            color="0.35", transform=ax.get_xaxis_transform(), va="bottom")


def spread(samples: Sequence[float]) -> tuple[float, float, float]:
    """``(median, median - min, max - median)`` of repeated measurements (error bars)."""
    a = np.asarray(samples, np.float64)
    med = float(np.median(a))
    return med, med - float(a.min()), float(a.max()) - med


def legend_outside(ax, title: str | None = None, fontsize: int = 7) -> None:
    """The axes' legend to the right of the axes, where it hides no data."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  borderaxespad=0.0, fontsize=fontsize, title=title, title_fontsize=fontsize)


def log_if_wide(ax, values: Sequence[float], axis: str = "y", factor: float = 20.0) -> bool:
    """Log scale on ``axis`` when the positive ``values`` span more than ``factor``."""
    pos = [v for v in values if v is not None and v > 0]
    wide = bool(pos) and max(pos) / min(pos) > factor
    if wide:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    return wide
