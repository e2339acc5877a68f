"""LAMB, LARS and gradient clipping under a warmup + cosine schedule keep the promise: P ranks
train the same float64 model as one process, in every synchronous mode (uneven shards, an
empty one from 3 ranks on), as a pipeline or hybrid, and through a checkpoint taken
mid-schedule (bit-identical on the same ranks, to 1e-10 on one process).

Their per-tensor norms span slices (sharded-ps blocks, pipeline stages), so a mode that
took norms of its own slice only would train another model: the sharded and pipeline runs
below catch it (tensors are cut across blocks and stages).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import all_ranks

import mpidp
from mpidp import nn
from mpidp.nn.schedules import Cosine, Warmup
from mpidp.run.checkpoint import list_checkpoints

TOL = 1e-10
N, BATCH, EPOCHS = 61, 16, 2  # 4 steps per epoch (the last of 13 samples)
WARMUP, TOTAL = 3, 6  # updates: a ramp, then a cosine to a tenth of the rate


def _optimizer(name: str) -> nn.Optimizer:
    """Clipping thresholds below the gradients' norms here, so clipping acts."""
    def rate(lr):
        return Warmup(Cosine(lr, TOTAL, lr * 0.1), WARMUP)
    if name == "lamb":
        return nn.LAMB(rate(0.02), weight_decay=0.01, clip_norm=0.5)
    if name == "lars":
        return nn.LARS(rate(3.0), momentum=0.9, weight_decay=1e-3, eta=0.02, clip_norm=0.5)
    if name == "clip":
        return nn.SGD(rate(0.2), momentum=0.9, clip_norm=0.3)
    raise ValueError(name)


OPTIMIZERS = ("lamb", "lars", "clip")


def _layers():
    """Tensors of 2 and 1 dimensions (LayerNorm's scale and shift are left out of the trust
    ratios), 12 of 91 parameters per rank at 4 ranks: blocks cut tensors."""
    return [nn.Dense(7, 8), nn.LayerNorm(), nn.Tanh(), nn.Dense(8, 3)]


def _data():
    rng = np.random.default_rng(7)
    X = rng.standard_normal((N, 7)) * 2.0
    y = rng.integers(0, 3, N)
    return X, y


def _uneven(n: int, size: int) -> np.ndarray:
    """Row counts per rank: uneven, with an empty rank from 3 ranks on."""
    if size == 1:
        return np.array([n])
    w = np.arange(1, size + 1, dtype=np.float64)
    if size >= 3:
        w[1] = 0.0
    counts = np.floor(n * w / w.sum()).astype(int)
    counts[-1] += n - counts.sum()
    return counts


def _shard(comm, counts=None):
    X, y = _data()
    counts = _uneven(N, comm.size) if counts is None else counts
    lo = int(counts[:comm.rank].sum())
    return mpidp.shard_from_arrays(comm, X[lo:lo + counts[comm.rank]], y[lo:lo + counts[comm.rank]])


def _sync(name: str):
    if name == "ps":  # pieces of 64 bytes: the server updates (and ships) in 12+ chunks
        from mpidp.parallel.ps import ParameterServer
        return ParameterServer(chunk_bytes=64)
    if name == "accumulate":  # 2 updates per epoch of 4 steps
        from mpidp.parallel.sync import Accumulate
        return Accumulate(2)
    return name


def _dp(comm, opt: str, sync: str = "allreduce") -> mpidp.DataParallel:
    model = nn.Sequential(_layers(), 7, np.float64).init_(np.random.default_rng(3))
    return mpidp.DataParallel(model, _optimizer(opt), nn.SoftmaxCrossEntropy(), comm,
                              sync=_sync(sync))


def _train(comm, opt: str, sync: str = "allreduce", epochs: int = EPOCHS, **kw):
    dp, norms = _dp(comm, opt, sync), []
    history = mpidp.fit(dp, _shard(comm), epochs, BATCH, seed=5,
                        on_step=lambda step, s: norms.append(dp.optimizer.last_grad_norm), **kw)
    return dp, history, norms


_REFERENCE: dict = {}


def _reference(opt: str, sync: str = "allreduce", epochs: int = EPOCHS):
    """One process: the whole model, the same global batches (cached per module)."""
    key = (opt, sync, epochs)
    if key not in _REFERENCE:
        _REFERENCE[key] = _train(MPI.COMM_SELF, opt, sync, epochs)
    return _REFERENCE[key]


def _close(comm, a, b, what: str) -> None:
    ok = a is not None and b is not None and np.shape(a) == np.shape(b)
    err = float(np.max(np.abs(np.asarray(a) - np.asarray(b)), initial=0.0)) if ok else np.inf
    all_ranks(comm, err <= TOL, f"{what}: max difference {err:.3g}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("sync", ["allreduce", "per-layer", "overlapped", "ps", "sharded-ps",
                                  "accumulate"])
