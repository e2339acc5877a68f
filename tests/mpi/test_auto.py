"""``--sync auto``: trial steps are ordinary exact steps, every rank commits to the same
strategy at the same step, and the slowest rank's timings decide."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from mpi_helpers import all_ranks

import mpidp
from mpidp import nn
from mpidp.parallel import auto as A
from mpidp.parallel.modes import make_sync

RTOL, ATOL = 1e-9, 1e-11


def _data(comm, n=400, d=6):
    rng = np.random.default_rng(3)
    X, y = rng.standard_normal((n, d)), rng.integers(0, 3, n)
    rows = np.array_split(np.arange(n), comm.size)[comm.rank]
    return X, y, rows


def _train(comm, X, y, sync, dtype=np.float64, epochs=2):
    model = nn.mlp(X.shape[1], (10,), 3, dtype=dtype).init_(5)
    dp = mpidp.DataParallel(model, nn.Adam(0.01), nn.SoftmaxCrossEntropy(), comm, sync=sync)
    hist = mpidp.fit(dp, mpidp.shard_from_arrays(comm, X.astype(dtype), y), epochs, 16, seed=6)
    return dp, hist


@pytest.mark.mpi(min_size=1)
def test_auto_trains_the_one_process_model_in_float64(comm):
    X, y, rows = _data(comm)
    sync = make_sync("auto", bucket_bytes=64)
    dp, hist = _train(comm, X[rows], y[rows], sync)
    ref, ref_hist = _train(MPI.COMM_SELF, X, y, make_sync("allreduce"))
    labels = comm.allgather(sync.report)
    all_ranks(comm, sync.choice is not None and len(set(labels)) == 1, f"{labels}")
    all_ranks(comm, not any("compressed" in label for label in sync.labels),
              f"float64 tried {sync.labels}")
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=RTOL, atol=ATOL),
              f"max diff {np.abs(dp.model.params - ref.model.params).max():.3g}")
    all_ranks(comm, dp.in_sync() and abs(hist[-1]["loss"] - ref_hist[-1]["loss"]) < 1e-9)
    if comm.size > 1:  # every candidate ran its trials
        all_ranks(comm, len(sync.candidates) == 3 and "auto: " in sync.report
                  and f"steps {A.WARMUP + 1}-{A.WARMUP + A.TRIALS * 3}" in sync.report,
                  sync.report)


@pytest.mark.mpi(min_size=2)
def test_auto_tries_compression_for_float32_and_keeps_replicas_identical(comm):
    X, y, rows = _data(comm)
    sync = make_sync("auto")
    dp, _ = _train(comm, X[rows], y[rows], sync, dtype=np.float32)
    tried = [label for label in sync.labels if "compressed" in label]
    all_ranks(comm, tried == ["compressed (bfloat16)", "compressed (int8)"], f"{sync.labels}")
    all_ranks(comm, sync.choice in sync.candidates and dp.in_sync(), sync.report)
    only = make_sync("auto", codec="float16")  # a codec asked for: only that one is tried
    _train(comm, X[rows], y[rows], only, dtype=np.float32)
    all_ranks(comm, [lb for lb in only.labels if "compressed" in lb] == ["compressed (float16)"])


@pytest.mark.mpi(min_size=2)
def test_the_slowest_rank_decides(comm):
    """Each rank finds a different candidate fastest; the max over ranks picks one for all."""
    X, y, rows = _data(comm)
    sync = make_sync("auto", bucket_bytes=64)  # per layer and one bucket: 3 candidates
    _train(comm, X[rows], y[rows], sync, epochs=1)
    k = len(sync.candidates)
    times = np.full(k, 1.0)
    times[comm.rank % k] = 0.1  # this rank: its own favourite
    times[-1] = 0.5 if comm.rank == 0 else 0.6  # everyone's second best
    if comm.size >= k:
        times[-1] = 0.55
    sync.times, sync.choice, sync.finalists = [[t] for t in times], None, None
    sync._decide()
    worst = np.max(comm.allgather(times), axis=0)
    all_ranks(comm, sync.choice is sync.candidates[int(np.argmin(worst))],
              f"picked {sync.report} from {worst}")


@pytest.mark.mpi(min_size=2)
def test_near_equals_run_off_before_the_choice(comm):
    """Candidates within CLOSE of the fastest train TRIALS more steps each, in turns; a
    clear winner is chosen at once."""
    X, y, rows = _data(comm)
    sync = make_sync("auto", bucket_bytes=64)  # per layer and one bucket: 3 candidates
    _train(comm, X[rows], y[rows], sync, epochs=1)
    k = len(sync.candidates)

    def after_round_one(times):
        sync.choice, sync.finalists, sync.steps = None, None, A.WARMUP + A.TRIALS * k - 1
        sync.times, sync._t0 = [[t] * A.TRIALS for t in times], None
        sync.step_done()  # the first round's last step ends

    near = [1.0] * k
    near[1], near[-1] = 0.50, 0.53  # within 10% of each other
    after_round_one(near)
    ran = [sync.candidates.index(sync.current)]
    while sync.choice is None:
        sync._t0 = None  # keep the planted times
        sync.step_done()
        if sync.choice is None:
            ran.append(sync.candidates.index(sync.current))
    all_ranks(comm, sync.finalists == [1, k - 1] and ran == [1, k - 1] * A.TRIALS,
              f"finalists {sync.finalists}, ran {ran}")
    all_ranks(comm, sync.choice is sync.candidates[1] and "then of" in sync.report, sync.report)
    clear = [1.0] * k
    clear[1] = 0.5
    after_round_one(clear)
    all_ranks(comm, sync.finalists == [] and sync.choice is sync.candidates[1]
              and "then of" not in sync.report, sync.report)


@pytest.mark.mpi(min_size=2)
def test_the_run_off_picks_among_its_finalists_and_untimed_candidates_are_named(comm):
    """One left out of the run-off never wins it, even where the finalists' medians grow
    past its own; a run too short to time any step says so in its line."""
    X, y, rows = _data(comm)
    sync = make_sync("auto", bucket_bytes=64)  # per layer and one bucket: 3 candidates
    _train(comm, X[rows], y[rows], sync, epochs=1)
    k = len(sync.candidates)
    times = [[0.8] * A.TRIALS for _ in range(k)]
    times[1], times[-1] = [0.5] * A.TRIALS, [0.52] * A.TRIALS
    sync.times, sync.finalists, sync.choice = times, [1, k - 1], None
    for j in (1, k - 1):  # the run-off's steps were slow
        sync.times[j] = sync.times[j] + [9.0] * (A.TRIALS + 1)
    sync._decide()
    all_ranks(comm, sync.choice is sync.candidates[1], sync.report)
    sync.times, sync.finalists, sync.choice = [[] for _ in range(k)], [], None
    sync.times[0] = [0.3]
    sync._decide()
    all_ranks(comm, sync.choice is sync.candidates[0] and "not timed" in sync.report
              and sync.labels[1] in sync.report, sync.report)
    sync.times, sync.choice = [[] for _ in range(k)], None
    sync._decide()
    all_ranks(comm, sync.choice is sync.candidates[0] and "could be timed" in sync.report,
              sync.report)


@pytest.mark.mpi(min_size=2)
def test_bucket_sizes_that_cut_the_same_buckets_are_one_candidate(comm):
    """This model's gradient is far below 64 KiB: 1 MiB and a quarter of it (64 KiB at
    least) both make one bucket, so overlapped is tried once, with the size asked for."""
    X, y, rows = _data(comm)
    sync = make_sync("auto", bucket_bytes=1 << 20)
    _train(comm, X[rows], y[rows], sync, epochs=1)
    overlapped = [label for label in sync.labels if label.startswith("overlapped")]
    all_ranks(comm, len(overlapped) == 1 and len(sync.times) == len(sync.candidates),
              f"{sync.labels}")


@pytest.mark.mpi(min_size=2)
def test_a_step_is_timed_from_its_forward_pass_not_from_the_step_before(comm, monkeypatch):
    """What runs between steps (an evaluation, a checkpoint) counts for no candidate: on a
    planted clock each step's forward pass takes 1 s and each pause between steps 1000 s."""
    clock = [0.0]
    monkeypatch.setattr(A, "perf_counter", lambda: clock[0])
    X, y, rows = _data(comm)
    sync = make_sync("auto", bucket_bytes=64)  # per layer and one bucket: 3 candidates
    model = nn.mlp(X.shape[1], (10,), 3).init_(5)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, sync=sync)
    forward = model.forward

    def slow_forward(x):
        clock[0] += 1.0
        return forward(x)

    model.forward = slow_forward
    Xr, yr = X[rows][:8], y[rows][:8]
    for _ in range(100):
        if sync.choice is not None:
            break
        clock[0] += 1000.0
        dp.step(Xr, yr)
    times = [t for ts in sync.times for t in ts]
    all_ranks(comm, sync.choice is not None and all(len(ts) >= A.TRIALS for ts in sync.times)
              and set(times) == {1.0}, f"{sync.times}")


