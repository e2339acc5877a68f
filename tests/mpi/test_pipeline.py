"""Pipeline and hybrid training on P ranks equal single-process training (float64).

The pipeline runs over all ranks of the job (P = 1..4 stages); the hybrid needs an even
number of ranks (2 stages x P/2 replicas). The reference is plain ``DataParallel`` on
``COMM_SELF``: one process, the whole model, the same global batches.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import CountingComm, all_ranks, raises_everywhere

import mpidp
from mpidp import nn
from mpidp.data.partition import block_range
from mpidp.parallel import Pipeline, make_trainer, model_layers
from mpidp.parallel.pipeline_feed import fit_pipeline
from mpidp.run.checkpoint import list_checkpoints, restore
from mpidp.run.spec import Checkpointing

RTOL, ATOL = 1e-9, 1e-11  # as in test_data_parallel: summation order differs, nothing else
HIDDEN = (16, 12, 8)  # 7 layers: up to 4 stages with at least one layer each


def _data(n=203, d=7, k=3, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)), rng.integers(0, k, n)


def _reference(X, y, optimizer, epochs, batch_size, hidden=HIDDEN):
    model = nn.mlp(X.shape[1], hidden, 3, dtype=np.float64).init_(np.random.default_rng(11))
    dp = mpidp.DataParallel(model, nn.make_optimizer(optimizer, 0.05), nn.SoftmaxCrossEntropy(),
                            MPI.COMM_SELF)
    history = mpidp.fit(dp, mpidp.shard_from_arrays(MPI.COMM_SELF, X, y), epochs, batch_size, seed=5)
    return model, history


def _pipeline(comm, X, y, parallel, schedule, m, optimizer, epochs, batch_size, hidden=HIDDEN,
              **kw):
    layers, loss = model_layers("mlp", X.shape[1], 3, hidden)
    pipe = make_trainer(parallel, layers, X.shape[1], nn.make_optimizer(optimizer, 0.05), loss,
                        comm, dtype=np.float64, micro_batches=m, schedule=schedule, **kw)
    pipe.init_(np.random.default_rng(11))
    history = fit_pipeline(pipe, (X, y), epochs, batch_size, seed=5)
    return pipe, history


def _check_exact(comm, pipe, history, ref, ref_history):
    full = pipe.gather_params(0)
    diff = float(np.max(np.abs(full - ref.params))) if full is not None else 0.0
    all_ranks(comm, diff <= ATOL + RTOL * float(np.max(np.abs(ref.params))), f"max diff {diff:.3g}")
    lo = pipe.param_offset
    mine = ref.params[lo:lo + pipe.model.n_params]
    all_ranks(comm, np.allclose(pipe.model.params, mine, rtol=RTOL, atol=ATOL), "stage params")
    all_ranks(comm, abs(history[-1]["loss"] - ref_history[-1]["loss"]) < 1e-9, "loss history")
    all_ranks(comm, history[-1]["accuracy"] == ref_history[-1]["accuracy"], "accuracy")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("m,optimizer", [(1, "sgd"), (3, "momentum"), (5, "adam")])
def test_pipeline_matches_single_process(comm, schedule, m, optimizer):
    """203 samples in batches of 24: the last batch (11) is cut unevenly, e.g. 3,2,2,2,2."""
    X, y = _data()
    pipe, hist = _pipeline(comm, X, y, "pipeline", schedule, m, optimizer, 2, 24)
    ref, ref_hist = _reference(X, y, optimizer, 2, 24)
    all_ranks(comm, pipe.n_stages == comm.size and pipe.n_replicas == 1)
    _check_exact(comm, pipe, hist, ref, ref_hist)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_large_messages_left_in_flight_stay_exact(comm, schedule):
    """Activations of 24 x 1024 float64 (192 KiB, past any eager limit) sent while the
    sender moves on to its next op: same parameters as one process, no hang."""
    X, y = _data(n=96, d=32)
    hidden = (1024, 1024, 8)
    pipe, hist = _pipeline(comm, X, y, "pipeline", schedule, 2, "sgd", 1, 48, hidden=hidden)
    ref, ref_hist = _reference(X, y, "sgd", 1, 48, hidden=hidden)
    all_ranks(comm, pipe.counters.p2p_bytes >= (24 * 1024 * 8 if comm.size > 1 else 0))
    _check_exact(comm, pipe, hist, ref, ref_hist)


def _fresh(comm, parallel, schedule, m, optimizer, n_features=7, **kw):
    layers, loss = model_layers("mlp", n_features, 3, HIDDEN)
    pipe = make_trainer(parallel, layers, n_features, nn.make_optimizer(optimizer, 0.05), loss,
                        comm, dtype=np.float64, micro_batches=m, schedule=schedule, **kw)
    return pipe.init_(np.random.default_rng(11))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("parallel,schedule,optimizer", [("pipeline", "gpipe", "momentum"),
                                                        ("pipeline", "1f1b", "adam"),
                                                        ("hybrid", "1f1b", "momentum")])
def test_checkpoint_resume_mid_epoch_equals_uninterrupted(comm, shared_tmp, parallel, schedule,
                                                          optimizer):
    """Checkpoints every 5 steps (mid-epoch: 9 steps per epoch), 'crash' after 2 epochs,
    resume from the newest in a fresh pipeline, finish 3 epochs: bit-identical parameters,
    optimizer step count and loss history to one run of 3 epochs."""
    if parallel == "hybrid" and comm.size % 2:
        pytest.skip("the hybrid needs an even number of ranks")
    X, y = _data()
    ckpt = Checkpointing(f"{shared_tmp}/{parallel}-{schedule}", every=5, keep=2)
    straight = _fresh(comm, parallel, schedule, 3, optimizer)
    ref = fit_pipeline(straight, (X, y), 3, 24, seed=5)
    first = _fresh(comm, parallel, schedule, 3, optimizer)
    fit_pipeline(first, (X, y), 2, 24, seed=5, checkpoint=ckpt)
    files = comm.bcast([p.rsplit("/", 1)[-1] for p in list_checkpoints(ckpt.directory)]
                       if comm.rank == 0 else None)
    all_ranks(comm, files == ["ckpt-0000000015.npz", "ckpt-0000000018.npz"], str(files))
    if comm.rank == 0:  # drop the end-of-run one: resume from step 15, in epoch 2
        os.unlink(f"{ckpt.directory}/{files[-1]}")
    again = _fresh(comm, parallel, schedule, 3, optimizer)
    path, state = again.restore(ckpt.directory)
    all_ranks(comm, (state.epoch, state.step, state.global_step) == (1, 6, 15), str(state))
    hist = fit_pipeline(again, (X, y), 3, 24, seed=5, resume=state)
    all_ranks(comm, np.array_equal(again.model.params, straight.model.params), "params differ")
    all_ranks(comm, again.optimizer.t == straight.optimizer.t == 27)
    all_ranks(comm, [h["loss"] for h in hist] == [h["loss"] for h in ref], "loss history")


@pytest.mark.mpi(min_size=1)
def test_pipeline_checkpoint_resumes_data_parallel_and_back(comm, shared_tmp):
    """The file a pipeline writes is the file data-parallel training writes: a pipeline's
    checkpoint continues as data-parallel training (any ranks), and a data-parallel one as a
    pipeline, both matching single-process training."""
    X, y = _data()
    ref, ref_hist = _reference(X, y, "momentum", 3, 24)
    ckpt = Checkpointing(f"{shared_tmp}/mixed", every=100, keep=1)
    pipe = _fresh(comm, "pipeline", "1f1b", 2, "momentum")
    fit_pipeline(pipe, (X, y), 1, 24, seed=5, checkpoint=ckpt)
    model = nn.mlp(7, HIDDEN, 3, dtype=np.float64)
    dp = mpidp.DataParallel(model, nn.make_optimizer("momentum", 0.05),
                            nn.SoftmaxCrossEntropy(), comm)
    _, state = restore(comm, ckpt.directory, model, dp.optimizer)
    dp_ckpt = Checkpointing(f"{shared_tmp}/mixed-dp", every=100, keep=1)
    lo, hi = block_range(len(X), comm.size, comm.rank)  # this rank's rows
    mpidp.fit(dp, mpidp.shard_from_arrays(comm, X[lo:hi], y[lo:hi]), 2, 24, seed=5,
              resume=state, checkpoint=dp_ckpt)
    back = _fresh(comm, "pipeline", "gpipe", 3, "momentum")
    _, state = back.restore(dp_ckpt.directory)
    hist = fit_pipeline(back, (X, y), 3, 24, seed=5, resume=state)
    _check_exact(comm, back, hist, ref, ref_hist)


@pytest.mark.mpi(min_size=1)
def test_restore_refuses_a_different_model(comm, shared_tmp):
    ckpt = Checkpointing(f"{shared_tmp}/other", every=100, keep=1)
    X, y = _data()
    fit_pipeline(_fresh(comm, "pipeline", "1f1b", 1, "sgd"), (X, y), 1, 48, seed=5,
                 checkpoint=ckpt)
    layers, loss = model_layers("mlp", 7, 3, (16, 12, 9))
    other = make_trainer("pipeline", layers, 7, nn.SGD(0.05), loss, comm, dtype=np.float64)
    raises_everywhere(comm, mpidp.comm.MpidpError,
                      lambda: other.restore(ckpt.directory), "parameters")
    sgd_vs_adam = _fresh(comm, "pipeline", "1f1b", 1, "adam")
    raises_everywhere(comm, mpidp.comm.MpidpError,
                      lambda: sgd_vs_adam.restore(ckpt.directory), "SGD")


class _Probe(nn.Dense):
    """A Dense layer that records whether each backward was asked for dL/dx."""

    asked: list[bool] = []

    def backward(self, dy, accumulate=False, need_input_grad=True):
        _Probe.asked.append(need_input_grad)
        return super().backward(dy, accumulate, need_input_grad)


@pytest.mark.mpi(min_size=1)
def test_first_stage_skips_the_gradient_of_the_data(comm):
    layers, loss = model_layers("mlp", 7, 3, HIDDEN)
    layers[0] = _Probe(7, HIDDEN[0])
    layers[2] = _Probe(HIDDEN[0], HIDDEN[1])
    _Probe.asked = []
    pipe = Pipeline(layers, 7, nn.SGD(0.1), loss, comm, micro_batches=3,
                    dtype=np.float64).init_(0)
    X, y = _data(n=12)
    pipe.step(X, y)
    first, second = layers[0], layers[2]
    mine = [b for b, lo_hi in ((first, 0), (second, 2)) if pipe.lo <= lo_hi < pipe.hi]
    expected = ([False] * 3 if first in mine else []) + ([True] * 3 if second in mine else [])
    all_ranks(comm, sorted(_Probe.asked) == sorted(expected), f"{_Probe.asked} != {expected}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_hybrid_two_stages_times_replicas_matches_single_process(comm, schedule):
    if comm.size % 2:
        pytest.skip("the hybrid needs an even number of ranks")
    X, y = _data()
    pipe, hist = _pipeline(comm, X, y, "hybrid", schedule, 3, "momentum", 2, 24)
    ref, ref_hist = _reference(X, y, "momentum", 2, 24)
    all_ranks(comm, (pipe.n_stages, pipe.n_replicas) == (2, comm.size // 2))
    all_ranks(comm, (pipe.stage, pipe.replica) == (comm.rank % 2, comm.rank // 2))
    _check_exact(comm, pipe, hist, ref, ref_hist)
    all_ranks(comm, pipe.in_sync(), "replicas of a stage differ")


@pytest.mark.mpi(min_size=1)
def test_each_rank_allocates_only_its_stage(comm):
    layers, loss = model_layers("mlp", 7, 3, HIDDEN)
    pipe = Pipeline(layers, 7, nn.SGD(0.1), loss, comm, dtype=np.float64)
    full = nn.mlp(7, HIDDEN, 3, dtype=np.float64)
    b = pipe.plan.bounds
    mine = sum(p.size for layer in full.layers[b[comm.rank]:b[comm.rank + 1]]
               for p in layer.params.values())
    all_ranks(comm, pipe.model.n_params == mine and pipe.model.params.nbytes == mine * 8)
    total = comm.allreduce(pipe.model.n_params)
    all_ranks(comm, total == full.n_params, f"{total} != {full.n_params}")
    pipe.init_(np.random.default_rng(4))
    full.init_(np.random.default_rng(4))  # init_ draws as if the whole model were built
    lo = pipe.param_offset
    all_ranks(comm, np.array_equal(pipe.model.params, full.params[lo:lo + mine]))


@pytest.mark.mpi(min_size=1)
def test_evaluate_equals_single_process(comm):
    X, y = _data(n=57)
    pipe, _ = _pipeline(comm, X, y, "pipeline", "1f1b", 2, "sgd", 1, 16)
    ref, _ = _reference(X, y, "sgd", 1, 16)
    ev = pipe.evaluate(X, y, batch_size=10)
    out = ref.forward(X)
    loss = nn.SoftmaxCrossEntropy()
    expected = loss.forward(out, y)
    all_ranks(comm, abs(ev.loss_sum - expected) < 1e-9 and ev.count == 57)
    all_ranks(comm, ev.correct == loss.n_correct(out, y))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_step_sends_only_buffers_of_the_agreed_shapes(comm, schedule):
    """Per step: Isend/Recv of exactly the activation and gradient bytes, nothing pickled."""
    layers, loss = model_layers("mlp", 7, 3, HIDDEN)
    pipe = Pipeline(layers, 7, nn.SGD(0.1), loss, comm, micro_batches=4, schedule=schedule,
                    dtype=np.float64).init_(0)
    pipe.pipe = CountingComm(pipe.pipe)
    X, y = _data(n=30)
    pipe.step(X, y)
    s, P = pipe.stage, pipe.n_stages
    sent = (30 * pipe.plan.widths[pipe.hi] if s < P - 1 else 0) + (30 * pipe.plan.widths[pipe.lo]
                                                                    if s > 0 else 0)
    all_ranks(comm, pipe.counters.p2p_bytes == sent * 8, f"{pipe.counters.p2p_bytes} != {sent * 8}")
    n_msgs = 4 * ((s < P - 1) + (s > 0))
    calls = pipe.pipe.calls
    all_ranks(comm, sorted(calls) == sorted(["Isend"] * n_msgs + ["Irecv"] * n_msgs), str(calls))


@pytest.mark.mpi(min_size=2)
def test_1f1b_holds_about_P_over_m_of_gpipes_activations(comm):
    P, m = comm.size, 4 * comm.size
    X, y = _data(n=16 * m)
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        layers = [nn.Dense(7, 16), nn.Tanh(), nn.Dense(16, 16), nn.Tanh(), nn.Dense(16, 16),
                  nn.Tanh(), nn.Dense(16, 3), nn.Tanh()]  # equal costs: >= 2 layers per stage
        pipe = Pipeline(layers, 7, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, micro_batches=m,
                        schedule=schedule, dtype=np.float64, costs=[1] * 8).init_(0)
        pipe.step(X, y)
        peaks[schedule] = pipe.counters.peak_cached_bytes
    g, f = peaks["gpipe"], peaks["1f1b"]
    expected = min(P - pipe.stage, m) / m  # micro-batches in flight: P - stage vs m
    all_ranks(comm, g > 0 and f == pytest.approx(expected * g), f"1f1b {f}, gpipe {g}")
    all_ranks(comm, pipe.stage != 0 or f <= P / m * g)


# --- bad input: the same error on every rank, before any rank sends -----------------------

@pytest.mark.mpi(min_size=2)
def test_more_stages_than_layers(comm):
    layers, loss = model_layers("logreg", 7, 3)
    raises_everywhere(comm, mpidp.MpidpError, lambda: make_trainer(
        "pipeline", layers, 7, nn.SGD(0.1), loss, comm), f"more pipeline stages ({comm.size}) than "
        "layers (1)")


@pytest.mark.mpi(min_size=1)
def test_layers_that_do_not_chain(comm):
    layers = [nn.Dense(7, 16), nn.ReLU(), nn.Dense(15, 3)]
    raises_everywhere(comm, mpidp.MpidpError, lambda: Pipeline(
        layers, 7, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm), "do not chain: layer 2")


@pytest.mark.mpi(min_size=3)
def test_ranks_not_a_multiple_of_stages(comm):
    if comm.size % 2 == 0:
        pytest.skip("needs an odd number of ranks")
    layers, loss = model_layers("mlp", 7, 3, HIDDEN)
    raises_everywhere(comm, mpidp.MpidpError, lambda: make_trainer(
        "hybrid", layers, 7, nn.SGD(0.1), loss, comm), "must be a multiple of the number of stages")


@pytest.mark.mpi(min_size=1)
def test_unknown_names(comm):
    layers, loss = model_layers("mlp", 7, 3, HIDDEN)
    raises_everywhere(comm, mpidp.MpidpError, lambda: make_trainer(
        "tensor", layers, 7, nn.SGD(0.1), loss, comm), "unknown parallel mode 'tensor'")
    raises_everywhere(comm, mpidp.MpidpError, lambda: make_trainer(
        "pipeline", layers, 7, nn.SGD(0.1), loss, comm, schedule="zigzag"), "unknown schedule")


@pytest.mark.mpi(min_size=1)
def test_more_micro_batches_than_samples(comm):
    """fit refuses up front (203 samples in batches of 20: the last has 3); a direct step
    refuses before sending; afterwards the same pipeline still trains exactly."""
    X, y = _data()
    layers, loss = model_layers("mlp", 7, 3, HIDDEN)
    pipe = make_trainer("pipeline", layers, 7, nn.make_optimizer("momentum", 0.05), loss, comm,
                        dtype=np.float64, micro_batches=4).init_(np.random.default_rng(11))
    raises_everywhere(comm, mpidp.MpidpError, lambda: fit_pipeline(pipe, (X, y), 1, 20, seed=5),
                      "more micro-batches (4) than samples in a batch: the smallest batch has 3")
    raises_everywhere(comm, ValueError, lambda: pipe.step(X[:3], y[:3]), "more micro-batches (4)")
    all_ranks(comm, pipe.counters.p2p_messages == 0 and pipe.global_step == 0)
    hist = fit_pipeline(pipe, (X, y), 2, 24, seed=5)
    ref, ref_hist = _reference(X, y, "momentum", 2, 24)
    _check_exact(comm, pipe, hist, ref, ref_hist)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("parallel,on_nonfinite", [("pipeline", "stop"), ("pipeline", "ignore"),
                                                   ("hybrid", "skip")])
def test_a_stop_request_on_one_rank_stops_every_stage_at_the_next_step(comm, parallel,
                                                                       on_nonfinite):
    """The last rank asks to stop after step 2: the request rides in the step's one flag
    Allreduce over all ranks (the NaN verdict's), so every stage of every replica raises
    Preempted after step 3, having made exactly one world collective per step (the first
    step's calls also hold the setup's agreements)."""
    from mpidp.run.signals import Preempted, StopSignals
    if parallel == "hybrid" and comm.size % 2:
        pytest.skip("the hybrid needs an even number of ranks")
    X, y = _data()
    layers, loss = model_layers("mlp", 7, 3, HIDDEN)
    pipe = make_trainer(parallel, layers, 7, nn.SGD(0.05), loss, comm, dtype=np.float64,
                        micro_batches=2, on_nonfinite=on_nonfinite).init_(0)
    pipe.world = CountingComm(pipe.world)
    stop, seen = StopSignals(comm), []

    def on_step(epoch, stats):
        seen.append((stats.stop, list(pipe.world.calls)))
        pipe.world.calls.clear()
        if pipe.global_step == 2 and comm.rank == comm.size - 1:
            stop.requested = True

    try:
        err = raises_everywhere(comm, Preempted, lambda: fit_pipeline(
            pipe, (X, y), 2, 24, seed=5, stop=stop, on_step=on_step))
    finally:
        stop.close()
    want = [(False, ["Allreduce"]), (True, ["Allreduce"])]
    all_ranks(comm, "after step 3:" in str(err) and len(seen) == 3 and seen[1:] == want
              and not seen[0][0], f"{err}; {seen}")
