"""``make bench-network``: data parallelism over a slow link between two test hosts.

Two test hosts made from network namespaces (tests/multihost/cluster.py), each link limited
to a rate (``--rates``, Gbit/s; a token bucket on both directions). On each rate, one rank
per host runs the hand-written loop and mpidp's ``allreduce``, ``overlapped``,
``compressed`` and ``auto`` on the standard workload (global batch 512), ``--repeats``
times in a seeded shuffled order; then 2 hosts x 2 ranks run fused allreduce with
node-aware reduction off and on. Each figure: steps/s (median of the repeats and their
spread), the link-bound limit (rate / bytes each host must send per step), the share of it
reached, and the bytes that crossed the host link per timed step, read from the bridge-side
veth counters around exactly the timed steps (``bench_sync.py --marks``). Needs root;
writes benchmarks/results/network.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from run_step_bench import bench_env, cpu_model, git_commit

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "tests" / "multihost"))
from cluster import Cluster, LinkBytes, limits_available, tbf_args  # noqa: E402

PAIR_MODES = ("handwritten", "allreduce", "overlapped", "compressed", "auto")
NODE_MODES = ("allreduce-flat", "allreduce-node")  # 2 hosts x 2 ranks
GATHER = ("compressed",)  # 16-bit codes Allgathered: each rank sends (P-1) x its codes


# --- arithmetic -------------------------------------------------------------------------

def host_bytes(payload: float, ranks: int, hosts: int, gather: bool = False) -> float:
    """The least bytes each host must send over its link per step to combine ``payload``
    bytes from each of ``ranks`` ranks spread evenly over ``hosts`` hosts.

    An allreduce sends ``2 (H-1)/H * payload`` per host (what a ring of the ``H`` hosts
    sends; sums inside a host cost the link nothing); an allgather (``gather``) sends the
    host's ``ranks / H`` payloads to the ``H - 1`` others. At one rank per host and ``P``
    ranks: ``2 (P-1)/P * payload``, and ``(P-1) * payload``. 0 on one host.
    """
    if hosts < 2:
        return 0.0
    return (hosts - 1) * ranks / hosts * payload if gather else 2 * (hosts - 1) / hosts * payload


def limit_steps_per_s(rate_bits: float, link_bytes: float) -> float | None:
    """Steps/s a link of ``rate_bits`` bits/s allows when a step sends ``link_bytes`` over it
    (None when a step sends nothing)."""
    return rate_bits / 8 / link_bytes if link_bytes > 0 else None


def link_per_step(start: Sequence[LinkBytes], stop: Sequence[LinkBytes], steps: int) -> dict:
    """Counter readings of every host's link before and after ``steps`` steps -> bytes per
    step each host sent and received, and the busiest direction of any host's link."""
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    deltas = [b - a for a, b in zip(start, stop)]
    if any(d.sent < 0 or d.received < 0 for d in deltas):
        raise ValueError("a link counter went backwards: were the hosts rebuilt between readings?")
    sent, received = [d.sent / steps for d in deltas], [d.received / steps for d in deltas]
    return {"sent": sent, "received": received, "busiest": max(sent + received)}


def spread(values: Sequence[float]) -> dict:
    """Median, min, max and (max - min) / median of ``values``."""
    med = statistics.median(values)
    return {"median": med, "min": min(values), "max": max(values),
            "spread": (max(values) - min(values)) / med if med else 0.0}


