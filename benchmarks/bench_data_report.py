"""Tables, target checks and the plot of ``make bench-data`` (see bench_data.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

#: Bytes per rank per round of mpidp's streamed Scatterv (mpidp.comm.collectives.ROUND_BYTES).
ROUND_MIB = 32
PHASES = ("open", "read", "check", "cast", "send")


def _mib(cell: dict) -> float:
    """Bytes moved per run (X and y of every row), MiB; from the scatter shards."""
    return float(sum(cell["results"]["scatter"].get("shard_mib", [0.0])))


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else float("nan")


def targets(cells: list[dict]) -> list[dict]:
    """Every target of the data-distribution work, checked at P = 2 on every file cell."""
    checks = []
    npy = {c["size_mb"]: c for c in cells if c["format"] == "npy" and c["P"] == 2}
    for c in (c for c in cells if c["P"] == 2 and c["size_mb"] is not None):
        r, where = c["results"], f"{c['size_mb']:g} MiB {c['format']}"
        sc, hs = r["scatter"]["seconds"], r["hand-scatter"]["seconds"]
        checks.append({"target": f"scatter <= 1.5 x hand-written Scatterv ({where})",
                       "value": _ratio(sc, hs), "limit": 1.5})
        shard0 = r["scatter"]["shard_mib"][0]
        checks.append({"target": f"scatter rank 0 peak anon <= shard + 2 rounds ({where})",
                       "value": r["scatter"]["peak_anon_mib"][0],
                       "limit": shard0 + 2 * ROUND_MIB})
        lo, hl = r["local"]["seconds"], r["hand-local"]["seconds"]
        checks.append({"target": f"local <= 1.2 x plain read ({where})",
                       "value": _ratio(lo, hl), "limit": 1.2})
        if "local-copy" in r:
            checks.append({"target": f"local, copied (--copy-data) vs plain read ({where}; no "
                           "target set)", "value": _ratio(r["local-copy"]["seconds"], hl),
                           "limit": None})
        for mode in ("local", "local-copy"):
            if mode in r:
                shard = max(r[mode]["shard_mib"])
                checks.append({"target": f"{mode} peak anon about its shard ({where}, limit "
                               "+10%+8 MiB)", "value": max(r[mode]["peak_anon_mib"]),
                               "limit": shard * 1.1 + 8})
        if c["format"] != "npy" and c["size_mb"] in npy:
            base = npy[c["size_mb"]]["results"]
            for mode in ("scatter", "local"):
                checks.append({"target": f"{mode} <= 2 x folder of .npy ({where})",
                               "value": _ratio(r[mode]["seconds"], base[mode]["seconds"]),
                               "limit": 2.0})
        if "predict-write" in r:
            checks.append({"target": f"predict writes vs plain pwrite ({where}; no target set)",
                           "value": _ratio(r["predict-write"]["seconds"],
                                           r["hand-write"]["seconds"]), "limit": None})
    for ch in checks:
        ch["pass"] = None if ch["limit"] is None else bool(ch["value"] <= ch["limit"])
    return checks


def _row(c: dict) -> str:
    r = c["results"]
    size = "-" if c["size_mb"] is None else f"{c['size_mb']:g}"
    mib = _mib(c)

    def t(mode):
        return f"{r[mode]['seconds']:.3f}" if mode in r else "-"

    def ratio(a, b):
        return f"{_ratio(r[a]['seconds'], r[b]['seconds']):.2f}" if a in r and b in r else "-"

    sc = r["scatter"]
    phases = "/".join(f"{sc['phases'][p]:.2f}" for p in PHASES)
    lphases = "/".join(f"{r['local']['phases'][p]:.2f}" for p in PHASES)
    rate = f"{mib / sc['seconds']:.0f} / {mib / r['local']['seconds']:.0f}" if mib else "-"
    copied = (f"{max(r['local-copy']['peak_anon_mib']):.0f}" if "local-copy" in r else "-")
    mem = (f"{sc['peak_anon_mib'][0]:.0f} ({sc['shard_mib'][0]:.0f}) / "
           f"{max(r['local']['peak_anon_mib']):.0f} / {copied} "
           f"({max(r['local']['shard_mib']):.0f})")
    return (f"| {size} | {c['format']} | {c['P']} | {t('scatter')} | {t('hand-scatter')} | "
            f"{ratio('scatter', 'hand-scatter')} | {t('local')} | {t('local-copy')} | "
            f"{t('hand-local')} | {ratio('local', 'hand-local')} | "
            f"{ratio('local-copy', 'hand-local')} | {rate} | {phases} | {lphases} | {mem} | "
            f"{t('predict-write')} / {t('hand-write')} |")


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        "# make bench-data", "",
        f"Command: `{results['command']}` (total {results['total_s']:.0f} s). "
        f"Commit {m['commit']}; {m['nproc']} cores (`nproc`), {m['cpu']}, {m['mem_gib']} GiB; "
        f"Python {m['python']}, NumPy {m['numpy']}; BLAS {', '.join(m['blas'])}.", "",
        "Seconds are medians over repeats of the slowest rank, from a barrier before "
        "`mpidp.load` to a barrier after it (what runs before the first training step). "
        "Phases (open/read/check/cast/send, s): root's for scatter, the slowest reader's for "
        "local; the cast to float32 happens inside the read's copy. Local: rows mapped from "
        "the file where they can be (one run of float32 rows), copy: read into private "
        "memory (`--copy-data`). Memory: peak RssAnon above the process's own before the "
        "call, MiB, with the shard size in brackets: rank 0 for scatter / the largest rank "
        "for local and copy (mapped pages are page cache, not counted). MiB/s: bytes of X "
        "and y delivered per second.", "",
        "| MiB | format | P | scatter s | hand Scatterv s | ratio | local s | local copy s | "
        "plain read s | local ratio | copy ratio | MiB/s scatter / local | scatter phases | "
        "local phases | peak anon MiB scatter r0 / local / copy | predict write / plain "
        "write s |",
        "|" + "---|" * 16]
    lines += [_row(c) for c in results["cells"]]
    lines += ["", "## Targets (P = 2)", "", "| target | value | limit | pass |", "|---|---|---|---|"]
    for ch in results["targets"]:
        limit = "-" if ch["limit"] is None else f"{ch['limit']:.2f}"
        ok = "-" if ch["pass"] is None else ("yes" if ch["pass"] else "NO")
        lines.append(f"| {ch['target']} | {ch['value']:.2f} | {limit} | {ok} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = [c for c in results["cells"] if c["size_mb"] is not None]
    ranks = sorted({c["P"] for c in cells})
    fig, axes = plt.subplots(1, len(ranks), figsize=(5 * len(ranks), 4), squeeze=False)
    for ax, P in zip(axes[0], ranks):
        mine = [c for c in cells if c["P"] == P]
        labels = [f"{c['size_mb']:g}\n{c['format']}" for c in mine]
        x = np.arange(len(mine))
        modes = ("scatter", "hand-scatter", "local", "local-copy", "hand-local")
        for k, mode in enumerate(modes):
            ax.bar(x + (k - 2) * 0.16, [c["results"].get(mode, {}).get("seconds", np.nan)
                                        for c in mine], 0.16, label=mode)
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_title(f"P = {P}: time to first step")
        ax.set_ylabel("seconds")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(results: dict, out: str) -> None:
    """Check targets, write ``out``.json/.md/.png, print the Markdown."""
    results["targets"] = targets(results["cells"])
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(results, indent=1))
    text = markdown(results)
    Path(out + ".md").write_text(text)
    plot(results, out + ".png")
    print(text)
