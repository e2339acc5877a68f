"""Overlapped sums that finish during the next forward pass: the same model as one
process, the parts started in the order the next forward reads them, and every
combination that cannot work refused on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import all_ranks, raises_everywhere

import mpidp
from mpidp import nn
from mpidp.parallel.overlap import Overlapped

RTOL, ATOL = 1e-9, 1e-11  # reduction order (and a Dense's row blocks) only


def _data(comm, n=120):
    rng = np.random.default_rng(1)
    X, y = rng.standard_normal((n, 10)), rng.integers(0, 4, n)
    rows = np.array_split(np.arange(n), comm.size)[comm.rank]
    return mpidp.shard_from_arrays(comm, X[rows], y[rows]), X, y


def _model():
    return nn.mlp(10, (24, 16), 4, dtype=np.float64).init_(5)


def _train(comm, shard, sync, optimizer, epochs=2, batch=24, **kw):
    dp = mpidp.DataParallel(_model(), optimizer(), nn.SoftmaxCrossEntropy(), comm, sync=sync,
                            on_nonfinite="ignore", **kw)
    return dp, mpidp.fit(dp, shard, epochs, batch, seed=3)


OPTIMIZERS = {
    "sgd": lambda: nn.SGD(0.1),
    "momentum-wd-clip": lambda: nn.SGD(0.05, momentum=0.9, weight_decay=1e-3, clip_value=0.05),
    "adam": lambda: nn.Adam(0.01),
    "adamw-schedule": lambda: nn.AdamW(nn.schedules.Warmup(nn.schedules.Cosine(0.02, 10), 2),
                                       weight_decay=0.01),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("bucket_bytes", [160, 1 << 20])
def test_finishing_in_forward_gives_the_single_process_model(comm, optimizer, bucket_bytes):
    shard, X, y = _data(comm)
    make = OPTIMIZERS[optimizer]
    dp, hist = _train(comm, shard, Overlapped(bucket_bytes, finish="forward"), make)
    ref, ref_hist = _train(MPI.COMM_SELF, mpidp.shard_from_arrays(MPI.COMM_SELF, X, y),
                           "allreduce", make)
    diff = np.abs(dp.model.params - ref.model.params).max()
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL),
              f"max diff {diff:.3g}")
    all_ranks(comm, dp.in_sync() and dp.optimizer.t == ref.optimizer.t)
    for h, r in zip(hist, ref_hist):
        all_ranks(comm, abs(h["loss"] - r["loss"]) < 1e-9 and abs(h["test_loss"] - r["test_loss"]
                  if "test_loss" in r else 0) < 1e-9)


def _start_order(sync):
    """The stretches of the step just done, in the order they start (started ones by
    their place among the requests, then the queue)."""
    started = sorted((s for s in sync.stretches if s.index is not None), key=lambda s: s.index)
    return [(s.lo, s.hi) for s in started + list(sync.queue)]


@pytest.mark.mpi(min_size=2)  # one process announces no parts
def test_the_loss_goes_first_and_the_first_layers_before_the_held_halves(comm):
    """Buckets of 1000 bytes: the last bucket closes at the second Dense, so the last
    Dense and the loss and counts start first; the second half of every bucket but the
    first layer's waits until that layer's parts have started, then goes in the order
    the next forward reads it. The same order on every rank (a collective sequence)."""
    shard, X, y = _data(comm)
    sync = Overlapped(1000, finish="forward")
    dp = mpidp.DataParallel(_model(), nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, sync=sync,
                            on_nonfinite="ignore")
    rows = np.array_split(np.arange(48), comm.size)[comm.rank]
    dp.step(X[rows], y[rows])
    order, ranges = _start_order(sync), dp.model.layer_ranges
    buckets = sync.buckets
    size = sync.buf.size
    assert [b[0] for b in buckets] == [2, 0]
    assert order[0] == (ranges[4][0], size)  # the last Dense with the loss and counts
    covered = np.zeros(size, int)
    for lo, hi in order:
        covered[lo:hi] += 1
    assert np.all(covered == 1)  # every value summed exactly once
    blo, bhi = buckets[0][1], ranges[4][0]  # the first bucket, less the tail that went ahead
    held = [(lo, hi) for lo, hi in order if blo <= lo and hi <= bhi and lo - blo >= (bhi - blo) // 2]
    first_layer = [(lo, hi) for lo, hi in order if hi <= buckets[1][2]]
    assert held and first_layer
    assert max(order.index(s) for s in first_layer) < min(order.index(s) for s in held)
    assert held == sorted(held) and order[-len(held):] == held
    all_ranks(comm, all(o == order for o in comm.allgather(order)), "ranks start differently")
    dp.settle()
    assert not sync.stretches and not sync.sums.live and not sync.sums.requests


@pytest.mark.mpi(min_size=1)
def test_evaluation_checks_and_checkpoints_see_the_whole_update(comm, shared_tmp):
    """Right after a step (its first layers' sums still arriving) evaluation, the replica
    check and a checkpoint all see the updated model; resuming from that checkpoint ends
    on the uninterrupted run's very bits (both read in the same parts)."""
    import os

    from mpidp.run.checkpoint import restore
    from mpidp.run.spec import Checkpointing
    shard, X, y = _data(comm)
    dp = mpidp.DataParallel(_model(), nn.Adam(0.01), nn.SoftmaxCrossEntropy(), comm,
                            sync=Overlapped(160, finish="forward"), on_nonfinite="ignore")
    ref = mpidp.DataParallel(_model(), nn.Adam(0.01), nn.SoftmaxCrossEntropy(), MPI.COMM_SELF)
    idx = np.arange(48)
    mine = np.array_split(idx, comm.size)[comm.rank]
    for _ in range(3):
        dp.step(X[mine], y[mine])
        ref.step(X[idx], y[idx])
    pending = any(not s.applied for s in dp.sync.stretches)
    got, want = dp.evaluate(X[mine], y[mine]), ref.evaluate(X[idx], y[idx])
    all_ranks(comm, abs(got.loss - want.loss) < 1e-9 and got.correct == want.correct,
              f"loss {got.loss} != {want.loss} (parts pending before: {pending})")
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL))
    dp.check_replicas()

    def run(ck, resume=False, every=3):
        dp = mpidp.DataParallel(_model(), nn.SGD(0.1, momentum=0.9), nn.SoftmaxCrossEntropy(),
                                comm, sync=Overlapped(160, finish="forward"),
                                on_nonfinite="ignore")
        state = restore(comm, ck, dp.model, dp.optimizer)[1] if resume else None
        mpidp.fit(dp, shard, 2, 24, seed=2, resume=state,
                  checkpoint=Checkpointing(ck, every, keep=100))
        return dp

    first = os.path.join(shared_tmp, "first")
    whole = run(first)
    comm.Barrier()
    again = os.path.join(shared_tmp, "again")
    if comm.rank == 0:
        import shutil
        os.makedirs(again)
        shutil.copy(os.path.join(first, f"ckpt-{6:010d}.npz"), again)
    comm.Barrier()
    resumed = run(again, resume=True, every=1000)
    all_ranks(comm, np.array_equal(resumed.model.params, whole.model.params),
              f"max diff {np.abs(resumed.model.params - whole.model.params).max():.3g}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kw,match", [
    ({}, "on_nonfinite 'stop' cannot hold"),
    ({"on_nonfinite": "skip"}, "on_nonfinite 'skip' cannot hold"),
    ({"on_nonfinite": "ignore", "optimizer": nn.SGD(0.1, clip_norm=1.0)}, "clip_norm"),
    ({"on_nonfinite": "ignore", "optimizer": nn.LARS(0.1)}, "LARS scales each tensor"),
])
def test_what_cannot_finish_in_forward_is_refused_on_every_rank(comm, kw, match):
    kw = dict(kw)
    opt = kw.pop("optimizer", None) or nn.SGD(0.1)
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.DataParallel(
        _model(), opt, nn.SoftmaxCrossEntropy(), comm,
        sync=Overlapped(160, finish="forward"), **kw), match)


