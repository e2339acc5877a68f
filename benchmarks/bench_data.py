"""``make bench-data``: how fast mpidp distributes a data set, against hand-written code.

Generates float32 data sets (784 features, int64 labels) of a few sizes in each supported
file format (folder of ``.npy``, uncompressed ``.npz``, ``.h5`` when h5py is installed) plus
the generated sparse ``bow`` source, under a temporary folder that is removed afterwards.
For P = 1, 2, 4 one ``mpiexec`` job per data set measures, after a warm-up and in a new
seeded random order each repeat (what ran just before changes how fast memory comes):

- ``scatter`` / ``local`` / ``local-copy``: ``mpidp.load`` (``--test-fraction 0``, block
  partition; ``local`` maps each rank's rows from the file where it can, ``local-copy``
  reads them into private memory, as ``--copy-data``), the time from start to the first
  training step (between barriers, slowest rank), split into ``open``, ``read``,
  ``check``, ``cast``, ``send`` (root's phases for scatter, the slowest rank's for local),
  and each rank's peak anonymous memory (``RssAnon``, page cache and MPI shared memory not
  counted) above what it held before;
- ``hand-scatter``: root memory-maps X (h5py slices for ``.h5``) and sends the same rows
  with a plain streamed ``Scatterv`` in rounds of 32,768 rows per rank, targets after;
- ``hand-local``: each rank reads its own rows with one plain read (``readinto`` at the
  array's offset; h5py ``read_direct`` for ``.h5``);
- ``predict-write`` / ``hand-write``: per-row outputs as wide as the input written to one
  ``.npy`` by every rank through ``mpidp.map_reduce(..., out=...)``, against each rank
  writing its own rows with one ``pwrite``; before each run the previous output is
  removed and ``os.sync()`` runs, so no write-back of an earlier gigabyte competes.

Medians over ``--repeats``. Writes ``<out>.json``, ``<out>.md`` and ``<out>.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from benchmarks.harness import command, cpu_model, git_commit, quick_defaults

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
N_FEATURES = 784
HAND_ROUND_ROWS = 32768
PHASES = ("open", "read", "check", "cast", "send")
MODES = ("scatter", "hand-scatter", "local", "local-copy", "hand-local", "predict-write",
         "hand-write")
LOADS = ("scatter", "local", "local-copy")  # the modes that are mpidp.load
#: The code these figures depend on: a commit is "+dirty" when any of it is uncommitted.
MEASURED_CODE = ("mpidp/data", "mpidp/comm", "mpidp/parallel/mapreduce.py",
                 "benchmarks/bench_data.py", "benchmarks/bench_data_report.py")
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


# ----------------------------------------------------------------------------- memory

def rss_anon_kib() -> int:
    """This process's resident anonymous memory in KiB (no page cache, no shared memory)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    return 0


class PeakAnon:
    """Samples ``RssAnon`` every millisecond in a thread; ``peak_mib`` is the largest rise
    above the value at start (numpy copies and MPI calls release the GIL, so it runs)."""

    def __init__(self) -> None:
        self.base = self.peak = rss_anon_kib()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.001):
            self.peak = max(self.peak, rss_anon_kib())

    def __enter__(self) -> PeakAnon:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, rss_anon_kib())

    @property
    def peak_mib(self) -> float:
        return (self.peak - self.base) / 1024


# ----------------------------------------------------------------------------- data sets

