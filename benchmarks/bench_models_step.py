"""Step time of a LeNet-sized CNN in mpidp, beside PyTorch and the standard MLP workload.

Run under ``mpiexec -n P python benchmarks/bench_models_step.py --out step.json`` (one BLAS
thread per rank; ``bench_models.py`` starts it). In one job, in turns (the order rotates
every repeat, warm-up steps dropped, the slowest rank's time between barriers, medians):

- ``cnn``: mpidp's ``DataParallel.step`` on the LeNet-sized CNN (:func:`lenet_layers`) with
  ``(1, 28, 28)`` float32 inputs, global batch 64, SGD with momentum;
- ``torch``: the same network in PyTorch on the CPU, one thread (P = 1 only, when torch is
  installed), started from mpidp's parameters on the same batches;
- ``mlp``: the standard workload of docs/benchmarks.md (MLP 784-1024-1024-10, plain SGD lr
  0.05, global batch 512).

With ``--profile`` (P = 1), it then times every layer's forward and backward, the loss, the
gradient exchange and the update inside mpidp CNN steps, and the same GEMM shapes alone,
to split a step into matrix products and the rest. Rank 0 writes the JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence

import numpy as np
from mpi4py import MPI

import mpidp
from benchmarks.harness import blas_info
from mpidp import nn
from mpidp.data.partition import local_batches

IMAGE = (1, 28, 28)
MLP_HIDDEN = (1024, 1024)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results file (written by rank 0)")
    p.add_argument("--repeats", type=int, default=7, help="timed runs of each workload")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each timed run")
    p.add_argument("--cnn-steps", type=int, default=100, help="timed CNN steps per run")
    p.add_argument("--mlp-steps", type=int, default=60, help="timed MLP steps per run")
    p.add_argument("--cnn-batch", type=int, default=64, help="GLOBAL batch of the CNN")
    p.add_argument("--mlp-batch", type=int, default=512, help="GLOBAL batch of the MLP")
    p.add_argument("--cnn-lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--mlp-lr", type=float, default=0.05)
    p.add_argument("--n-samples", type=int, default=60000, help="synthetic training samples")
    p.add_argument("--no-torch", action="store_true", help="leave PyTorch out")
    p.add_argument("--profile", action="store_true", help="split the CNN step (P = 1)")
    p.add_argument("--profile-steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if min(args.repeats, args.cnn_steps, args.mlp_steps, args.profile_steps) < 1 or args.warmup < 0:
        p.error("--repeats and the step counts must be >= 1, --warmup >= 0")
    return args


# --- the networks -----------------------------------------------------------------------

def lenet_layers() -> list[nn.Layer]:
    """Conv2d(6, 5) ReLU MaxPool(2) Conv2d(16, 5) ReLU MaxPool(2) Flatten Dense 120 ReLU
    Dense 84 ReLU Dense 10, unbound (sizes inferred from ``(1, 28, 28)``)."""
    return [nn.Conv2d(6, 5), nn.ReLU(inplace=True), nn.MaxPool(2),
            nn.Conv2d(16, 5), nn.ReLU(inplace=True), nn.MaxPool(2), nn.Flatten(),
            nn.Dense(None, 120), nn.ReLU(inplace=True), nn.Dense(None, 84), nn.ReLU(inplace=True),
            nn.Dense(None, 10, init="xavier")]


def torch_lenet(model: nn.Sequential):
    """The same network in PyTorch, holding ``model``'s parameters (Dense ``W`` transposed)."""
    import torch
    T = torch.nn
    net = T.Sequential(T.Conv2d(1, 6, 5), T.ReLU(), T.MaxPool2d(2), T.Conv2d(6, 16, 5), T.ReLU(),
                       T.MaxPool2d(2), T.Flatten(), T.Linear(256, 120), T.ReLU(), T.Linear(120, 84),
                       T.ReLU(), T.Linear(84, 10))
    theirs = [m for m in net if isinstance(m, (T.Conv2d, T.Linear))]
    ours = [layer for layer in model.layers if "W" in getattr(layer, "params", {})]
    if len(theirs) != len(ours):
        raise ValueError(f"{len(ours)} layers with weights in the mpidp model, {len(theirs)} in PyTorch's")
    with torch.no_grad():
        for t, m in zip(theirs, ours):
            W = m.params["W"]
            t.weight.copy_(torch.from_numpy(np.ascontiguousarray(W.T if W.ndim == 2 else W)))
            t.bias.copy_(torch.from_numpy(m.params["b"]))
    return net


