"""Live metrics of a run: ``history.jsonl`` (one JSON object per line, each flushed whole,
epoch lines fsync'ed: a killed job keeps them all, for ``mpidp plot``) and, optionally,
TensorBoard scalars. Written on the root rank only; no MPI here. A line is ``{"kind":
"config" | "epoch" | "steps", ...}``: numbers and strings, per-rank figures as lists
indexed by rank, non-finite floats as ``null``."""

from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any

from ..atomic import write_error
from ..errors import setting


def need_tensorboard() -> ValueError:
    """The error when TensorBoard output is asked for without its package."""
    return ValueError(f"{setting('tensorboard')} needs the tensorboardX package: pip install "
                      f"'mpidp[tensorboard]' (or pip install tensorboardX)")


def _clean(v: Any) -> Any:
    """``v`` with non-finite floats as None, NumPy scalars/arrays as Python values."""
    if hasattr(v, "tolist"):
        v = v.tolist()
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {str(k): _clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_clean(x) for x in v]
    return v


def derived(record: dict) -> dict:
    """``comm_share`` (communication seconds over all seconds, summed over ranks) and
    ``imbalance`` (slowest rank's compute over the mean) from the per-rank lists
    ``compute_s``, ``comm_s``, ``wait_s``; empty when ``record`` lacks ``compute_s``."""
    compute = record.get("compute_s")
    if not isinstance(compute, (list, tuple)) or not compute:
        return {}
    comm = record.get("comm_s") or []
    total = sum(compute) + sum(comm) + sum(record.get("wait_s") or [])
    mean = sum(compute) / len(compute)
    return {"comm_share": sum(comm) / total if total > 0 else 0.0,
            "imbalance": max(compute) / mean if mean > 0 else 1.0}


class History:
    """Appends records to ``path_jsonl`` (truncated unless ``append``), mirrored to
    TensorBoard event files in ``tensorboard_dir`` when given. A failed write raises
    :class:`mpidp.atomic.WriteError` naming the file and ``what``, the setting naming it."""

    def __init__(self, path_jsonl: str, tensorboard_dir: str | None = None,
                 append: bool = False, what: str | None = None) -> None:
        self.path, self.what = path_jsonl, what
        self.writer, self._failed = None, False
        if tensorboard_dir is not None:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                raise need_tensorboard() from None
            os.makedirs(tensorboard_dir, exist_ok=True)
            self.writer = SummaryWriter(logdir=tensorboard_dir)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path_jsonl)), exist_ok=True)
            self._f = open(path_jsonl, "a" if append else "w", encoding="utf-8")
        except OSError as exc:
            raise self._error(exc) from None

    def _write(self, kind: str, record: dict, sync: bool) -> dict:
        rec = {"kind": kind, **_clean(record)}
        rec.update({k: v for k, v in derived(rec).items() if k not in rec})
        try:
            self._f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            self._f.flush()
            if sync:
                os.fsync(self._f.fileno())
        except OSError as exc:
            self._failed = True  # said once: close() does not raise it again
            raise self._error(exc) from None
        return rec

    def _error(self, exc: OSError):
        return write_error(exc, self.path, self.what and setting(self.what))

    def config(self, config: dict) -> None:
        """Write the run's configuration (first, once): ``mpidp plot`` labels a killed run
        from it. Keys as in ``metrics.json``'s ``config`` (``sync``, ``world_size`` ...)."""
        self._write("config", config, True)

    def epoch(self, record: dict) -> None:
        """Append one finished epoch (must hold ``epoch``; usually ``loss``, ``accuracy``,
        ``seconds``, ``elapsed_s``, ``samples_per_s``, test figures, per-rank lists)."""
        rec = self._write("epoch", record, True)
        self._scalars("epoch", rec, int(rec.get("epoch", 0)))

    def steps(self, record: dict) -> None:
        """Append one record of the last ``log_every`` steps (must hold ``step``; usually ``epoch``,
        ``loss``, ``samples_per_s`` and the per-rank lists over the last N steps)."""
        rec = self._write("steps", record, False)
        self._scalars("step", rec, int(rec.get("step", 0)))

    def _scalars(self, prefix: str, rec: dict, x: int) -> None:
        """Every number of ``rec`` as ``prefix/key`` (lists: ``prefix/key/rank<r>``)."""
        if self.writer is None:
            return
        for key, v in rec.items():
            if key in ("kind", "epoch", "step"):
                pass
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                self.writer.add_scalar(f"{prefix}/{key}", v, x)
            elif isinstance(v, list) and all(isinstance(y, (int, float)) for y in v):
                for r, y in enumerate(v):
                    self.writer.add_scalar(f"{prefix}/{key}/rank{r}", y, x)
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the files (safe twice; after a failed write, raises nothing more)."""
        if not self._f.closed:
            try:
                self._f.flush()
                os.fsync(self._f.fileno())
            except OSError as exc:
                if not self._failed:
                    self._failed = True
                    raise self._error(exc) from None
            finally:
                with contextlib.suppress(OSError):
                    self._f.close()  # closed even where its flush fails
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def __enter__(self) -> History:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read(path: str) -> list[dict]:
    """The records of a ``history.jsonl``, in order, skipping a last line cut short by a
    kill; ValueError naming the file and line for any other not a JSON object in UTF-8."""
    out = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise ValueError(f"{path}, line {number}: not UTF-8 text (byte "
                                 f"0x{raw[exc.start]:02x}); {_DAMAGED}") from None
            except json.JSONDecodeError as exc:
                if not raw.endswith(b"\n"):
                    continue  # the last line, cut short
                exc.args = (f"{path}, line {number}: not a JSON record ({exc.msg} at "
                            f"column {exc.colno}); {_DAMAGED}",)
                raise exc from None  # still a JSONDecodeError, its text naming the file
            if not isinstance(record, dict):
                raise ValueError(f"{path}, line {number}: not a JSON object but "
                                 f"{type(record).__name__} {raw.decode().strip()[:40]}; "
                                 f"{_DAMAGED}")
            out.append(record)
    return out


#: The fix for a damaged history line.
_DAMAGED = "the file is damaged there: delete that line (or fix it) and try again"
