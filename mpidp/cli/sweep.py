"""``mpidp sweep``: many ``mpidp train`` runs in one job, on groups of ranks
(:func:`mpidp.parallel.sweeps.sweep`).

The trials are a grid (``--grid lr=0.01,0.1 seed=0,1``), seeded random draws (``--random
N --space lr=0.001:0.1:log``) and/or the ``[[trial]]`` tables of a TOML file, each a set
of ``train`` options over the ``train`` options given beside them. Trial ``i`` is an
ordinary run into ``OUT/trial-NNN`` (model.npz, metrics.json, config.toml); its failure
(an error of ``mpidp train``) is recorded and the others go on. The end: a table, and
``OUT/sweep.json`` and ``OUT/sweep.csv``, best first by ``--select``.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import math
import os
import re
import sys

from ..atomic import check_folder, write_atomic
from ..errors import MpidpError
from . import settings
from .config import load, tokens
from .parser import refuse, subcommand
from .places import refusal

#: Settings the sweep decides for every trial (where it writes, what it continues).
OWN = ("out", "checkpoint_dir", "resume", "restart", "config")
PLAN, TRIAL, RESULTS = "sweep-plan.json", "trial.json", "sweep"
#: The figures of a trial in the table, sweep.json and sweep.csv: the last epoch's, and
#: the best over the epochs (lowest loss, highest accuracy).
FIGURES = ("loss", "accuracy", "val_loss", "val_accuracy", "test_loss", "test_accuracy")
SELECT_DEFAULTS = ("val_loss", "test_loss", "loss")
_ELSEWHERE = "give the trials' options here or in --trials FILE"
_WHOLE_JOB = ("a trial's ranks are one part of the job, whose other trials and the sweep's "
              "gathering of results do not go on past a lost rank")
#: train options a sweep refuses, and why
NOT_FOR_A_SWEEP = {"--restart": _ELSEWHERE, "--config": _ELSEWHERE, "--elastic": _WHOLE_JOB,
                   "--min-ranks": _WHOLE_JOB}


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """The sweep's options, with ``train`` (the train options for every trial) and
    ``trials`` (each a dict of train options) added; a usage error (exit 2) for bad ones,
    one line (exit 2) for a path that is no regular file or folder. No MPI."""
    args, base = parser.parse_known_args(argv)
    me, train = subcommand(parser, "sweep"), subcommand(parser, "train")
    for flag in (token.split("=")[0] for token in base):
        if flag in NOT_FOR_A_SWEEP:
            me.error(f"{flag} is not for a sweep: {NOT_FOR_A_SWEEP[flag]}")
    refuse(refusal(args, me))  # before --trials is read
    refuse(refusal(parser.parse_args(["train", *base]), train))  # as train would
    try:
        trials = _from_file(args.trials_file) + _grid(args.grid) + _drawn(args)
        for i, trial in enumerate(trials):
            bad = [k for k in trial if k.replace("-", "_") in OWN]
            if bad:
                raise ValueError(f"trial {i} sets {bad[0]}, which the sweep decides")
            bad = [k for k in trial if "--" + k.replace("_", "-") in NOT_FOR_A_SWEEP]
            if bad:
                raise ValueError(f"trial {i} sets {bad[0]}, which is not for a sweep: "
                                 f"{NOT_FOR_A_SWEEP['--' + bad[0].replace('_', '-')]}")
            tokens(trial, train, source=f"trial {i}")  # an unknown option: refused now
    except ValueError as exc:
        me.error(str(exc))
    if not trials:
        me.error("no trials: give --grid, --random with --space, or --trials")
    known = [*FIGURES, *(f"best_{k}" for k in FIGURES), "wall_s"]
    if args.select is not None and args.select not in known:
        me.error(f"--select {args.select}: not a figure of a trial; give one of "
                 + ", ".join(known))
    args.train, args.trials = base, trials
    return args


def _value(text: str):
    """A value as typed in ``--grid``: true/false, a number, or text (brackets removed)."""
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text[1:-1] if text.startswith("[") and text.endswith("]") else text


def _axes(specs: list[str], what: str) -> list[tuple[str, str]]:
    out = []
    for spec in specs:
        name, eq, values = spec.partition("=")
        if not eq or not name or not values:
            raise ValueError(f"{what} {spec!r}: write NAME=VALUES (lr=0.01,0.1)")
        if name.replace("_", "-") in {n.replace("_", "-") for n, _ in out}:
            raise ValueError(f"{what} names {name} twice: give all its values at once "
                             f"({name}=V1,V2)")
        out.append((name, values))
    return out


def _split(values: str, spec: str) -> list:
    """``a,b,[c,d]`` -> ``[a, b, "c,d"]``, each through :func:`_value`; ValueError for an
    empty value (``a,,b``)."""
    parts = re.findall(r"\[[^\]]*\]|[^,]+", values)
    if ",".join(parts) != values:
        raise ValueError(f"{spec}: an empty value; write V1,V2 (a value holding commas in "
                         "brackets: [64,32])")
    return [_value(v) for v in parts]


def _grid(specs: list[str]) -> list[dict]:
    axes = [(name, _split(values, f"--grid {name}={values}"))
            for name, values in _axes(specs or [], "--grid")]
    return [dict(zip([n for n, _ in axes], combo))  # no axes: no trials, not one empty one
            for combo in itertools.product(*(v for _, v in axes))] if axes else []


def _drawn(args: argparse.Namespace) -> list[dict]:
    """``--random N`` trials from ``--space``, drawn with ``--search-seed``."""
    if not args.random:
        return []
    if not args.space:
        raise ValueError("--random needs --space (NAME=LO:HI or NAME=V1,V2)")
    import numpy as np
    rng, out = np.random.default_rng(args.search_seed), []
    axes = _axes(args.space or [], "--space")
    for _ in range(args.random):
        trial = {}
        for name, values in axes:
            parts = values.split(":")
            if len(parts) == 1:
                choices = _split(values, f"--space {name}={values}")
                trial[name] = choices[int(rng.integers(len(choices)))]
                continue
            lo, hi = (_value(x) for x in parts[:2])
            log = parts[2:] == ["log"]
            if parts[2:] not in ([], ["log"]) or not all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in (lo, hi)) \
                    or lo > hi or (log and lo <= 0):
                raise ValueError(f"--space {name}={values}: write LO:HI or LO:HI:log "
                                 "(0 < LO <= HI for log)")
            x = math.exp(rng.uniform(math.log(lo), math.log(hi))) if log else rng.uniform(lo, hi)
            trial[name] = (int(round(x)) if isinstance(lo, int) and isinstance(hi, int)
                           else float(f"{x:.6g}"))
        out.append(trial)
    return out


def _from_file(path: str | None) -> list[dict]:
    if path is None:
        return []
    table = load(path, "--trials")
    trials = table.get("trial", [])
    if set(table) - {"trial"} or not isinstance(trials, list) or not all(
            isinstance(t, dict) for t in trials):
        raise ValueError(f"--trials {path}: write one [[trial]] table of options per trial")
    return trials


# --- running: every rank -----------------------------------------------------------------


def folder(out: str, i: int) -> str:
    return os.path.join(out, f"trial-{i:03d}")


def run(args: argparse.Namespace, comm, parser: argparse.ArgumentParser) -> list | None:
    """Run the sweep. Collective. Returns the records (best first) on rank 0."""
    from .. import comm as C
    from ..parallel.sweeps import groups, sweep
    n, spare = groups(comm.size, args.ranks_per_trial)
    plan = {"train": args.train, "trials": args.trials}
    kept = C.root_decides(comm, _start, args.out, plan, args.resume)
    if comm.rank == 0:
        print(f"sweep: {len(args.trials)} trials ({len(kept)} done before) on {n} group"
              f"{'s' if n > 1 else ''} of {args.ranks_per_trial} rank"
              f"{'s' if args.ranks_per_trial > 1 else ''}" + (
                  f"; {spare} spare rank{'s' if spare > 1 else ''} left idle" if spare else ""),
              flush=True)
    records = sweep(comm, args.trials, ranks_per_trial=args.ranks_per_trial,
                    train=_trainer(parser, args), skip=kept, on_result=_recorder(args))
    try:
        return None if records is None else _finish(args, [*kept.values(), *records])
    finally:
        while _held:
            _held.pop().close()


def _start(out: str, plan: dict, resume: bool) -> dict[int, dict]:
    """Rank 0: claim ``out`` for the sweep (``plan``), or check it is the sweep a resume
    continues; returns its finished trials by index."""
    path = os.path.join(out, PLAN)
    run = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
    if run and not os.path.exists(path):
        raise MpidpError(f"--out {out} holds a run of mpidp train ({run[0]}), not a sweep: "
                         "give another --out")
    check_folder(out, "--out")
    os.makedirs(out, exist_ok=True)
    _lock(out)
    if os.path.exists(path):
        if not resume:
            raise MpidpError(f"--out {out} holds a sweep already: add --resume to continue "
                             "it, or give another --out")
        with open(path) as f:
            if json.load(f) != plan:
                raise MpidpError(f"the sweep in --out {out} has other trials or train "
                                 "options: resume it with the same ones, or give another --out")
    write_atomic(path, lambda f: f.write(json.dumps(plan, indent=1).encode()))
    records = {i: _read(os.path.join(folder(out, i), TRIAL)) for i in range(len(plan["trials"]))}
    return {i: r for i, r in records.items() if r and r.get("status") == "ok"}


#: The files of a run of ``mpidp train``: a folder holding one is not a sweep's.
RUN_FILES = ("metrics.json", "model.npz", "history.jsonl")
_held: list = []  # rank 0: the open lock file of the sweep running into --out


def _lock(out: str) -> None:
    """Rank 0: hold ``OUT/sweep.lock`` for the rest of the sweep (the system lets it go
    when the process ends, however it ends); MpidpError while another sweep holds it."""
    import fcntl
    f = open(os.path.join(out, "sweep.lock"), "a")  # noqa: SIM115 - held until the end
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise MpidpError(f"--out {out}: another sweep is running into it; wait for it to "
                         "end, or give another --out") from None
    _held.append(f)


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _trainer(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """``train(group, trial, i)`` for :func:`~mpidp.parallel.sweeps.sweep`: ``mpidp train``
    with the sweep's train options and the trial's, into the trial's folder. Collective
    over ``group``; returns the trial's figures on its rank 0."""
    from .train import train
    command = subcommand(parser, "train")
    base_args = parser.parse_args(["train", *args.train])

    def run_trial(group, trial: dict, i: int) -> dict | None:
        try:
            typed = [*args.train, *tokens(trial, command, source=f"trial {i}")]
        except ValueError as exc:
            raise MpidpError(str(exc)) from None
        typed += ["--out", folder(args.out, i)]
        if base_args.checkpoint_dir:  # the trial's own checkpoints
            typed += ["--checkpoint-dir", folder(base_args.checkpoint_dir, i),
                      *(["--resume"] if args.resume else [])]
        try:
            targs = parser.parse_args(["train", *typed])
        except SystemExit:
            raise MpidpError(f"trial {i}: its options are refused (said above)") from None
        if problem := refusal(targs, command):
            raise MpidpError(f"trial {i}: {problem}")
        metrics = train(targs, group, settings.settle(targs, command, typed))
        return None if metrics is None else figures(metrics)
    return run_trial


