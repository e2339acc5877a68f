"""Every layer keeps the promise: P ranks train the same model as one process (float64),
with uneven shards, an empty one from 3 ranks on, in the synchronous modes that can train
it, and the modes that cannot are refused on every rank before any work."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import all_ranks, raises_everywhere

import mpidp
from mpidp import nn
from mpidp.run.nonfinite import NonFiniteError

# As in test_data_parallel: the same sums in another order differ by ulps; 1e-10 is what
# the project promises, and a wrong statistic (per-rank instead of global, a mask keyed to
# the rank) moves parameters by far more (checked by the per-rank-statistics test below).
TOL = 1e-10
N, BATCH, EPOCHS = 61, 16, 2


def _models() -> dict:
    """name -> (per-sample input shape, integer inputs?, layers factory)."""
    return {
        "conv1d": ((2, 14), False, lambda: [
            nn.Conv1d(4, 3, padding=1), nn.ReLU(), nn.MaxPool(2),
            nn.Conv1d(3, 3, stride=2), nn.Tanh(), nn.AvgPool(2), nn.Reshape(-1),
            nn.Dense(None, 3)]),
        "conv2d": ((1, 6, 6), False, lambda: [
            nn.Conv2d(4, 3, padding=1), nn.ReLU(), nn.AvgPool(2), nn.Conv2d(3, 2),
            nn.GELU(), nn.GlobalAvgPool(), nn.Dense(None, 3)]),
        "maxpool2d": ((2, 6, 6), False, lambda: [
            nn.Conv2d(3, 3, stride=1, padding=1), nn.MaxPool(2), nn.Sigmoid(),
            nn.Flatten(), nn.Dense(None, 3)]),
        "batchnorm-dense": ((7,), False, lambda: [
            nn.Dense(7, 8), nn.BatchNorm(), nn.ReLU(), nn.Dense(8, 3)]),
        "batchnorm-conv": ((2, 5, 5), False, lambda: [
            nn.Conv2d(3, 3), nn.BatchNorm(), nn.LeakyReLU(0.1), nn.Flatten(),
            nn.Dense(None, 3)]),
        "layernorm": ((7,), False, lambda: [
            nn.Dense(7, 8), nn.LayerNorm(), nn.Tanh(), nn.Dense(8, 3)]),
        "dropout": ((7,), False, lambda: [
            nn.Dense(7, 16), nn.ReLU(), nn.Dropout(0.3), nn.Dense(16, 3)]),
        "residual": ((7,), False, lambda: [
            nn.Dense(7, 8), nn.Residual([nn.Dense(8, 8), nn.BatchNorm(), nn.Tanh(),
                                         nn.Dropout(0.2)]), nn.Dense(8, 3)]),
        "embedding": ((5,), True, lambda: [
            nn.Embedding(10, 4), nn.Flatten(), nn.Dense(None, 3)]),
        "softmax-layer": ((7,), False, lambda: [
            nn.Dense(7, 6), nn.Softmax(), nn.Dense(6, 3)]),
    }


MODELS = _models()


def _data(shape, tokens: bool):
    rng = np.random.default_rng(7)
    X = rng.integers(0, 10, (N, *shape)).astype(np.float64) if tokens else \
        rng.standard_normal((N, *shape))
    y = (X.reshape(N, -1).sum(axis=1) > np.median(X.reshape(N, -1).sum(axis=1))).astype(np.int64)
    y[::3] = 2
    return X, y


def _uneven(n: int, size: int) -> np.ndarray:
    """Row counts per rank: uneven, with an empty rank from 3 ranks on."""
    if size == 1:
        return np.array([n])
    w = np.arange(1, size + 1, dtype=np.float64)
    if size >= 3:
        w[1] = 0.0  # rank 1 holds nothing
    counts = np.floor(n * w / w.sum()).astype(int)
    counts[-1] += n - counts.sum()
    return counts


def _train(comm, name: str, sync: str = "allreduce", epochs: int = EPOCHS,
           per_rank_statistics: bool = False):
    shape, tokens, make = MODELS[name]
    X, y = _data(shape, tokens)
    counts = _uneven(N, comm.size)
    lo = int(counts[:comm.rank].sum())
    shard = mpidp.shard_from_arrays(comm, X[lo:lo + counts[comm.rank]],
                                    y[lo:lo + counts[comm.rank]])
    model = nn.Sequential(make(), shape, np.float64).init_(np.random.default_rng(3))
    dp = mpidp.DataParallel(model, nn.make_optimizer("momentum", 0.05), nn.SoftmaxCrossEntropy(),
                            comm, sync=sync)
    if per_rank_statistics:
        dp.model.context.reduce_sum = lambda a: a
    test = mpidp.shard_from_arrays(comm, X[lo:lo + counts[comm.rank]],
                                   y[lo:lo + counts[comm.rank]])
    history = mpidp.fit(dp, shard, epochs, BATCH, seed=5, test=test)
    return dp, history


def _close(comm, a: np.ndarray, b: np.ndarray, what: str) -> None:
    err = float(np.max(np.abs(a - b), initial=0.0))
    all_ranks(comm, a.shape == b.shape and err <= TOL, f"{what}: max difference {err:.3g}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", list(MODELS))
def test_every_layer_trains_the_same_model_at_any_number_of_ranks(comm, name):
    ref, ref_hist = _train(MPI.COMM_SELF, name)
    dp, hist = _train(comm, name)
    _close(comm, dp.model.params, ref.model.params, f"{name} parameters")
    _close(comm, dp.model.state, ref.model.state, f"{name} layer state")
    all_ranks(comm, abs(hist[-1]["test_loss"] - ref_hist[-1]["test_loss"]) <= TOL,
              f"{name} test loss {hist[-1]['test_loss']} != {ref_hist[-1]['test_loss']}")
    all_ranks(comm, dp.in_sync(), "replicas differ")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sync", ["per-layer", "overlapped", "compressed", "ps", "sharded-ps",
                                  "accumulate"])
def test_batchnorm_and_dropout_in_every_synchronous_mode(comm, sync):
    """Global statistics and sample-keyed masks under each strategy equal the allreduce run
    (compressed: exactly what the codec makes of the same gradients on one process)."""
    if sync == "compressed":  # 16-bit codes: compare against itself at one process' order
        dp, _ = _train(comm, "residual", sync)
        all_ranks(comm, np.isfinite(dp.model.params).all() and dp.in_sync(), "diverged")
        return
    ref, _ = _train(MPI.COMM_SELF, "residual", "accumulate" if sync == "accumulate" else
                    "allreduce")  # accumulation: a larger global batch, on one process too
    dp, _ = _train(comm, "residual", sync)
    _close(comm, dp.model.params, ref.model.params, f"{sync} parameters")
    _close(comm, dp.model.state, ref.model.state, f"{sync} running statistics")


@pytest.mark.mpi(min_size=2)
def test_per_rank_statistics_fail_the_replica_check(comm):
    """The check above can fail: batch norm over each rank's own rows (what a layer that
    does not ask for the replica sums computes) leaves running statistics that differ
    between replicas, and fit names the layer and the rule it breaks."""
    raises_everywhere(comm, mpidp.MpidpError, lambda: _train(
        comm, "batchnorm-dense", per_rank_statistics=True), "(BatchNorm(momentum=0.1, "
        "eps=1e-05)): its state differs from rank 0's on ranks")


@pytest.mark.mpi(min_size=2)
def test_local_sgd_and_async_refuse_batchnorm_on_every_rank(comm):
    shape, _, make = MODELS["batchnorm-dense"]
    model = nn.Sequential(make(), shape, np.float64)
    raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.DataParallel(
        model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, sync="local-sgd"),
        "--sync local-sgd cannot train a model with BatchNorm")
    from mpidp.parallel.async_ps import AsyncPS
    raises_everywhere(comm, mpidp.MpidpError, lambda: AsyncPS(
        model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm),
        "--sync async-ps cannot train a model with BatchNorm")


class GroupScale(nn.Layer):
    """A user's layer that scales by a sum over the replica group (it needs replica sums)."""

    needs = frozenset({"replica-sums"})

    def forward(self, x):
        return x / max(self.context.reduce_sum(np.array([float(len(x))]))[0], 1.0)

    def backward(self, dy, accumulate=False, need_input_grad=True):
        return dy