def rows_of(job: dict, marks: dict, rate_bits: float, hosts: int) -> list[dict]:
    """One row per mode of a bench_sync.py ``job`` (its JSON) and the counter readings at
    its ``marks`` (label -> {"start": [...], "stop": [...]})."""
    ranks, steps, rows = job["world_size"], job["steps"], []
    for mode, m in job["modes"].items():
        sync = m["repeats"][0].get("sync", mode)
        link = [link_per_step(marks[r["mark"]]["start"], marks[r["mark"]]["stop"], steps)
                for r in m["repeats"]]
        # the most one rank contributes (a node-aware reduction's leaders send, others not)
        payload = max(m["repeats"][0].get("rank_bytes_per_step") or [m.get("bytes_per_step") or 0.0])
        need = host_bytes(payload, ranks, hosts, gather=mode in GATHER or sync in GATHER)
        sps = spread([1 / r["step_s"] for r in m["repeats"]])
        limit = limit_steps_per_s(rate_bits, need)
        rows.append({"rate_gbit": rate_bits / 1e9, "ranks": ranks, "hosts": hosts, "mode": mode,
                     "sync": sync, "steps_per_s": sps, "payload_bytes": payload,
                     "expected_link_bytes": need, "limit_steps_per_s": limit,
                     "of_limit": sps["median"] / limit if limit else None,
                     "link_bytes_per_step": statistics.median(x["busiest"] for x in link),
                     "link": link, "comm_share": m["comm_share"],
                     "sync_report": m["repeats"][0].get("sync_report")})
    rows += [{"rate_gbit": rate_bits / 1e9, "ranks": ranks, "hosts": hosts, "mode": mode,
              "skipped": why} for mode, why in job.get("skipped", {}).items()]
    return rows


# --- report -----------------------------------------------------------------------------