def _float16_index(sync):
    return sync.labels.index("compressed (float16)")


@pytest.mark.mpi(min_size=2)
def test_a_float16_candidate_that_overflows_is_dropped_and_the_run_goes_on(comm):
    """Gradients beyond 65504 end a ``compressed --compress float16`` run; under auto that
    candidate is dropped, its steps go by allreduce, and training matches allreduce's."""
    X, y, rows = _data(comm)
    X = X * 1e6  # gradients far beyond float16's range
    sync = make_sync("auto", codec="float16")
    dp, hist = _train(comm, X[rows], y[rows], sync, dtype=np.float32, epochs=1)
    ref, _ = _train(comm, X[rows], y[rows], make_sync("allreduce"), dtype=np.float32, epochs=1)
    f16 = _float16_index(sync)
    all_ranks(comm, list(sync.dropped) == [f16] and sync.choice is not sync.candidates[f16]
              and f"compressed (float16) overflowed at step {A.WARMUP + f16}" in sync.report,
              f"{sync.dropped} {sync.report}")
    all_ranks(comm, dp.in_sync() and np.isfinite(hist[-1]["loss"]))
    all_ranks(comm, np.allclose(dp.model.params, ref.model.params, rtol=1e-5, atol=1e-6),
              f"max diff {np.abs(dp.model.params - ref.model.params).max():.3g}")