@pytest.mark.mpi(min_size=2)
def test_local_sgd_refuses_a_users_layer_that_needs_replica_sums_by_its_name(comm):
    """It used to be refused as if it were a BatchNorm."""
    model = nn.Sequential([nn.Dense(4, 3), nn.Residual([nn.ReLU(), GroupScale()])], 4)
    err = raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.DataParallel(
        model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, sync="local-sgd"),
        "local-sgd cannot train a model with GroupScale (it needs sums over the replicas)")
    assert "BatchNorm" not in str(err)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name, layer", [("batchnorm-dense", "BatchNorm"), ("dropout", "Dropout")])
def test_a_pipeline_refuses_batchnorm_and_dropout_on_every_rank(comm, name, layer):
    from mpidp.parallel import Pipeline
    shape, _, make = MODELS[name]
    raises_everywhere(comm, mpidp.MpidpError, lambda: Pipeline(
        make(), shape, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm),
        f"--parallel pipeline cannot train a model with {layer}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", ["conv1d", "conv2d", "layernorm", "embedding"])
def test_a_pipeline_of_shaped_layers_matches_data_parallel(comm, name):
    """Activations of any per-sample shape travel between stages."""
    from mpidp.parallel import make_trainer
    from mpidp.parallel.pipeline_feed import fit_pipeline
    shape, tokens, make = MODELS[name]
    ref, _ = _train(MPI.COMM_SELF, name, epochs=1)
    X, y = _data(shape, tokens)
    stages = comm.size if comm.size <= 3 else 2  # 4 ranks: 2 replicas of 2 stages (hybrid)
    pipe = make_trainer("pipeline" if stages == comm.size else "hybrid", make(), shape,
                        nn.make_optimizer("momentum", 0.05), nn.SoftmaxCrossEntropy(), comm,
                        dtype=np.float64, micro_batches=2, n_stages=stages)
    pipe.init_(np.random.default_rng(3))
    fit_pipeline(pipe, (X, y), 1, BATCH, seed=5)
    whole = pipe.gather_params(0)
    ok = whole is None or float(np.max(np.abs(whole - ref.model.params))) <= TOL
    all_ranks(comm, ok, f"{name}: the pipeline's parameters differ from one process'")