def _fmt(x: float | None, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def table(rows: Sequence[dict]) -> list[str]:
    """The Markdown table of ``rows`` (from :func:`rows_of`)."""
    out = ["| link | hosts x ranks | mode | steps/s (median, spread) | link-bound limit | % of limit "
           "| host-link MB/step (veth) | expected MB/step |",
           "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        where = f"| {r['rate_gbit']:g} Gbit/s | {r['hosts']} x {r['ranks'] // r['hosts']} "
        if "skipped" in r:
            out.append(where + f"| {r['mode']} | skipped: {r['skipped']} | | | | |")
            continue
        s, mode = r["steps_per_s"], r["mode"]
        mode += f" ({r['sync']})" if r["sync"] not in (mode, "allreduce") else ""
        out.append(where + f"| {mode} | {s['median']:.2f} ±{s['spread'] / 2:.0%} | "
                   f"{_fmt(r['limit_steps_per_s'], '.2f')} | {_fmt(r['of_limit'], '.0%')} | "
                   f"{r['link_bytes_per_step'] / 1e6:.2f} | {r['expected_link_bytes'] / 1e6:.2f} |")
    return out


def blas_line(env: dict) -> str:
    """The ranks' BLAS kernel (threadpoolctl) and MPI library, from a job's ``environment``."""
    blas = env.get("blas")
    kern = ", ".join(f"{b['internal_api']} {b['version']} {b['architecture']} kernel, "
                     f"{b['num_threads']} thread(s)" for b in blas) if isinstance(blas, list) else blas
    mpi = " ".join(str(env.get("mpi_library")).split())
    return f"BLAS: {kern}; {mpi}; numpy {env.get('numpy')}"


def markdown(report: dict) -> str:
    """The report as Markdown: the table, how each column was measured, where and how."""
    probes = "; ".join(f"{p['rate_gbit']:g} Gbit/s: {p['MB_per_s']:.0f} MB/s"
                       for p in report["probes"])
    lines = [
        "# Data parallelism over a slow link (two test hosts)", "",
        "Standard workload (784-1024-1024-10 MLP, float32, 7.45 MB of gradients, global batch "
        f"512); {report['steps']} timed steps after {report['warmup']} warm-up steps, "
        f"{report['repeats']} repeat(s), each in a shuffled order (seed {report['seed']}).", "",
        *table(report["rows"]), "",
        "- steps/s: the slowest rank's, median of the repeats; ± half their range.",
        "- link-bound limit: rate / the least bytes each host must send per step (expected "
        "MB/step): an allreduce of m bytes per rank over H hosts 2(H-1)/H m (a ring of the "
        "hosts; at 2 x 1: m), an allgather (compressed: 16-bit codes) (H-1) k m with k ranks "
        "per host. m is the most one rank contributes per step (its strategy's `bytes_sent`: "
        "float32 gradients plus extras; about half that in bfloat16).",
        "- host-link MB/step: the bridge-side veths' byte counters (frames: payload plus "
        "TCP/IP/Ethernet headers, GSO packets counted once) read just before and after the "
        "timed steps of each run (the job waits at each mark while they are read), the "
        "busiest direction of any host, divided by the steps; median of the repeats.",
        "- allreduce-flat is the MPI library's own Allreduce over all the ranks: its host-link "
        "bytes are those of whichever algorithm the library picks for this size and layout "
        "(`--job-env` can pick one); allreduce-node sums inside each host first, then only "
        "the hosts' leaders reduce over the link.",
        f"- The link itself (one TCP stream between the hosts, {report['probe_mb']} MB): "
        f"{probes}.",
        *(f"- At {r['rate_gbit']:g} Gbit/s, {r['hosts']} x {r['ranks'] // r['hosts']}: "
          f"{r['sync_report']}; the timed steps came after that choice"
          for r in report["rows"] if r.get("sync_report")), "",
        "## Where and how", "",
        f"- Machine: {report['machine']} ({report['cores']} cores). The test hosts share this "
        "machine's CPUs with their network stack (TCP, veth, bridge, token buckets run on the "
        "cores that compute), so a fast link costs compute time that a real NIC would not.",
        f"- Links: `tc qdisc ... tbf` on both directions of each host's link; {report['tbf']}.",
        f"- {report['blas']}",
        *([f"- Environment of the MPI jobs: `{' '.join(report['job_env'])}`"] if report["job_env"] else []),
        f"- Command: `{report['command']}`; commit {report['commit']}; {report['date']}"]
    return "\n".join(lines) + "\n"


# --- running ----------------------------------------------------------------------------

class Marks:
    """The FIFOs ``folder/req`` and ``folder/ack`` of ``bench_sync.py --marks folder``:
    each ``start LABEL`` / ``stop LABEL`` line the job writes is answered once ``read()``
    (the links' counters) has been taken; ``seen[LABEL]`` holds the readings."""

    def __init__(self, folder: Path, read: Callable[[], list[LinkBytes]]) -> None:
        folder.mkdir()
        for name in ("req", "ack"):
            os.mkfifo(folder / name)
        # read-write ends never block on open, and keep the FIFOs open for the job's opens
        self._req = os.open(folder / "req", os.O_RDWR)
        self._ack = os.open(folder / "ack", os.O_RDWR)
        self.read, self.seen = read, {}
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        with open(self._req, closefd=False) as req:
            for line in req:
                what, _, label = line.strip().partition(" ")
                if what == "quit":
                    return
                self.seen.setdefault(label, {})[what] = self.read()
                os.write(self._ack, b"ok\n")

    def close(self) -> None:
        os.write(self._req, b"quit\n")
        self._thread.join(timeout=10)
        os.close(self._req)
        os.close(self._ack)


def run_job(c: Cluster, per_host: int, modes: Sequence[str], args, env: dict,
            tmp: Path, name: str) -> tuple[dict, dict]:
    """bench_sync.py on ``2 x per_host`` ranks with ``modes``; its JSON and its marks."""
    out = tmp / f"{name}.json"
    marks = Marks(tmp / f"{name}.marks", c.link_bytes)
    cmd = c.mpiexec(2 * per_host, per_host, sys.executable, str(HERE / "bench_sync.py"),
                    "--only", "--modes", ",".join(modes), "--steps", str(args.steps),
                    "--warmup", str(args.warmup), "--repeats", str(args.repeats),
                    "--shuffle", str(args.seed), "--marks", str(tmp / f"{name}.marks"),
                    "--out", str(out))
    print("$ " + " ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, env=env, cwd=REPO, check=True, timeout=args.timeout,
                       stdin=subprocess.DEVNULL)
    finally:
        marks.close()
    return json.loads(out.read_text()), marks.seen


def measure_rate(c: Cluster, rate_bits: float, args, env: dict, tmp: Path) -> tuple[list, dict, dict]:
    """Every figure on links of ``rate_bits``: rows, the TCP probe and the last job's JSON."""
    c.limit(rate_bits)
    n = int(args.probe_mb * 1e6)
    probe = {"rate_gbit": rate_bits / 1e9, "MB_per_s": n / c.transfer(0, 1, n) / 1e6}
    print(f"link at {rate_bits / 1e9:g} Gbit/s: one TCP stream {probe['MB_per_s']:.0f} MB/s", flush=True)
    tag, rows, job = f"{rate_bits / 1e9:g}g", [], None
    if args.modes:
        job, marks = run_job(c, 1, args.modes, args, env, tmp, f"pair-{tag}")
        rows += rows_of(job, marks, rate_bits, 2)
    if args.node_modes:
        job, marks = run_job(c, 2, args.node_modes, args, env, tmp, f"node-{tag}")
        if not job["modes"]:  # no node_aware in make_sync: plain allreduce at 2 x 2
            rows += rows_of(job, marks, rate_bits, 2)
            job, marks = run_job(c, 2, ["allreduce"], args, env, tmp, f"plain-{tag}")
        rows += rows_of(job, marks, rate_bits, 2)
    return rows, probe, job


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rates", default="1,10", help="link rates in Gbit/s, comma-separated")
    p.add_argument("--steps", type=int, default=40, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps before each run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each mode, each a shuffled order")
    p.add_argument("--seed", type=int, default=0, help="seed of the shuffled orders")
    p.add_argument("--modes", default=",".join(PAIR_MODES), help="modes at 2 hosts x 1 rank")
    p.add_argument("--node-modes", default=",".join(NODE_MODES),
                   help="modes at 2 hosts x 2 ranks (empty: none)")
    p.add_argument("--probe-mb", type=float, default=50, help="MB of the TCP probe of each link")
    p.add_argument("--job-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the MPI jobs (repeatable), e.g. "
                   "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring with MPIR_CVAR_ALLREDUCE_COMPOSITION=3")
    p.add_argument("--timeout", type=float, default=1200, help="seconds allowed per MPI job")
    p.add_argument("--results", default=str(HERE / "results"))
    args = p.parse_args(argv)
    try:
        args.rates = [float(r) * 1e9 for r in args.rates.split(",") if r.strip()]
    except ValueError:
        p.error(f"--rates must be comma-separated Gbit/s like 1,10, got {args.rates!r}")
    if not args.rates or min(args.rates) <= 0:
        p.error("--rates needs at least one rate > 0 Gbit/s")
    if min(args.steps, args.repeats) < 1 or args.warmup < 0:
        p.error("--steps and --repeats must be >= 1, --warmup >= 0")
    if any("=" not in kv for kv in args.job_env):
        p.error(f"--job-env takes NAME=VALUE, got {args.job_env}")
    args.modes = [m for m in args.modes.split(",") if m]
    args.node_modes = [m for m in args.node_modes.split(",") if m]
    if not args.modes and not args.node_modes:
        p.error("--modes and --node-modes are both empty: nothing to run")
    return args


def _terminate(signum, frame) -> None:
    sys.exit(128 + signum)  # unwinds the with-blocks: hosts, links and folders go


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    reason = limits_available()
    if reason:
        print(f"bench-network skipped: {reason}")
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    env, _ = bench_env()
    env["PYTHONPATH"] = str(REPO)
    env.update(kv.split("=", 1) for kv in args.job_env)
    rows, probes, first = [], [], None
    with tempfile.TemporaryDirectory(prefix="mpidp-network-") as t, Cluster(2) as c:
        for rate in args.rates:
            r, probe, job = measure_rate(c, rate, args, env, Path(t))
            rows, probes, first = rows + r, probes + [probe], first or job
    report = {"rows": rows, "probes": probes, "probe_mb": args.probe_mb, "steps": args.steps,
              "warmup": args.warmup, "repeats": args.repeats, "seed": args.seed,
              "job_env": args.job_env,
              "tbf": "; ".join(f"{r / 1e9:g} Gbit/s: `{' '.join(tbf_args(r))}`" for r in args.rates),
              "blas": blas_line(first["environment"]), "environment": first["environment"],
              "machine": cpu_model(), "cores": os.cpu_count(), "commit": git_commit(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "command": " ".join(["python benchmarks/bench_network.py", *(argv or sys.argv[1:])])}
    md = markdown(report)
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / "network.json").write_text(json.dumps(report, indent=2))
    (out / "network.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