def make_datasets(folder: Path, size_mb: float, formats: Sequence[str], seed: int = 0) -> dict:
    """Write one ``size_mb`` float32 data set in each file format; returns ``{fmt: path}``."""
    n = max(8, int(size_mb * 2**20) // (N_FEATURES * 4))
    base = folder / f"{size_mb:g}mb"
    base.mkdir(parents=True, exist_ok=True)
    X = np.lib.format.open_memmap(base / "X.npy", "w+", np.float32, (n, N_FEATURES))
    rng = np.random.default_rng(seed)
    for lo in range(0, n, 16384):
        X[lo:lo + 16384] = rng.standard_normal((min(16384, n - lo), N_FEATURES), np.float32)
    X.flush()
    y = rng.integers(0, 10, n)
    np.save(base / "y.npy", y)
    paths = {"npy": str(base)}
    if "npz" in formats:
        np.savez(str(base) + ".npz", X=X, y=y)  # stored (uncompressed): memory-mapped
        paths["npz"] = str(base) + ".npz"
    if "h5" in formats:
        try:
            import h5py
        except ImportError:
            pass
        else:
            with h5py.File(str(base) + ".h5", "w") as f:
                f.create_dataset("X", data=X)
                f.create_dataset("y", data=y)
            paths["h5"] = str(base) + ".h5"
    del X
    return {k: v for k, v in paths.items() if k in formats}


# ----------------------------------------------------------------------------- worker

def _raw_X(path: str):
    """``(X, y)`` as plain memmaps (``.npy``/``.npz``) or h5py datasets, without mpidp."""
    if os.path.isdir(path):
        return (np.load(os.path.join(path, "X.npy"), mmap_mode="r"),
                np.load(os.path.join(path, "y.npy"), mmap_mode="r"))
    if path.endswith(".h5"):
        import h5py
        f = h5py.File(path, "r")
        return f["X"], f["y"]
    import zipfile
    out = []
    with zipfile.ZipFile(path) as zf, open(path, "rb") as fh:
        for key in ("X", "y"):
            info = zf.getinfo(key + ".npy")
            fh.seek(info.header_offset + 26)
            skip = int.from_bytes(fh.read(2), "little") + int.from_bytes(fh.read(2), "little")
            fh.seek(info.header_offset + 30 + skip)
            np.lib.format.read_magic(fh)
            shape, _, dtype = np.lib.format.read_array_header_1_0(fh)
            out.append(np.memmap(path, dtype, "r", offset=fh.tell(), shape=shape))
    return tuple(out)


def hand_scatter(comm, path: str) -> None:
    """Root memory-maps X and y and Scatterv's each rank's block in rounds of rows."""
    from mpi4py import MPI
    X = y = None
    if comm.rank == 0:
        X, y = _raw_X(path)
        n = comm.bcast(len(X))
    else:
        n = comm.bcast(None)
    counts = np.array([n // comm.size + (r < n % comm.size) for r in range(comm.size)])
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    out = np.empty((counts[comm.rank], N_FEATURES), np.float32)
    for lo in range(0, int(counts.max()), HAND_ROUND_ROWS):
        take = np.clip(counts - lo, 0, HAND_ROUND_ROWS)
        send = None
        if comm.rank == 0:
            buf = np.concatenate([X[d + lo:d + lo + t] for d, t in zip(displs, take)])
            sd = np.concatenate([[0], np.cumsum(take)[:-1]])
            send = [buf, (take * N_FEATURES, sd * N_FEATURES), MPI.FLOAT]
        mine = int(take[comm.rank])
        comm.Scatterv(send, [out[lo:lo + mine], mine * N_FEATURES, MPI.FLOAT], root=0)
    ys = np.empty(counts[comm.rank], np.int64)
    comm.Scatterv([np.ascontiguousarray(y), (counts, displs), MPI.INT64_T] if comm.rank == 0
                  else None, [ys, MPI.INT64_T], root=0)


def hand_local(comm, path: str) -> None:
    """Each rank reads its own block of rows with one plain read."""
    X, y = _raw_X(path)
    n = len(X)
    start = comm.rank * (n // comm.size) + min(comm.rank, n % comm.size)
    count = n // comm.size + (comm.rank < n % comm.size)
    outs = [np.empty((count, N_FEATURES), np.float32), np.empty(count, np.int64)]
    for a, out in zip((X, y), outs):
        if isinstance(a, np.memmap):
            with open(a.filename, "rb", buffering=0) as f:
                f.seek(a.offset + start * out[:1].nbytes)
                f.readinto(memoryview(out).cast("B"))
        else:
            a.read_direct(out, np.s_[start:start + count])


def predict_write(comm, path: str, out: str, chunk_size: int = 512) -> None:
    """mpidp's map_reduce writing input-wide per-row outputs into one .npy (as predict)."""
    import mpidp
    n = int(comm.bcast(len(_raw_X(path)[0]) if comm.rank == 0 else None))
    rows = np.zeros((n, 1), np.int8)  # the map's input: only the row count matters
    block = np.ones((chunk_size, N_FEATURES), np.float32)
    mpidp.map_reduce(comm, lambda r: block[:len(r)], rows, "concat", out=out,
                     chunk_size=chunk_size)


def hand_write(comm, path: str, out: str, chunk_size: int = 512) -> None:
    """Root creates the .npy; every rank pwrites its own block of rows, ``chunk_size`` rows
    per call from one reused buffer (as the map hands out rows), then root renames it."""
    n = int(comm.bcast(len(_raw_X(path)[0]) if comm.rank == 0 else None))
    tmp = out + ".part"
    if comm.rank == 0:
        np.lib.format.open_memmap(tmp, "w+", np.float32, (n, N_FEATURES)).flush()
    comm.Barrier()
    start = comm.rank * (n // comm.size) + min(comm.rank, n % comm.size)
    count = n // comm.size + (comm.rank < n % comm.size)
    block = np.ones((chunk_size, N_FEATURES), np.float32)
    offset = np.load(tmp, mmap_mode="r").offset + start * N_FEATURES * 4
    fd = os.open(tmp, os.O_WRONLY)
    for lo in range(0, count, chunk_size):
        m = min(chunk_size, count - lo)
        os.pwrite(fd, memoryview(block[:m]).cast("B"), offset + lo * N_FEATURES * 4)
    os.close(fd)
    comm.Barrier()
    if comm.rank == 0:
        os.replace(tmp, out)


def one_run(comm, mode: str, path: str, scratch: str) -> dict:
    """Run ``mode`` once between barriers; this rank's figures."""
    import mpidp
    timings: dict = {}
    if mode in ("predict-write", "hand-write") and comm.rank == 0:
        for name in ("pred.npy", "hand.npy"):  # each run writes a new file, and no write-back
            with contextlib.suppress(FileNotFoundError):  # of the previous run's gigabyte
                os.remove(os.path.join(scratch, name))  # competes with it
        os.sync()
    comm.Barrier()
    with PeakAnon() as mem:
        t0 = time.perf_counter()
        if mode in LOADS:
            kw = {"n_samples": 20000, "n_features": 2000} if path == "bow" else {}
            data = mpidp.load(comm, path, distribute=mode.split("-")[0], test_fraction=0.0,
                              timings=timings, copy=mode == "local-copy", **kw)
            X = data.train.X
            shard_bytes = data.train.y.nbytes + (X.nbytes if isinstance(X, np.ndarray) else
                                                 X.indptr.nbytes + X.indices.nbytes + X.data.nbytes)
        elif mode == "hand-scatter":
            hand_scatter(comm, path)
        elif mode == "hand-local":
            hand_local(comm, path)
        elif mode == "predict-write":
            predict_write(comm, path, os.path.join(scratch, "pred.npy"))
        else:
            hand_write(comm, path, os.path.join(scratch, "hand.npy"))
        comm.Barrier()
        seconds = time.perf_counter() - t0
    data = None
    return {"seconds": seconds, "peak_anon_mib": mem.peak_mib, **timings,
            **({"shard_mib": shard_bytes / 2**20} if mode in LOADS else {})}


def worker(args) -> None:
    import mpidp.comm as C
    comm = C.world()
    modes = args.modes.split(",")
    runs: dict = {m: [] for m in modes}
    for rep in range(args.repeats + 1):  # repeat 0 is the warm-up
        for m in (modes[i] for i in np.random.default_rng(rep).permutation(len(modes))):
            res = comm.gather(one_run(comm, m, args.path, args.scratch), root=0)
            if rep and comm.rank == 0:
                runs[m].append(res)
    if comm.rank == 0:
        Path(args.json).write_text(json.dumps({"P": comm.size, "runs": runs}))


# ----------------------------------------------------------------------------- driver

def summarize(runs: list[list[dict]], mode: str) -> dict:
    """Median over repeats of the slowest rank's time, phases and memory per rank."""
    secs = [max(r["seconds"] for r in rep) for rep in runs]
    i = int(np.argsort(secs)[len(secs) // 2])  # the median repeat, for its phases
    rep = runs[i]
    who = 0 if mode == "scatter" else int(np.argmax([r["seconds"] for r in rep]))
    if mode in ("local", "local-copy"):  # the slowest reader
        who = int(np.argmax([sum(r.get(p, 0.0) for p in PHASES) for r in rep]))
    out = {"seconds": float(np.median(secs)), "repeats": secs,
           "phases": {p: float(rep[who].get(p, 0.0)) for p in PHASES},
           "peak_anon_mib": [float(np.median([r[k]["peak_anon_mib"] for r in runs]))
                             for k in range(len(rep))]}
    if "shard_mib" in rep[0]:
        out["shard_mib"] = [r["shard_mib"] for r in rep]
    return out


def run_job(args, path: str, P: int, modes: Sequence[str], scratch: str) -> dict:
    out = os.path.join(scratch, f"res-{P}.json")
    cmd = ["timeout", str(args.job_timeout), args.mpiexec, "-n", str(P), sys.executable,
           "-m", "benchmarks.bench_data", "--worker", "--path", path, "--modes", ",".join(modes),
           "--repeats", str(args.repeats), "--json", out, "--scratch", scratch]
    env = {**os.environ, **ENV}
    env.pop("OPENBLAS_CORETYPE", None)
    env.pop("OPENBLAS_L2_SIZE", None)
    subprocess.run(cmd, check=True, env=env, cwd=REPO)
    raw = json.loads(Path(out).read_text())
    return {m: summarize(raw["runs"][m], m) for m in modes}


def machine() -> dict:
    try:
        from threadpoolctl import threadpool_info
        blas = [f"{i.get('internal_api')} {i.get('architecture')}" for i in threadpool_info()]
    except ImportError:
        blas = ["threadpoolctl not installed"]
    return {"nproc": os.cpu_count(), "cpu": cpu_model(), "commit": git_commit(MEASURED_CODE),
            "python": platform.python_version(), "numpy": np.__version__, "blas": blas,
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)}


def measure(args) -> dict:
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    formats = args.formats.split(",")
    ranks = [int(p) for p in args.ranks.split(",")]
    cells = []
    root = Path(tempfile.mkdtemp(prefix="mpidp-bench-data-", dir=args.data_dir))
    try:
        for size in sizes:
            paths = make_datasets(root, size, formats)
            for fmt, path in paths.items():
                for P in ranks:
                    print(f"bench-data: {size:g} MB {fmt} P={P}", flush=True)
                    os.sync()  # no write-back of earlier files under the measured reads
                    res = run_job(args, path, P, ["scatter", "hand-scatter", "local",
                                                  "local-copy", "hand-local"], str(root))
                    if fmt == "npy":  # writes in a job of their own, after the reads
                        res.update(run_job(args, path, P, ["predict-write", "hand-write"],
                                           str(root)))
                    cells.append({"size_mb": size, "format": fmt, "P": P, "results": res})
            shutil.rmtree(root / f"{size:g}mb", ignore_errors=True)
            for ext in (".npz", ".h5"):
                Path(str(root / f"{size:g}mb") + ext).unlink(missing_ok=True)
        if "sparse" in formats:
            for P in ranks:
                print(f"bench-data: bow (sparse, generated) P={P}", flush=True)
                res = run_job(args, "bow", P, ["scatter", "local"], str(root))
                cells.append({"size_mb": None, "format": "sparse (bow)", "P": P, "results": res})
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"machine": machine(), "command": command("bench_data", args.argv),
            "cells": cells}


from benchmarks.bench_data_report import report  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", default="64,1024", help="data set sizes in MiB of X")
    p.add_argument("--formats", default="npy,npz,h5,sparse")
    p.add_argument("--ranks", default="1,2,4")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--mpiexec", default=str(REPO / ".venv" / "bin" / "mpiexec"))
    p.add_argument("--out", default=str(HERE / "results" / "data"))
    p.add_argument("--data-dir", default=None, help="where to put the generated data sets")
    p.add_argument("--job-timeout", type=int, default=600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    p.add_argument("--modes", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--scratch", help=argparse.SUPPRESS)
    quick_defaults(p, sizes_mb="4", ranks="1,2", repeats=1)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    args.argv = list(argv if argv is not None else sys.argv[1:])
    t0 = time.perf_counter()
    results = measure(args)
    results["total_s"] = time.perf_counter() - t0
    report(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
