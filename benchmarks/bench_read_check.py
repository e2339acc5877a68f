"""Where a local read's time goes: one plain read of a rank's rows against reading them
block by block with and without the NaN/Inf check, mapping them, and ``mpidp.load``
(rows mapped, copied, and scattered by a test split).

Run under MPI, e.g. (P = 2, 1 GiB of float32 rows, page-cached)::

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OPENBLAS_NUM_THREADS=1 \\
        .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/bench_read_check.py

Each rank reads its block of rows of one ``X.npy`` (written by rank 0 to a temporary
folder, removed afterwards). Variants take turns going first; the time of one repeat is
the slowest rank's, between barriers. Prints a Markdown table of medians.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import numpy as np

N_FEATURES = 784


def _write(folder: str, size_mb: int) -> None:
    n = size_mb * 2**20 // (N_FEATURES * 4)
    X = np.lib.format.open_memmap(os.path.join(folder, "X.npy"), "w+", np.float32,
                                  (n, N_FEATURES))
    rng = np.random.default_rng(0)
    for lo in range(0, n, 16384):
        X[lo:lo + 16384] = rng.standard_normal((min(16384, n - lo), N_FEATURES), np.float32)
    X.flush()
    np.save(os.path.join(folder, "y.npy"), rng.integers(0, 10, n))


class Rows:
    """This rank's block of rows of ``folder/X.npy``: file, byte offset, shape."""

    def __init__(self, comm, folder: str) -> None:
        X = np.load(os.path.join(folder, "X.npy"), mmap_mode="r")
        n = len(X)
        lo, hi = comm.rank * n // comm.size, (comm.rank + 1) * n // comm.size
        self.path, self.shape = X.filename, (hi - lo, N_FEATURES)
        self.offset = X.offset + lo * N_FEATURES * 4

    def plain(self) -> np.ndarray:
        out = np.empty(self.shape, np.float32)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.offset)
            f.readinto(memoryview(out).cast("B"))
        return out

    def blocks(self, block_bytes: int, check: bool) -> np.ndarray:
        out = np.empty(self.shape, np.float32)
        step = max(1, block_bytes // (N_FEATURES * 4))
        fd, finite = os.open(self.path, os.O_RDONLY), True
        try:
            for a in range(0, len(out), step):
                block = out[a:a + step]
                os.preadv(fd, [memoryview(block).cast("B")], self.offset + a * N_FEATURES * 4)
                if check:
                    flat = block.reshape(-1)
                    finite &= bool(np.isfinite(np.dot(flat, flat)))
        finally:
            os.close(fd)
        assert finite
        return out

    def view(self) -> np.ndarray:
        """No copy: the rows as a read-only memory map, checked in place."""
        import mmap
        start = self.offset // mmap.PAGESIZE * mmap.PAGESIZE
        nbytes = self.shape[0] * self.shape[1] * 4
        fd = os.open(self.path, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, self.offset - start + nbytes, mmap.MAP_SHARED, mmap.PROT_READ,
                           offset=start)
        finally:
            os.close(fd)
        src = np.frombuffer(mm, np.float32, nbytes // 4, self.offset - start).reshape(self.shape)
        flat = src.reshape(-1)
        assert np.isfinite(np.dot(flat, flat))
        return src

    def mapped(self, block_bytes: int) -> np.ndarray:
        """Copy from a memory map of the rows (page tables filled first where the kernel
        can), then check each block while the copy is in the cache."""
        import mmap
        out = np.empty(self.shape, np.float32)
        start = self.offset // mmap.PAGESIZE * mmap.PAGESIZE
        fd = os.open(self.path, os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, self.offset - start + out.nbytes, mmap.MAP_SHARED,
                           mmap.PROT_READ, offset=start)
        finally:
            os.close(fd)
        try:
            mm.madvise(getattr(mmap, "MADV_POPULATE_READ", 22))  # Linux 5.14+
        except OSError:
            pass
        src = np.frombuffer(mm, np.float32, out.size, self.offset - start).reshape(self.shape)
        step, finite = max(1, block_bytes // (N_FEATURES * 4)), True
        for a in range(0, len(out), step):
            np.copyto(out[a:a + step], src[a:a + step])
            flat = out[a:a + step].reshape(-1)
            finite &= bool(np.isfinite(np.dot(flat, flat)))
        del src
        mm.close()
        assert finite
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dir", default=None, help="where to write the data set")
    args = p.parse_args()
    import mpidp
    import mpidp.comm as C
    comm = C.world()
    folder = comm.bcast(tempfile.mkdtemp(prefix="mpidp-read-check-", dir=args.dir)
                        if comm.rank == 0 else None)
    try:
        if comm.rank == 0:
            _write(folder, args.size_mb)
        comm.Barrier()
        rows = Rows(comm, folder)
        cases = {"one plain read (readinto)": rows.plain}
        for kib in (256, 1024, 4096):
            cases[f"preadv per {kib} KiB, no check"] = (
                lambda k=kib: rows.blocks(k << 10, False))
            cases[f"preadv per {kib} KiB + dot check"] = (
                lambda k=kib: rows.blocks(k << 10, True))
        cases["memory map, copy + dot check per 256 KiB"] = lambda: rows.mapped(256 << 10)
        cases["memory map, no copy, dot check"] = lambda: rows.view()
        cases["mpidp.load(distribute='local'): mapped"] = lambda: mpidp.load(
            comm, folder, distribute="local", test_fraction=0.0)
        cases["mpidp.load(distribute='local', copy=True)"] = lambda: mpidp.load(
            comm, folder, distribute="local", test_fraction=0.0, copy=True)
        cases["mpidp.load(distribute='local', test_fraction=0.2): scattered rows, copied"] = (
            lambda: mpidp.load(comm, folder, distribute="local", test_fraction=0.2))
        times: dict[str, list[float]] = {k: [] for k in cases}
        for rep in range(args.repeats + 1):  # repeat 0 warms up
            for name in (list(cases) if rep % 2 else list(cases)[::-1]):
                comm.Barrier()
                t = time.perf_counter()
                got = cases[name]()
                comm.Barrier()
                seconds = float(C.allreduce_max(comm, [time.perf_counter() - t])[0])
                del got
                if rep:
                    times[name].append(seconds)
        if comm.rank == 0:
            from threadpoolctl import threadpool_info
            blas = ", ".join(f"{i.get('internal_api')} {i.get('architecture')}"
                             for i in threadpool_info())
            base = float(np.median(times["one plain read (readinto)"]))
            print(f"P = {comm.size}, {args.size_mb} MiB of X, {args.repeats} repeats, "
                  f"nproc {os.cpu_count()}, BLAS {blas}\n")
            print("| each rank reads its rows | median s | min s | / plain read |")
            print("|---|---|---|---|")
            for name, t in times.items():
                print(f"| {name} | {np.median(t):.3f} | {min(t):.3f} | "
                      f"{np.median(t) / base:.2f} |")
    finally:
        comm.Barrier()
        if comm.rank == 0:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