def test_the_same_model_at_any_number_of_ranks_in_every_synchronous_mode(comm, opt, sync):
    if sync == "ps" and comm.size < 2:
        pytest.skip("a parameter server needs 2 ranks")
    ref, ref_hist, ref_norms = _reference(opt, "accumulate" if sync == "accumulate" else "allreduce")
    dp, hist, norms = _train(comm, opt, sync)
    _close(comm, dp.model.params, ref.model.params, f"{opt}/{sync} parameters")
    all_ranks(comm, dp.in_sync(), "replicas differ")
    all_ranks(comm, abs(hist[-1]["loss"] - ref_hist[-1]["loss"]) <= TOL, "loss history")
    # the clipping acted, and the norm it clipped is the one-process norm (ps: the server's)
    clipped = [n for n in ref_norms if n is not None and n > _optimizer(opt).clip_norm]
    all_ranks(comm, len(clipped) >= 2, f"clipping never acted: {ref_norms}")
    server = sync != "ps" or comm.rank == 0  # only the ps server's optimizer steps
    got = [n for n in norms if n is not None] if server else [n for n in ref_norms if n]
    want = [n for n in ref_norms if n is not None]
    _close(comm, np.array(got), np.array(want), "pre-clip gradient norms")
    all_ranks(comm, not server or dp.optimizer.t == ref.optimizer.t,
              f"t {dp.optimizer.t} != {ref.optimizer.t}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sync", ["compressed", "local-sgd"])
def test_compressed_and_local_sgd_train_finite_equal_replicas(comm, sync):
    """16-bit codes and local steps are not the one-process arithmetic; they still train
    with every optimizer (local SGD: each rank's own norms) and end with equal replicas."""
    for opt in OPTIMIZERS:
        dp, hist, _ = _train(comm, opt, sync)
        all_ranks(comm, np.isfinite(dp.model.params).all() and np.isfinite(hist[-1]["loss"]),
                  f"{opt}/{sync} diverged")
        all_ranks(comm, dp.in_sync(), f"{opt}/{sync}: replicas differ")


