"""Data-parallel training on P ranks equals single-process training (float64)."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import CountingComm, all_ranks, raises_everywhere

import mpidp
from mpidp import nn
from mpidp.comm import checksum
from mpidp.run.nonfinite import all_finite

# Tolerance: P ranks and one process add the same per-sample gradients in a different
# order, so each step's gradient differs by a few ulps (~1e-16 relative); a few dozen
# steps of smooth, small-lr training keep that below ~1e-13 (measured ~1e-15). 1e-9 leaves
# four orders of margin, while any real error (a local instead of global count, a
# missing or doubled sample) moves parameters by >= 1e-4.
RTOL, ATOL = 1e-9, 1e-11


def _train(comm, spec="synthetic", distribute="scatter", init_sync="bcast", optimizer="momentum",
           epochs=2, batch_size=24, n_samples=203, model="mlp", **kw):
    data = mpidp.load(comm, spec, distribute=distribute, seed=3, dtype=np.float64,
                      n_samples=n_samples, n_features=7, n_classes=None if model == "linear" else 3,
                      regression=model == "linear", **kw)
    net, loss = nn.build(model, data.n_features, data.n_outputs, (16, 8), np.float64,
                         data.classification)
    net.init_(np.random.default_rng(11))
    opt = nn.make_optimizer(optimizer, 0.05)
    dp = mpidp.DataParallel(net, opt, loss, comm, init_sync=init_sync)
    history = mpidp.fit(dp, data.train, epochs, batch_size, seed=5, test=data.test)
    return dp, history


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("distribute", ["scatter", "local"])
@pytest.mark.parametrize("init_sync", ["bcast", "seed"])
@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
def test_matches_single_process(comm, distribute, init_sync, optimizer):
    dp, hist = _train(comm, distribute=distribute, init_sync=init_sync, optimizer=optimizer)
    ref, ref_hist = _train(MPI.COMM_SELF, optimizer=optimizer)
    close = np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL)
    all_ranks(comm, close, f"max diff {np.max(np.abs(dp.model.params - ref.model.params)):.3g}")
    all_ranks(comm, dp.in_sync(), "replicas differ")
    all_ranks(comm, abs(hist[-1]["loss"] - ref_hist[-1]["loss"]) < 1e-9)
    all_ranks(comm, hist[-1]["test_accuracy"] == ref_hist[-1]["test_accuracy"])


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n_samples,batch_size", [(3, 2), (5, 4), (13, 5), (64, 64)])
def test_tiny_and_uneven_shards_are_exact(comm, n_samples, batch_size):
    """n < P (empty ranks), n not divisible by P, batches smaller than P."""
    dp, _ = _train(comm, n_samples=n_samples, batch_size=batch_size, test_fraction=0.0, epochs=3)
    ref, _ = _train(MPI.COMM_SELF, n_samples=n_samples, batch_size=batch_size,
                    test_fraction=0.0, epochs=3)
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL))
    all_ranks(comm, dp.timer.steps == 3 * -(-n_samples // batch_size), "step counts differ")


@pytest.mark.mpi(min_size=1)
def test_linear_regression_matches_single_process(comm):
    dp, _ = _train(comm, model="linear", optimizer="sgd", epochs=3)
    ref, _ = _train(MPI.COMM_SELF, model="linear", optimizer="sgd", epochs=3)
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL))


@pytest.mark.mpi(min_size=1)
def test_step_is_global_mean_gradient_of_plain_formula(comm):
    """One step of softmax regression equals the closed-form full-batch gradient step."""
    rng = np.random.default_rng(0)
    X, y = rng.standard_normal((37, 5)), rng.integers(0, 4, 37)
    W0 = rng.standard_normal((5, 4))
    rows = np.array_split(np.arange(37), comm.size)[comm.rank]
    model = nn.logreg(5, 4, np.float64)
    model.layers[0].params["W"][...] = W0
    dp = mpidp.DataParallel(model, nn.SGD(0.5), nn.SoftmaxCrossEntropy(), comm)
    stats = dp.step(X[rows], y[rows])
    z = X @ W0
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    onehot = np.eye(4)[y]
    W1 = W0 - 0.5 * X.T @ (p - onehot) / 37
    b1 = -0.5 * (p - onehot).sum(0) / 37
    ok = np.allclose(model.layers[0].params["W"], W1, rtol=1e-12, atol=1e-14) and \
        np.allclose(model.layers[0].params["b"], b1, rtol=1e-12, atol=1e-14)
    all_ranks(comm, ok)
    all_ranks(comm, stats.count == 37 and abs(stats.loss - np.mean(-np.log(p[np.arange(37), y]))) < 1e-12)


@pytest.mark.mpi(min_size=1)
def test_one_allreduce_per_step_and_one_bcast_for_init(comm):
    counting = CountingComm(comm)
    model = nn.mlp(6, (10,), 3, dtype=np.float32).init_(0)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), counting)
    # the arguments agreed, the initial broadcast, the node layout (node-aware or not: the
    # testing variable MPIDP_RANKS_PER_NODE agreed on, the node split, the verdict)
    layout = ["Allreduce", "Split_type", "Allreduce"] if comm.size > 1 else []
    all_ranks(comm, counting.calls == ["Allreduce", "Bcast", *layout],
              f"init made {counting.calls}")
    counting.calls.clear()
    rng = np.random.default_rng(comm.rank)
    for _ in range(10):
        dp.step(rng.standard_normal((4, 6)).astype(np.float32), rng.integers(0, 3, 4))
    all_ranks(comm, counting.calls == ["Allreduce"] * 10, f"10 steps made {counting.calls}")


@pytest.mark.mpi(min_size=1)
def test_big_buffers_need_no_collective_for_the_nan_check(comm):
    """Every rank holds the same reduced sums and checks all of them: still one Allreduce
    per step for a buffer over 1 MiB."""
    counting = CountingComm(comm)
    model = nn.mlp(512, (512,), 10, dtype=np.float32).init_(0)  # 1.03 MiB of float32
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), counting)
    assert dp.buf.nbytes >= 1 << 20
    counting.calls.clear()
    rng = np.random.default_rng(comm.rank)
    for _ in range(3):
        dp.step(rng.standard_normal((4, 512)).astype(np.float32), rng.integers(0, 10, 4))
    all_ranks(comm, counting.calls == ["Allreduce"] * 3, f"3 steps made {counting.calls}")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_check_sees_every_position_of_the_reduced_buffer(comm, bad):
    """A bad value anywhere in the reduced buffer -- first or last gradient, the loss or
    the stop slot -- gives False; huge finite values (whose squares overflow the dot
    product) and a clean buffer give True."""
    model = nn.mlp(512, (512,), 10, dtype=np.float32).init_(0)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm)
    buf = np.random.default_rng(1).standard_normal(dp.buf.size).astype(np.float32)
    verdicts = []
    for i in sorted({0, buf.size // 2, model.n_params - 1, model.n_params, buf.size - 1}):
        b = buf.copy()
        b[i] = bad
        verdicts.append(all_finite(b) is False)
    huge = buf.copy()
    huge[-2] = 3e38  # finite; its square overflows
    verdicts += [all_finite(buf), all_finite(huge)]
    all_ranks(comm, all(verdicts), str(verdicts))


@pytest.mark.mpi(min_size=1)
def test_gradients_are_views_in_the_reduced_buffer(comm):
    model = nn.mlp(4, (5,), 2, dtype=np.float64).init_(0)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm)
    for layer in model.layers:
        for g in layer.grads.values():
            assert np.shares_memory(g, dp.buf)
    assert np.shares_memory(model.grads, dp.buf) and model.grads.base is not None


@pytest.mark.mpi(min_size=2)
def test_bcast_init_overrides_different_local_inits(comm):
    model = nn.mlp(4, (8,), 3, dtype=np.float64).init_(100 + comm.rank)  # differs per rank
    root_params = comm.bcast(model.params.copy() if comm.rank == 0 else None)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, init_sync="bcast")
    all_ranks(comm, np.array_equal(model.params, root_params))
    all_ranks(comm, dp.in_sync())


@pytest.mark.mpi(min_size=2)
def test_seed_init_with_different_seeds_fails_on_every_rank(comm):
    model = nn.mlp(4, (8,), 3).init_(comm.rank)
    err = raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.DataParallel(
        model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, init_sync="seed"), "out of sync")
    all_ranks(comm, "[1" in str(err), str(err))


@pytest.mark.mpi(min_size=2)
def test_desync_check_names_the_odd_rank(comm):
    params = np.arange(1000, dtype=np.float64)
    all_ranks(comm, mpidp.params_in_sync(comm, params))
    odd = comm.size - 1
    if comm.rank == odd:
        params[500] = np.nextafter(params[500], np.inf)  # one ulp
    all_ranks(comm, not mpidp.params_in_sync(comm, params))
    err = raises_everywhere(comm, mpidp.MpidpError, lambda: mpidp.assert_in_sync(comm, params))
    all_ranks(comm, f"ranks [{odd}]" in str(err), str(err))
    all_ranks(comm, checksum(params) == checksum(params.copy()))
