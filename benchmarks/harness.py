"""What every benchmark shares: the ranks' environment, jobs timed once the CPUs are quiet,
runs taken side by side with the hand-written loop and their paired ratios, the record of
where a figure was measured (machine, BLAS kernel, commit) and the results files.

Set ``MPIDP_BENCH_QUICK=1`` for a smoke run: drivers shrink their repeats and sizes with
:func:`quick`, so a target finishes in about a minute (its figures are not measurements).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
HISTORY = RESULTS / "history.jsonl"
THREAD_ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
DROP_ENV = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
T = TypeVar("T")
BUSY_WARN = 0.10  # share of the CPUs that other work may use before timings are suspect


def quick(normal, smoke):
    """``smoke`` under ``MPIDP_BENCH_QUICK=1``, else ``normal``."""
    return smoke if os.environ.get("MPIDP_BENCH_QUICK", "") not in ("", "0") else normal


def quick_defaults(parser, **smoke) -> None:
    """Under ``MPIDP_BENCH_QUICK=1``, ``smoke`` become ``parser``'s defaults (fewer repeats,
    smaller sizes); options given on the command line still win."""
    if quick(False, True):
        parser.set_defaults(**smoke)


def bench_env() -> tuple[dict[str, str], list[str]]:
    """The ranks' environment (one BLAS thread, this repository importable as ``benchmarks``),
    and which OpenBLAS variables were removed from it."""
    env = {**os.environ, **THREAD_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    dropped = [v for v in DROP_ENV if env.pop(v, None) is not None]
    return env, dropped


def module(name: str, python: str = sys.executable) -> list[str]:
    """The command that runs benchmark module ``name`` (with :func:`bench_env`'s environment)."""
    return [python, "-m", f"benchmarks.{name}"]


def cpu_ticks() -> tuple[int, int] | None:
    """``(total, busy)`` clock ticks of all CPUs since boot (/proc/stat; None if unreadable)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(t) for t in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    if len(ticks) < 5:
        return None
    return sum(ticks), sum(ticks) - ticks[3] - ticks[4]  # idle and iowait are not busy


def wait_quiet(max_wait: float, interval: float = 1.0) -> float | None:
    """Wait (up to ``max_wait`` seconds) until under ``BUSY_WARN`` of the CPUs are busy;
    return the last busy share measured (None where /proc/stat is unreadable)."""
    deadline = time.monotonic() + max_wait
    while True:
        t0 = cpu_ticks()
        time.sleep(interval)
        t1 = cpu_ticks()
        if t0 is None or t1 is None:
            return None
        busy = (t1[1] - t0[1]) / max(t1[0] - t0[0], 1)
        if busy <= BUSY_WARN or time.monotonic() >= deadline:
            return busy


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def other_cpus(ticks0: tuple[int, int] | None, own0: float, wall: float) -> float | None:
    """CPUs used on average by processes other than our jobs since ``ticks0``/``own0``."""
    ticks1 = cpu_ticks()
    if ticks0 is None or ticks1 is None:
        return None
    busy_s = (ticks1[1] - ticks0[1]) / os.sysconf("SC_CLK_TCK")
    return max(busy_s - (children_cpu_s() - own0), 0.0) / wall


def short(path: str) -> str:
    """``path`` relative to the repository when it lies below it."""
    try:
        rel = os.path.relpath(path, REPO)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


def shown(cmd: Sequence[str]) -> str:
    """A job's command as a shell line, with the environment :func:`bench_env` gives it."""
    return " ".join(["env", *(f"-u {v}" for v in DROP_ENV),
                     *(f"{k}={v}" for k, v in THREAD_ENV.items()),
                     shlex.join(short(str(c)) for c in cmd)])


def command(name: str, argv: Sequence[str] | None = None) -> str:
    """How benchmark module ``name`` was run, as a shell line (``argv``: its options)."""
    return shlex.join(["python", "-m", f"benchmarks.{name}",
                       *(short(a) for a in (sys.argv[1:] if argv is None else argv))])


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def least_disturbed(attempt: Callable[[], dict], retries: int, what: str) -> dict:
    """``attempt()`` (a dict with ``other_cpus_during``), again up to ``retries`` times
    while other processes used more than ``BUSY_WARN`` of the CPUs during it; the least
    disturbed result, with ``attempts``."""
    limit, best = BUSY_WARN * (os.cpu_count() or 1), None
    for i in range(retries + 1):
        result = attempt()
        result.setdefault("attempt", i + 1)
        other = result["other_cpus_during"]
        if best is None or (other or 0.0) < (best["other_cpus_during"] or 0.0):
            best = result
        if other is None or other <= limit:
            break
        print(f"WARNING: {what}: other processes used {other:.2f} CPUs during the job"
              + (f"; running it again ({i + 1}/{retries})" if i < retries
                 else "; its timings are suspect"), file=sys.stderr, flush=True)
    best["attempts"] = i + 1
    return best


class Jobs:
    """Runs ``mpiexec`` jobs in :func:`bench_env`'s environment, each in a process group of
    its own (a timeout kills every rank), and remembers their commands. ``args``: the
    driver's options, with ``timeout``, ``wait_quiet`` and ``retries`` (:meth:`timed`)."""

    def __init__(self, args) -> None:
        self.args, self.timeout = args, args.timeout
        self.env, self.dropped = bench_env()
        self.commands: list[str] = []

    def run(self, cmd: list[str], what: str) -> None:
        line = shown(cmd)
        if line not in self.commands:  # a timed job run again is listed once
            self.commands.append(line)
        print(f"$ {line}", flush=True)
        proc = subprocess.Popen(cmd, env=self.env, cwd=REPO, start_new_session=True)
        try:
            rc = proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{what}: no result within {self.timeout:.0f} s; job killed") from None
        if rc != 0:
            raise RuntimeError(f"{what}: the job exited with status {rc}")

    def timed(self, cmd: list[str], out: Path, what: str) -> dict:
        """Run a job that writes JSON to ``out`` once the CPUs go quiet, as
        :func:`least_disturbed` asks; its JSON with ``cpu_busy_before`` and
        ``other_cpus_during`` (how busy other work kept the machine before and during it)."""
        def attempt() -> dict:
            busy = wait_quiet(self.args.wait_quiet)
            ticks0, own0, t0 = cpu_ticks(), children_cpu_s(), time.monotonic()
            self.run(cmd, what)
            result = json.loads(Path(out).read_text())
            result["cpu_busy_before"] = busy
            result["other_cpus_during"] = other_cpus(ticks0, own0, time.monotonic() - t0)
            return result
        return least_disturbed(attempt, self.args.retries, what)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def git_commit(paths: Sequence[str] = ("mpidp", "benchmarks")) -> str:
    """The repository's commit, with ``+dirty`` when ``paths`` have changes (the results
    in benchmarks/results/ do not count: they are what the benchmarks write)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, timeout=30, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *paths,
                                ":(exclude)benchmarks/results"],
                               cwd=REPO, text=True, capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty.strip() else "")


def blas_info() -> list[dict] | str:
    """The BLAS libraries numpy loaded: kernel, version, architecture, threads (threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "threadpoolctl not installed"
    keys = ("internal_api", "version", "architecture", "num_threads", "threading_layer", "filepath")
    return [{k: d.get(k) for k in keys} for d in threadpool_info() if d.get("user_api") == "blas"]


def now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def alternate(runners: dict[str, Callable[[int], T]], repeats: int,
              first: int = 0) -> Iterator[dict[str, T]]:
    """Repeats ``first`` .. ``repeats - 1`` of ``runners`` side by side: each repeat calls
    every runner with the repeat's number, in an order that flips from one repeat to the
    next (so drift on the machine hits both alike); yields each repeat's results by name."""
    for r in range(first, repeats):
        names = list(runners)[::-1] if r % 2 else list(runners)
        got = {name: runners[name](r) for name in names}
        yield {name: got[name] for name in runners}


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> float:
    """The median of the ratios of runs taken side by side (see :func:`alternate`)."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def machine(env: dict, dropped: list[str], **extra) -> dict:
    """The record of a run from a rank's environment (``bench_step.environment``): machine,
    BLAS, MPI, versions, the OpenBLAS variables removed for the ranks, and the commit."""
    return {"nproc": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
            **extra, "blas": env["blas"], "openblas_env_removed": dropped,
            "openblas_env_seen_by_ranks": env["openblas_env_set"],
            "mpi_library": " ".join(env["mpi_library"].split()), "mpi4py": env["mpi4py"],
            "numpy": env["numpy"], "python": env["python"], "mpidp": env["mpidp"],
            "commit": git_commit()}


def blas_text(blas: list[dict] | str) -> str:
    """:func:`blas_info` as one line: kernel, version, architecture, threads."""
    if not isinstance(blas, list):
        return blas
    return "; ".join(f"{b['internal_api']} {b['version']} ({b['architecture']}, "
                     f"{b['num_threads']} thread(s))" for b in blas)


def write(out: Path, report: dict, markdown: str | None = None) -> list[Path]:
    """Write ``out``.json (and ``out``.md), and add a line to the results' history
    (benchmarks/results/history.jsonl) when ``out`` lies in benchmarks/results/."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = [out.with_suffix(".json")]
    paths[0].write_text(json.dumps(report, indent=2, default=str) + "\n")
    if markdown is not None:
        paths.append(out.with_suffix(".md"))
        paths[1].write_text(markdown)
    if out.resolve().parent == RESULTS.resolve():
        env = report.get("env") or report.get("machine") or report.get("environment") or {}
        line = {"file": paths[0].name, "date": report.get("date") or env.get("date") or now(),
                "commit": report.get("commit") or env.get("commit") or git_commit(),
                "machine": f"{os.cpu_count()} CPUs, {cpu_model()}",
                "quick": quick(False, True)}
        with open(HISTORY, "a") as f:
            f.write(json.dumps(line) + "\n")
    return paths


def shm_in_use() -> set[str]:
    """Names of the files in /dev/shm that some live process has mapped or open."""
    names: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    names.add(line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)"))
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("/dev/shm/"):
                    names.add(target.removeprefix("/dev/shm/").removesuffix(" (deleted)"))
        except OSError:
            continue
    return names