def _bn_steps(comm, steps: list[int], policy: str):
    """Batch norm trained by ``dp.step`` on global batches ``steps`` of 24 rows (uneven
    shares); batch 1's last row holds a NaN. Returns the trainer and the error a step
    raised (training ends there), or None."""
    rng = np.random.default_rng(11)
    X, y = rng.standard_normal((4, 24, 5)), rng.integers(0, 3, (4, 24))
    X[1, -1, 2] = np.nan
    model = nn.Sequential([nn.Dense(5, 6), nn.BatchNorm(), nn.ReLU(), nn.Dense(6, 3)], (5,),
                          np.float64).init_(np.random.default_rng(3))
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm,
                            on_nonfinite=policy)
    counts = _uneven(24, comm.size)
    lo, hi = int(counts[:comm.rank].sum()), int(counts[:comm.rank + 1].sum())
    try:
        for b in steps:
            dp.step(X[b, lo:hi], y[b, lo:hi])
    except NonFiniteError as exc:
        return dp, exc
    return dp, None


@pytest.mark.mpi(min_size=1)
def test_a_skipped_or_stopped_step_leaves_the_running_statistics_as_they_were(comm):
    """A NaN batch moves batch norm's running statistics in its forward pass; the step the
    NaN policy drops (skip) or stops at (stop) must leave them, as it leaves the
    parameters, where the last good step put them (they poisoned every later evaluation)."""
    skipped, _ = _bn_steps(comm, [0, 1, 2], "skip")
    ref, _ = _bn_steps(MPI.COMM_SELF, [0, 2], "skip")
    all_ranks(comm, skipped.skipped_steps == 1, f"skipped {skipped.skipped_steps}")
    _close(comm, skipped.model.params, ref.model.params, "parameters after a skipped step")
    _close(comm, skipped.model.state, ref.model.state, "running statistics after a skipped step")
    stopped, err = _bn_steps(comm, [0, 1], "stop")
    good, _ = _bn_steps(MPI.COMM_SELF, [0], "stop")
    all_ranks(comm, err is not None, "no NonFiniteError at the NaN batch")
    _close(comm, stopped.model.state, good.model.state, "running statistics after a stop")
    _close(comm, stopped.model.params, good.model.params, "parameters after a stop")