def torch_params(net) -> np.ndarray:
    """``net``'s parameters flattened in mpidp's order and layout (Dense ``W`` transposed)."""
    import torch
    parts = []
    for m in net:
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            W = m.weight.detach().numpy()
            parts += [(W.T if W.ndim == 2 else W).ravel(), m.bias.detach().numpy().ravel()]
    return np.concatenate(parts)


# --- steps ------------------------------------------------------------------------------

def batches_of(shard: mpidp.Shard, batch: int, seed: int) -> Iterator:
    """This rank's rows of every global batch, epoch after epoch, as :func:`mpidp.fit` does."""
    return itertools.chain.from_iterable(
        local_batches(shard.n_total, batch, shard.start, shard.stop, epoch, seed)
        for epoch in itertools.count())


class Workload:
    """A step function with its own data, batch stream and batch size."""

    def __init__(self, name: str, step: Callable, X: np.ndarray, y: np.ndarray, batches: Iterator,
                 batch: int, steps: int, to_input: Callable = lambda a: a) -> None:
        self.name, self.step, self.X, self.y, self.batches = name, step, X, y, batches
        self.batch, self.steps, self.to_input = batch, steps, to_input
        self.runs: list[float] = []

    def run(self, comm: MPI.Comm, n: int, timed: bool) -> float:
        """``n`` steps; with ``timed``, between barriers, the slowest rank's seconds per step."""
        if timed:
            comm.Barrier()
        t0 = MPI.Wtime()
        for idx in itertools.islice(self.batches, n):
            self.step(self.to_input(self.X[idx]), self.to_input(self.y[idx]))
        if not timed:
            return 0.0
        comm.Barrier()
        return comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX) / n

    def summary(self) -> dict:
        s = statistics.median(self.runs)
        return {"step_ms": s * 1e3, "samples_per_s": self.batch / s, "global_batch": self.batch,
                "steps": self.steps, "runs_ms": [r * 1e3 for r in self.runs]}


def mpidp_cnn(comm: MPI.Comm, args) -> tuple[mpidp.DataParallel, nn.Sequential]:
    model = nn.Sequential(lenet_layers(), IMAGE, np.float32).init_(args.seed)
    dp = mpidp.DataParallel(model, nn.SGD(args.cnn_lr, momentum=args.momentum),
                            nn.SoftmaxCrossEntropy(), comm)
    return dp, model


def torch_step(net, lr: float, momentum: float) -> Callable:
    import torch
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)

    def step(X, y) -> None:
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(net(X), y)  # the batch mean, as mpidp's
        loss.backward()
        opt.step()
    return step


def same_computation(comm: MPI.Comm, images: np.ndarray, y: np.ndarray, shard, args) -> float | None:
    """Max |difference| of the parameters after 5 steps of mpidp and of PyTorch from the
    same start on the same batches (float32): do both compute the same thing?"""
    import torch
    dp, model = mpidp_cnn(comm, args)
    net = torch_lenet(model)
    step = torch_step(net, args.cnn_lr, args.momentum)
    for idx in itertools.islice(batches_of(shard, args.cnn_batch, args.seed), 5):
        dp.step(images[idx], y[idx])
        step(torch.from_numpy(images[idx]), torch.from_numpy(y[idx]))
    return float(np.max(np.abs(model.params - torch_params(net))))


# --- where a CNN step goes --------------------------------------------------------------