def figures(metrics: dict) -> dict:
    """A finished run's figures (:data:`FIGURES`) at its last epoch, the best of each over
    its epochs (``best_val_loss`` ...) and its seconds."""
    history = metrics["history"]
    out = {k: history[-1].get(k) for k in FIGURES if history[-1].get(k) is not None}
    for k in FIGURES:
        seen = [h[k] for h in history if h.get(k) is not None]
        if seen:
            out[f"best_{k}"] = min(seen) if k.endswith("loss") else max(seen)
    return {**out, "wall_s": metrics["wall_s"]}


def _recorder(args: argparse.Namespace):
    """On a group's rank 0 as each trial ends: say it, and write its trial.json."""
    def record(r: dict) -> None:
        r["settings"] = args.trials[r["index"]]
        r["folder"] = folder(args.out, r["index"])
        os.makedirs(r["folder"], exist_ok=True)
        write_atomic(os.path.join(r["folder"], TRIAL),
                     lambda f: f.write(json.dumps(r, indent=1).encode()))
        said = (", ".join(f"{k} {v:.4g}" for k, v in (r.get("result") or {}).items()
                          if k in FIGURES[2:]) if r["status"] == "ok" else r["error"])
        print(f"sweep: trial {r['index']} ({_settings(r)}) on ranks {r['ranks'][0]}-"
              f"{r['ranks'][1]}: {r['status']}, {said} ({r['seconds']:.1f}s)", flush=True)
    return record


