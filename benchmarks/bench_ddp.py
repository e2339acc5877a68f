"""PyTorch DistributedDataParallel on the standard workload, for comparison with mpidp.

Run under ``mpiexec -n P`` (ranks and world size come from MPI; torch.distributed uses
the gloo backend over loopback, CPU, one thread per rank):
    mpiexec -n 2 python benchmarks/bench_ddp.py --out ddp.json
Same model (784-1024-1024-10 ReLU, softmax cross-entropy, SGD lr 0.05, float32), same
synthetic data and global batches (positions of a seeded per-epoch permutation, each rank
taking its block's share), 5 warm-up + N timed steps between barriers, median of repeats.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

import mpidp
from mpidp.data.partition import local_batches


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=29533)
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    dist.init_process_group("gloo", rank=comm.rank, world_size=comm.size)
    data = mpidp.load(comm, "synthetic", n_samples=60000, n_features=784, n_classes=10,
                      distribute="local", test_fraction=0.0, seed=0)
    sh = data.train
    X, y = torch.from_numpy(np.ascontiguousarray(sh.X)), torch.from_numpy(sh.y)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(784, 1024), torch.nn.ReLU(),
                              torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    model = DDP(net)  # broadcasts rank 0's parameters
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batch = 512
    batches = itertools.chain.from_iterable(
        local_batches(sh.n_total, batch, sh.start, sh.stop, e, 0) for e in itertools.count())

    def step(idx):
        # DDP averages gradients over ranks; scale the local sum so the result is the global
        # mean over the whole batch even when ranks hold different counts (as mpidp does)
        out = model(X[idx])
        loss = torch.nn.functional.cross_entropy(out, y[idx], reduction="sum") * (comm.size / batch)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()

    times = []
    for _ in range(args.repeats):
        for idx in itertools.islice(batches, args.warmup):
            step(torch.from_numpy(np.asarray(idx)))
        comm.Barrier()
        t = time.perf_counter()
        for idx in itertools.islice(batches, args.steps):
            step(torch.from_numpy(np.asarray(idx)))
        comm.Barrier()
        times.append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX) / args.steps)
    dist.destroy_process_group()
    if comm.rank == 0:
        s = statistics.median(times)
        with open(args.out, "w") as f:
            json.dump({"world_size": comm.size, "step_ms": s * 1e3, "samples_per_s": batch / s,
                       "repeats_ms": [t * 1e3 for t in times], "torch": torch.__version__}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