@pytest.mark.mpi(min_size=2)
def test_a_chosen_float16_candidate_that_overflows_hands_over_to_allreduce(comm, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(A, "perf_counter", lambda: clock[0])
    X, y, rows = _data(comm)
    sync = make_sync("auto", codec="float16")
    model = nn.mlp(X.shape[1], (10,), 3).init_(5)
    dp = mpidp.DataParallel(model, nn.SGD(0.1), nn.SoftmaxCrossEntropy(), comm, sync=sync)
    forward, f16 = model.forward, _float16_index(sync)

    def timed_forward(x):  # the float16 candidate's steps look twice as fast
        clock[0] += 0.5 if sync.current is sync.candidates[f16] else 1.0
        return forward(x)

    model.forward = timed_forward
    Xr, yr = X[rows][:8].astype(np.float32), y[rows][:8]
    while sync.choice is None:
        dp.step(Xr, yr)
    all_ranks(comm, sync.choice is sync.candidates[f16], sync.report)
    step = dp.global_step
    dp.step(Xr * 1e6, yr)
    dp.step(Xr, yr)
    all_ranks(comm, sync.choice is sync.candidates[0] and sync.current is sync.candidates[0]
              and f"overflowed at step {step}" in sync.report and "from that step on" in sync.report
              and dp.in_sync() and np.isfinite(dp.model.params).all(), sync.report)


@pytest.mark.mpi(min_size=2)
def test_a_run_too_short_for_the_trials_says_so(comm):
    """Fewer steps than the trials need: no choice, and :meth:`undecided` says after how
    many steps and how many the trials need (on every rank alike); None once chosen."""
    X, y, rows = _data(comm, n=64)  # 4 steps of 16 per epoch, 1 epoch
    sync = make_sync("auto", bucket_bytes=64)
    _train(comm, X[rows], y[rows], sync, epochs=1)
    said = sync.undecided()
    need = A.WARMUP + A.TRIALS * len(sync.labels)
    all_ranks(comm, sync.choice is None and said is not None and "after 4 step(s)" in said
              and f"need {need} steps" in said and len(set(comm.allgather(said))) == 1, said)
    longer = make_sync("auto", bucket_bytes=64)
    _train(comm, X[rows], y[rows], longer, epochs=need)
    all_ranks(comm, longer.choice is not None and longer.undecided() is None, longer.report)