def test_bad_finish_settings_are_refused():
    from mpidp.parallel.modes import make_sync
    with pytest.raises(mpidp.MpidpError, match="unknown overlap finish 'later'"):
        Overlapped(finish="later")
    with pytest.raises(mpidp.MpidpError, match="use progress='test'"):
        Overlapped(progress="thread", finish="forward")
    with pytest.raises(mpidp.MpidpError, match="applies to --sync overlapped, not compressed"):
        make_sync("compressed", finish="forward")


@pytest.mark.mpi(min_size=1)
def test_a_step_callback_reads_the_updated_parameters(comm):
    shard, X, y = _data(comm)
    seen, ref_seen = {}, {}

    def watch(into, dp):
        return lambda step, stats: into.__setitem__(step, dp.model.params.copy())
    dp = mpidp.DataParallel(_model(), nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                            sync=Overlapped(160, finish="forward"), on_nonfinite="ignore")
    mpidp.fit(dp, shard, 1, 24, seed=3, on_step=watch(seen, dp))
    ref = mpidp.DataParallel(_model(), nn.SGD(0.1), nn.SoftmaxCrossEntropy(), MPI.COMM_SELF)
    mpidp.fit(ref, mpidp.shard_from_arrays(MPI.COMM_SELF, X, y), 1, 24, seed=3,
              on_step=watch(ref_seen, ref))
    all_ranks(comm, sorted(seen) == sorted(ref_seen) == [1, 2, 3, 4, 5])
    all_ranks(comm, all(np.allclose(seen[k], ref_seen[k], rtol=RTOL, atol=ATOL) for k in seen))