class Clock:
    """Seconds per label, added up by the wrappers :meth:`wrap` puts on instance methods."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)

    def wrap(self, obj, method: str, label: str) -> None:
        inner = getattr(obj, method)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.s[label] += time.perf_counter() - t
        setattr(obj, method, timed)


def gemm_shapes(model: nn.Sequential, n: int) -> list[tuple[str, Callable[[], None]]]:
    """The matrix products of one training step of ``model`` on ``n`` samples, each as
    (label, a thunk doing that product alone on arrays of the layer's shapes and layouts).
    The first layer computes no input gradient (``DataParallel.step``)."""
    rng = np.random.default_rng(1)
    dt = model.params.dtype
    r = lambda *s: rng.standard_normal(s).astype(dt)
    out, shape = [], model.in_shape
    for i, layer in enumerate(model.layers):
        nxt = layer.output_shape(shape)
        name = f"{i} {type(layer).__name__}"
        if isinstance(layer, nn.Conv2d):
            F, CK, P = layer.out_channels, int(np.prod(layer.params["W"].shape[1:])), int(np.prod(nxt[1:]))
            W, cols, dy, dW = r(F, CK), r(CK, P * n), r(F, P * n), r(F, CK)
            out.append((f"{name} forward W @ cols ({F}x{CK} @ {CK}x{P * n})", lambda W=W, c=cols: W @ c))
            out.append((f"{name} backward dW = dy @ cols.T",
                        lambda d=dy, c=cols, o=dW: np.matmul(d, c.T, out=o)))
            if i:
                out.append((f"{name} backward dcols = W.T @ dy", lambda W=W, d=dy: W.T @ d))
        elif isinstance(layer, nn.Dense):
            a, b = layer.n_in, layer.n_out
            x, W, dy, dW = r(n, a), r(a, b), r(n, b), r(a, b)
            out.append((f"{name} forward x @ W ({n}x{a} @ {a}x{b})", lambda x=x, W=W: x @ W))
            out.append((f"{name} backward dW = x.T @ dy", lambda x=x, d=dy, o=dW: np.matmul(x.T, d, out=o)))
            if i:
                out.append((f"{name} backward dx = dy @ W.T", lambda W=W, d=dy: d @ W.T))
        shape = nxt
    return out


def time_alone(thunk: Callable[[], None], reps: int = 200) -> float:
    """Median seconds of ``thunk`` over ``reps`` calls in blocks of 10 (after a warm-up)."""
    for _ in range(20):
        thunk()
    blocks = []
    for _ in range(reps // 10):
        t = time.perf_counter()
        for _ in range(10):
            thunk()
        blocks.append((time.perf_counter() - t) / 10)
    return statistics.median(blocks)


def profile_cnn(comm: MPI.Comm, images: np.ndarray, y: np.ndarray, shard, args) -> dict:
    """Milliseconds per step of each part of an mpidp CNN step (instrumented steps), the
    plain step time (uninstrumented, same run) and the GEMMs of the step timed alone."""
    dp, model = mpidp_cnn(comm, args)
    batches = batches_of(shard, args.cnn_batch, args.seed)
    plain = Workload("cnn", dp.step, images, y, batches, args.cnn_batch, args.profile_steps)
    plain.run(comm, args.warmup, timed=False)
    plain_s = plain.run(comm, args.profile_steps, timed=True)
    clock = Clock()
    for i, layer in enumerate(model.layers):
        for m in ("forward", "backward"):
            clock.wrap(layer, m, f"{i} {type(layer).__name__} {m}")
    clock.wrap(dp.loss, "forward", "loss forward")
    clock.wrap(dp.loss, "backward", "loss backward")
    clock.wrap(dp.sync, "exchange", "exchange (Allreduce of the gradient buffer)")
    clock.wrap(dp.sync, "update", "update (SGD with momentum)")
    probe = Workload("cnn", dp.step, images, y, batches, args.cnn_batch, args.profile_steps)
    probe.run(comm, args.warmup, timed=False)
    clock.s.clear()
    step_s = probe.run(comm, args.profile_steps, timed=True)
    parts = {k: v / args.profile_steps * 1e3 for k, v in clock.s.items()}
    parts["rest of DataParallel.step (buffer, NaN/Inf check, timers)"] = \
        step_s * 1e3 - sum(parts.values())
    gemms = {label: time_alone(thunk) * 1e3 for label, thunk in gemm_shapes(model, args.cnn_batch)}
    return {"plain_step_ms": plain_s * 1e3, "instrumented_step_ms": step_s * 1e3,
            "parts_ms": parts, "gemm_alone_ms": gemms, "steps": args.profile_steps,
            "conv_dW_other_order_ms": conv_dw_other_order(model, args.cnn_batch)}


def conv_dw_other_order(model: nn.Sequential, n: int) -> dict[str, float]:
    """Each convolution's weight gradient computed the other way round,
    ``(cols @ dy.T).T`` (the same numbers), timed alone: does the GEMM's layout matter?"""
    rng = np.random.default_rng(1)
    out, shape = {}, model.in_shape
    for i, layer in enumerate(model.layers):
        nxt = layer.output_shape(shape)
        if isinstance(layer, nn.Conv2d):
            F, CK, P = layer.out_channels, int(np.prod(layer.params["W"].shape[1:])), int(np.prod(nxt[1:]))
            dy = rng.standard_normal((F, P * n)).astype(model.params.dtype)
            cols = rng.standard_normal((CK, P * n)).astype(model.params.dtype)
            out[f"{i} Conv2d backward dW = (cols @ dy.T).T"] = \
                time_alone(lambda d=dy, c=cols: (c @ d.T).T) * 1e3
        shape = nxt
    return out


# --- the job ----------------------------------------------------------------------------

def environment(comm: MPI.Comm, torch_version: str | None) -> dict:
    return {"mpi_library": MPI.Get_library_version().strip().splitlines()[0].strip(),
            "mpi4py": __import__("mpi4py").__version__, "numpy": np.__version__,
            "mpidp": mpidp.__version__, "python": platform.python_version(),
            "world_size": comm.size, "blas": blas_info(), "torch": torch_version,
            "thread_env": {v: os.environ.get(v) for v in
                           ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")},
            "openblas_env_set": {v: v in os.environ for v in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}}


def load_torch(comm: MPI.Comm, wanted: bool) -> tuple[object | None, str]:
    """PyTorch with one thread, or None and why not."""
    if not wanted:
        return None, "not asked for"
    if comm.size != 1:
        return None, "P = 1 only"
    try:
        import torch
    except ImportError as exc:
        return None, f"PyTorch cannot be imported ({exc})"
    torch.set_num_threads(1)
    return torch, torch.__version__


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    mpidp.abort_on_error()
    torch, torch_note = load_torch(comm, not args.no_torch)
    data = mpidp.load(comm, "synthetic", distribute="local", test_fraction=0.0, seed=args.seed,
                      n_samples=args.n_samples, n_features=int(np.prod(IMAGE)), n_classes=10)
    sh = data.train
    X, y = np.ascontiguousarray(sh.X, np.float32), np.ascontiguousarray(sh.y, np.int64)
    images = X.reshape(len(X), *IMAGE)
    dp, model = mpidp_cnn(comm, args)
    work = [Workload("cnn", dp.step, images, y, batches_of(sh, args.cnn_batch, args.seed),
                     args.cnn_batch, args.cnn_steps)]
    check = None
    if torch is not None:
        net = torch_lenet(model)
        work.append(Workload("torch", torch_step(net, args.cnn_lr, args.momentum), images, y,
                             batches_of(sh, args.cnn_batch, args.seed), args.cnn_batch,
                             args.cnn_steps, to_input=torch.from_numpy))
        check = same_computation(comm, images, y, sh, args)
    mlp = nn.mlp(X.shape[1], MLP_HIDDEN, 10, dtype=np.float32).init_(args.seed)
    mdp = mpidp.DataParallel(mlp, nn.SGD(args.mlp_lr), nn.SoftmaxCrossEntropy(), comm)
    work.append(Workload("mlp", mdp.step, X, y, batches_of(sh, args.mlp_batch, args.seed),
                         args.mlp_batch, args.mlp_steps))
    ratios = []
    for r in range(args.repeats):
        k = r % len(work)
        for w in work[k:] + work[:k]:  # the order rotates: each goes first in turn
            w.run(comm, args.warmup, timed=False)
            w.runs.append(w.run(comm, w.steps, timed=True))
        if torch is not None:
            ratios.append(work[0].runs[-1] / work[1].runs[-1])
    result = {w.name: w.summary() for w in work}
    if torch is not None:
        result["ratio_mpidp_over_torch"] = result["cnn"]["step_ms"] / result["torch"]["step_ms"]
        result["paired_ratios"] = ratios
        result["paired_ratio_median"] = statistics.median(ratios)
        result["params_diff_after_5_steps"] = check
    result["torch_note"] = torch_note
    if args.profile:
        result["profile"] = profile_cnn(comm, images, y, sh, args)
    env = environment(comm, torch_note if torch is not None else None)
    if comm.rank == 0:
        out = {"world_size": comm.size, "repeats": args.repeats, "warmup": args.warmup,
               "cnn": {"layers": [repr(layer) for layer in model.layers], "n_params": model.n_params,
                       "input": list(IMAGE), "dtype": "float32", "lr": args.cnn_lr,
                       "momentum": args.momentum},
               "mlp": {"hidden": list(MLP_HIDDEN), "n_params": mlp.n_params, "lr": args.mlp_lr},
               "results": result, "environment": env,
               "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=2)
        os.replace(tmp, args.out)
        line = ", ".join(f"{w.name} {result[w.name]['step_ms']:.2f} ms" for w in work)
        print(f"P={comm.size}: {line}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