def _settings(r: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in r["settings"].items())


def ranked(records: list[dict], metric: str) -> list[dict]:
    """``records`` best first by ``metric`` (a loss lowest first, else highest), then the
    finished trials without it, then the failed ones; each in trial order among equals."""
    def key(r: dict):
        v = (r.get("result") or {}).get(metric)
        if r["status"] != "ok":
            return (2, 0.0, r["index"])
        if v is None or v != v:
            return (1, 0.0, r["index"])
        return (0, v if metric.endswith("loss") else -v, r["index"])
    return sorted(records, key=key)


def _finish(args: argparse.Namespace, records: list[dict]) -> list[dict]:
    """Rank 0: write sweep.json and sweep.csv, print the table; the records, best first."""
    ok = [r.get("result") or {} for r in records if r["status"] == "ok"]
    metric = args.select or next((m for m in SELECT_DEFAULTS if any(m in r for r in ok)),
                                 SELECT_DEFAULTS[0])
    records = ranked(records, metric)
    best = records[0] if records[0]["status"] == "ok" and metric in (
        records[0].get("result") or {}) else None
    names = list(dict.fromkeys(k for r in records for k in r["settings"]))
    cols = list(dict.fromkeys(k for r in records for k in (r.get("result") or {})))
    rows = [{"trial": r["index"], "status": r["status"],
             **{k: r["settings"].get(k, "") for k in names},
             **{k: (r.get("result") or {}).get(k, "") for k in cols},
             "seconds": round(r["seconds"], 3), "folder": r["folder"],
             "error": r.get("error", "")} for r in records]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    summary = {"select": metric, "best": best and {"trial": best["index"],
                                                  "folder": best["folder"],
                                                  metric: best["result"][metric]},
               "trials": records}
    path = os.path.join(args.out, RESULTS)
    write_atomic(path + ".json", lambda f: f.write(json.dumps(summary, indent=1).encode()))
    write_atomic(path + ".csv", lambda f: f.write(text.getvalue().encode()))
    shown = list(dict.fromkeys(["trial", "status", *names,
                                *(c for c in (metric, *FIGURES[2:]) if c in cols), "seconds"]))
    cells = [[_cell(row[c]) for c in shown] for row in rows]
    widths = [max(len(c), *(len(r[j]) for r in cells)) for j, c in enumerate(shown)]
    print("  ".join(c.rjust(w) for c, w in zip(shown, widths)))
    for row, r in zip(cells, records):
        line = "  ".join(c.rjust(w) for c, w in zip(row, widths))
        print(line + (f"  {r['error']}" if r["status"] != "ok" else ""))
    print(f"best by {metric}: " + (f"trial {best['index']} ({_settings(best)}) in "
                                   f"{best['folder']}" if best else
                                   f"none (no finished trial records {metric})") +
          f"\nwrote {path}.json, {path}.csv", flush=True)
    failed = sum(r["status"] != "ok" for r in records)
    if failed:
        print(f"mpidp: {failed} of {len(records)} trials failed", file=sys.stderr, flush=True)
    return records


def _cell(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