@pytest.mark.mpi(min_size=1)
def test_batch_norm_sums_in_forward_beside_the_arriving_parts(comm):
    """Batch norm sums its statistics over the ranks during forward and backward, while
    parts of the update are still arriving; their sums go on a communicator of their own,
    so the two never need matching starts: the single-process model at any rank count."""
    shard, X, y = _data(comm)

    def train(comm, shard, sync):
        model = nn.Sequential([nn.Dense(10, 24), nn.BatchNorm(), nn.ReLU(), nn.Dense(24, 16),
                               nn.BatchNorm(), nn.ReLU(), nn.Dense(16, 4)], 10,
                              dtype=np.float64).init_(2)
        dp = mpidp.DataParallel(model, nn.SGD(0.1, momentum=0.9), nn.SoftmaxCrossEntropy(),
                                comm, sync=sync, on_nonfinite="ignore")
        mpidp.fit(dp, shard, 2, 24, seed=3)
        return dp
    dp = train(comm, shard, Overlapped(160, finish="forward"))
    ref = train(MPI.COMM_SELF, mpidp.shard_from_arrays(MPI.COMM_SELF, X, y), "allreduce")
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL),
              f"max diff {np.abs(dp.model.params - ref.model.params).max():.3g}")
    all_ranks(comm, np.allclose(dp.model.state, ref.model.state, rtol=RTOL, atol=ATOL))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("finishes", [("forward", "backward"), ("backward", "forward"),
                                      ("forward", "forward")])
def test_two_trainers_on_one_communicator_stay_apart(comm, finishes):
    """One trainer's sums still arrive between its steps while another, on the same
    communicator, steps (ranks at different moments): each gives its own one-process
    model."""
    import time

    _, X, y = _data(comm, n=96)
    wide = lambda seed: nn.mlp(10, (64, 64, 64), 4, dtype=np.float64).init_(seed)  # noqa: E731
    pairs = []
    for seed, finish in zip((1, 2), finishes):
        dp = mpidp.DataParallel(wide(seed), nn.SGD(0.05), nn.SoftmaxCrossEntropy(), comm,
                                sync=Overlapped(256, finish=finish), on_nonfinite="ignore")
        ref = mpidp.DataParallel(wide(seed), nn.SGD(0.05), nn.SoftmaxCrossEntropy(),
                                 MPI.COMM_SELF, sync="allreduce")
        pairs.append((dp, ref))
    jitter = np.random.default_rng(comm.rank)
    for t in range(12):
        batch = np.arange(24 * (t % 4), 24 * (t % 4 + 1))
        mine = np.array_split(batch, comm.size)[comm.rank]
        for dp, ref in pairs:
            dp.step(X[mine], y[mine])
            ref.step(X[batch], y[batch])
            time.sleep(jitter.uniform(0, 0.002))
    for dp, ref in pairs:
        dp.settle()
        diff = np.abs(dp.model.params - ref.model.params).max()
        all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL),
                  f"rank {comm.rank}: max diff {diff:.3g}")
        all_ranks(comm, dp.in_sync(), "replicas differ")
        dp.close()
        all_ranks(comm, dp.sync.sums is None, "sums kept after close")