@pytest.mark.mpi(min_size=2)
def test_sharded_slices_without_the_reduction_would_give_another_model(comm):
    """The check above can fail: a sharded run whose norms are each block's own differs."""
    from mpidp.parallel.ps import ShardedParameterServer
    ref, _, _ = _reference("lamb")

    class LocalNorms(ShardedParameterServer):
        def setup(self, s):
            out = super().setup(s)
            self.optimizer.reduce_sum = None  # each block's own partial norms
            return out

    model = nn.Sequential(_layers(), 7, np.float64).init_(np.random.default_rng(3))
    dp = mpidp.DataParallel(model, _optimizer("lamb"), nn.SoftmaxCrossEntropy(), comm,
                            sync=LocalNorms(lambda: _optimizer("lamb")))
    mpidp.fit(dp, _shard(comm), EPOCHS, BATCH, seed=5)
    err = float(np.max(np.abs(dp.model.params - ref.model.params)))
    all_ranks(comm, err > 1e-6, f"block-local norms differ by only {err:.3g}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("opt", OPTIMIZERS)
def test_async_ps_with_one_worker_is_the_one_process_run(comm, opt):
    """The async server updates the whole vector: with one worker holding every row (no
    staleness) it is single-process training; with more it trains finite parameters."""
    from mpidp.parallel.async_ps import AsyncPS, fit_async
    counts = np.zeros(comm.size, int)
    counts[1:] = _uneven(N, comm.size - 1)
    model = nn.Sequential(_layers(), 7, np.float64).init_(np.random.default_rng(3))
    ps = AsyncPS(model, _optimizer(opt), nn.SoftmaxCrossEntropy(), comm, max_staleness=100)
    fit_async(ps, _shard(comm, counts), EPOCHS, BATCH, seed=5)
    if comm.size == 2:
        ref, _, _ = _reference(opt)
        _close(comm, model.params, ref.model.params, f"async {opt} parameters")
    all_ranks(comm, np.isfinite(model.params).all(), "diverged")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("opt", OPTIMIZERS)
@pytest.mark.parametrize("parallel", ["pipeline", "hybrid"])
def test_a_pipeline_or_hybrid_equals_data_parallel(comm, parallel, opt):
    """Stages hold slices of the model (a stage of Tanh alone holds none); the norms are
    summed over the pipeline's stages, not over the replicas (which hold equal copies)."""
    from mpidp.parallel import make_trainer
    from mpidp.parallel.pipeline_feed import fit_pipeline
    if parallel == "hybrid" and comm.size % 2:
        pytest.skip("the hybrid needs an even number of ranks")
    ref, ref_hist, _ = _reference(opt)
    pipe = make_trainer(parallel, _layers(), 7, _optimizer(opt), nn.SoftmaxCrossEntropy(), comm,
                        dtype=np.float64, micro_batches=2,
                        n_stages=2 if parallel == "hybrid" else None)
    pipe.init_(np.random.default_rng(3))
    hist = fit_pipeline(pipe, _data(), EPOCHS, BATCH, seed=5)
    whole = pipe.gather_params(0)
    ok = whole is None or float(np.max(np.abs(whole - ref.model.params))) <= TOL
    all_ranks(comm, ok, f"{parallel} {opt}: parameters differ from one process'")
    lo = pipe.param_offset
    _close(comm, pipe.model.params, ref.model.params[lo:lo + pipe.model.n_params], "stage")
    all_ranks(comm, pipe.optimizer.t == ref.optimizer.t)
    _close(comm, pipe.optimizer.last_grad_norm, ref.optimizer.last_grad_norm, "last norm")
    all_ranks(comm, abs(hist[-1]["loss"] - ref_hist[-1]["loss"]) <= TOL, "loss history")


def _crash_and_resume(comm, directory, make, fit, restore):
    """Checkpoints every 3 steps; 'crash' after 2 epochs (8 steps) and drop the end-of-run
    checkpoint, so the newest is step 6: mid-epoch, mid-cosine. Returns the restored
    trainer and its state."""
    fit(make(), 2, mpidp.Checkpointing(directory, every=3, keep=2))
    files = comm.bcast([p.rsplit("/", 1)[-1] for p in list_checkpoints(directory)]
                       if comm.rank == 0 else None)
    all_ranks(comm, files == ["ckpt-0000000006.npz", "ckpt-0000000008.npz"], str(files))
    if comm.rank == 0:
        os.unlink(f"{directory}/{files[-1]}")
    comm.Barrier()
    again = make()
    _, state = restore(again, directory)
    all_ranks(comm, (state.epoch, state.step, state.global_step) == (1, 2, 6), str(state))
    all_ranks(comm, again.optimizer.t == 6, f"t = {again.optimizer.t}")
    return again, state


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("sync", ["allreduce", "sharded-ps"])
@pytest.mark.parametrize("opt", ["lamb", "lars"])
def test_a_checkpoint_mid_schedule_resumes_bit_identically(comm, shared_tmp, sync, opt):
    """Resumed on the same ranks: bit-identical parameters, step count and losses to one
    uninterrupted run; resumed on one process (another rank count): the same model to
    1e-10 as one process trained straight through."""
    directory = f"{shared_tmp}/{sync}-{opt}"
    shard = _shard(comm)

    def fit(dp, epochs, checkpoint=None, resume=None):
        return mpidp.fit(dp, shard, epochs, BATCH, seed=5, checkpoint=checkpoint, resume=resume)

    straight = _dp(comm, opt, sync)
    ref_hist = fit(straight, 3)
    again, state = _crash_and_resume(comm, directory, lambda: _dp(comm, opt, sync),
                                     fit, lambda dp, d: dp.restore(d))
    all_ranks(comm, again.optimizer.lr == straight.optimizer.lr_at(6), "the rate at step 6")
    hist = fit(again, 3, resume=state)
    all_ranks(comm, np.array_equal(again.model.params, straight.model.params), "params differ")
    all_ranks(comm, again.optimizer.t == straight.optimizer.t == 12)
    all_ranks(comm, [h["loss"] for h in hist] == [h["loss"] for h in ref_hist], "loss history")
    # another rank count: every rank resumes the P-rank checkpoint on its own
    alone = _dp(MPI.COMM_SELF, opt)
    _, state = alone.restore(directory)
    X, y = _data()
    mpidp.fit(alone, mpidp.shard_from_arrays(MPI.COMM_SELF, X, y), 3, BATCH, seed=5,
              resume=state)
    ref, _, _ = _reference(opt, epochs=3)
    _close(comm, alone.model.params, ref.model.params, "resumed on one process")


@pytest.mark.mpi(min_size=1)
def test_a_pipeline_checkpoint_mid_schedule_resumes_bit_identically(comm, shared_tmp):
    from mpidp.parallel import make_trainer
    from mpidp.parallel.pipeline_feed import fit_pipeline
    X, y = _data()

    def make():
        pipe = make_trainer("pipeline", _layers(), 7, _optimizer("lamb"),
                            nn.SoftmaxCrossEntropy(), comm, dtype=np.float64, micro_batches=2)
        return pipe.init_(np.random.default_rng(3))

    def fit(pipe, epochs, checkpoint=None, resume=None):
        return fit_pipeline(pipe, (X, y), epochs, BATCH, seed=5, checkpoint=checkpoint,
                            resume=resume)

    straight = make()
    ref_hist = fit(straight, 3)
    again, state = _crash_and_resume(comm, f"{shared_tmp}/pipe", make, fit,
                                     lambda p, d: p.restore(d))
    hist = fit(again, 3, resume=state)
    all_ranks(comm, np.array_equal(again.model.params, straight.model.params), "params differ")
    all_ranks(comm, again.optimizer.t == straight.optimizer.t == 12)
    all_ranks(comm, [h["loss"] for h in hist] == [h["loss"] for h in ref_hist], "loss history")
