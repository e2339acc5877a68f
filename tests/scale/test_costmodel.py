"""The alpha-beta-gamma cost model against hand-computed formulas."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import run_here, run_mpi

from mpidp.parallel import codecs
from mpidp.scale import costmodel as M

FIT = M.Fit(alpha=2e-6, beta=1e-9, gamma=5e-10)


def test_formulas_by_hand():
    m = 1e6
    assert M.allreduce_time(2, m, FIT, "ring") == pytest.approx(2 * 2e-6 + m * 1e-9 + 0.5 * m * 5e-10)
    assert M.allreduce_time(8, m, FIT, "recursive-doubling") == pytest.approx(3 * (2e-6 + m * 1.5e-9))
    ps = 6 * (2e-6 + m * 1e-9) + 3 * m * 5e-10
    assert M.allreduce_time(4, m, FIT, "parameter-server") == pytest.approx(ps)
    assert M.allreduce_time(1, m, FIT) == 0
    rb = (3 * 7 + 3) * 2e-6 + 4 * 7 / 8 * m * 1e-9 + 7 / 8 * m * 5e-10
    assert M.allreduce_time(8, m, FIT, "reduce-broadcast") == pytest.approx(rb)
    # twice the ring's bytes at any P, never the central server's P-fold load
    big = 1e9
    for P in (2, 64, 1024):
        r = M.allreduce_time(P, big, FIT, "reduce-broadcast")
        assert r < 2.1 * M.allreduce_time(P, big, FIT, "ring") + 4 * P * 2e-6
        assert P == 2 or r < M.allreduce_time(P, big, FIT, "parameter-server") / 10
    with pytest.raises(ValueError, match="unknown algorithm"):
        M.allreduce_time(2, m, FIT, "gossip")


def test_fits_recover_known_constants():
    sizes = np.array([8, 1e3, 1e5, 1e6, 1e7])
    alpha, beta = M.fit_alpha_beta(sizes, 3e-6 + sizes * 2e-10)
    # alpha: mean of the small messages (8 B, 1 kB), whose bytes add 0.1 us on average
    assert alpha == pytest.approx(3e-6, rel=0.05) and beta == pytest.approx(2e-10, rel=1e-3)
    # a bandwidth that sags for the largest message must not turn alpha negative
    sag = 3e-6 + sizes * 2e-10 * np.array([1, 1, 1, 1, 1.5])
    alpha, beta = M.fit_alpha_beta(sizes, sag)
    assert alpha == pytest.approx(3e-6, rel=0.05) and 2e-10 < beta < 3e-10
    fit = M.Fit(3e-6, 2e-10, 4e-10)
    gamma = M.fit_gamma(4, sizes, M.allreduce_time(4, sizes, fit), 3e-6, 2e-10)
    assert gamma == pytest.approx(4e-10, rel=1e-6)


def test_strong_scaling_and_ps_limit():
    c = 1e-4  # s per sample
    eff = M.efficiency(np.array([1, 2, 4, 1024]), 4e6, 512, c, FIT, "ring")
    assert eff[0] == pytest.approx(1) and np.all(np.diff(eff) < 0)
    # a central server: step time c B / P + 2 (P-1) m beta ... has an interior minimum
    limit = M.ps_limit(4e6, 512, c, FIT)
    Ps = np.array([limit // 2 or 1, limit, limit * 2])
    t = M.step_time(Ps, 4e6, 512, c, FIT, "parameter-server")
    assert t[1] <= t[0] and t[1] <= t[2]
    rows = M.prediction_table(FIT, 1e-10, 512, params=(1e4, 1e9), Ps=(1, 2))
    assert len(rows) == 2 * 4 * 2 and {r["algorithm"] for r in rows} == set(M.ALGORITHMS)


def test_step_time_with_measured_compute_by_hand():
    """Fixed part + per sample, times contention only when ranks share the node's work,
    plus the expected wait for the slowest of P ranks: jitter * sqrt(2 ln P) of the work."""
    c = M.Compute(per_sample=1e-4, overhead=2e-3, contention=1.1, jitter=0.05)
    m, B = 1e6, 512
    comm = M.allreduce_time(4, m, FIT)
    work = (2e-3 + 1e-4 * B / 4) * 1.1
    assert M.step_time(4, m, B, c, FIT) == pytest.approx(work * (1 + 0.05 * np.sqrt(2 * np.log(4))) + comm)
    assert M.step_time(1, m, B, c, FIT) == pytest.approx(2e-3 + 1e-4 * B)  # alone, no wait
    # 3 ranks on 2 cores: one core runs two ranks of B/3 samples each, one after the other
    work3 = 2 * (2e-3 + 1e-4 * B / 3) * 1.1
    assert M.step_time(3, m, B, c, FIT, cores=2) == pytest.approx(
        work3 * (1 + 0.05 * np.sqrt(2 * np.log(3))) + M.allreduce_time(3, m, FIT))
    # a plain float is seconds per sample with nothing else, as before
    assert M.step_time(4, m, B, 1e-4, FIT) == pytest.approx(1e-4 * B / 4 + comm)
    big = c.scaled(10)
    assert (big.per_sample, big.overhead, big.contention, big.jitter) == (1e-3, 2e-2, 1.1, 0.05)
    # jitter and contention lower the efficiency the model predicts
    assert M.efficiency(16, m, B, c, FIT) < M.efficiency(16, m, B, M.Compute(1e-4, 2e-3), FIT)
    rows = M.prediction_table(FIT, c.scaled(1e-6), B, params=(1e6,), Ps=(1, 4))
    ring4 = [r for r in rows if r["algorithm"] == "ring" and r["P"] == 4][0]
    assert ring4["step_s"] == pytest.approx(float(M.step_time(4, 4e6, B, c, FIT)))


@pytest.mark.parametrize("codec", codecs.CODECS)
def test_codecs_round_trip_within_their_precision(codec):
    x = np.random.default_rng(0).standard_normal(1000).astype(np.float32) * 100
    codes = codecs.encode(x, codec)
    assert codes.dtype == np.uint16 and len(codes) == codecs.units(len(x), codec)
    back = codecs.decode(codes, codec, len(x))
    if codec == "int8":  # half a level of the group's largest magnitude (127 levels a side)
        groups = np.arange(len(x)) // codecs.GROUP
        top = np.maximum.reduceat(np.abs(x), np.arange(0, len(x), codecs.GROUP))[groups]
        assert np.all(np.abs(back - x) <= top / 254 * (1 + 1e-6))
        assert len(codes) * 2 < 0.26 * x.nbytes  # a quarter of float32's bytes, and scales
        return
    rel = {"float16": 2**-11, "bfloat16": 2**-8}[codec]
    assert np.all(np.abs(back - x) <= rel * np.abs(x) + 1e-6)


def test_bfloat16_rounds_to_nearest_even():
    # 1 + 2**-8 is exactly halfway between bfloat16 neighbours 1 and 1 + 2**-7: ties to even (1)
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)
    assert codecs.decode(codecs.encode(x, "bfloat16"), "bfloat16").tolist() == [1.0, 1 + 2**-6]


def test_mpidp_model_command(tmp_path, capsys):
    """A job of 2 ranks measures and reports (a global batch of 128: a quarter of the
    default's compute to time); one rank alone, in this process, is refused."""
    r = run_mpi(2, "model", "--batch-size", "128", "--out", str(tmp_path / "m"))
    assert r.returncode == 0, r.stderr
    report = json.loads((tmp_path / "m" / "model.json").read_text())
    assert report["fit"]["beta"] > 0 and report["compute_per_sample_s"] > 0
    c = report["compute"]
    assert c["per_sample"] > 0 and c["overhead"] >= 0 and 0.3 < c["contention"] < 3
    assert 0 <= c["jitter"] < 1
    # the fixed part and the part per sample add up to the compute of a full batch
    assert c["overhead"] / report["batch"] + c["per_sample"] == pytest.approx(
        report["compute_per_sample_s"])
    assert set(report["ps_stops_scaling_at"]) == {"10000", "100000", "1000000", "10000000",
                                                  "100000000", "1000000000"}
    assert "parameter-server" in (tmp_path / "m" / "model.md").read_text()
    assert report["batch"] == 128
    r = run_here(capsys, "model", "--out", str(tmp_path / "one"))
    assert r.returncode == 2 and "at least 2 ranks" in r.stderr, r.stderr
    assert not (tmp_path / "one").exists()


def test_oversubscribed_compute_runs_only_as_many_ways_as_cores():
    t4 = M.step_time(4, 0, 512, 1e-4, M.Fit(0, 0, 0), cores=2)
    assert t4 == pytest.approx(1e-4 * 512 / 2)
    assert M.step_time(2, 0, 512, 1e-4, M.Fit(0, 0, 0), cores=2) == pytest.approx(1e-4 * 256)
    # 3 on 2 cores: the busiest core does two ranks' shares (2/3 of the batch); each rank
    # also pays its fixed part, so 4 ranks on 2 cores pay it twice per step
    t3 = M.step_time(3, 0, 512, 1e-4, M.Fit(0, 0, 0), cores=2)
    assert t3 == pytest.approx(1e-4 * 512 * 2 / 3)
    fixed = M.Compute(per_sample=1e-4, overhead=3e-3)
    assert M.step_time(4, 0, 512, fixed, M.Fit(0, 0, 0), cores=2) == pytest.approx(
        2 * (3e-3 + 1e-4 * 128))


def test_efficiency_never_exceeds_one_even_from_a_noisy_contention():
    """A contention measured below 1 on a loaded machine (noise) must not predict a
    parallel efficiency above 1."""
    fit = M.Fit(alpha=2e-6, beta=1e-10, gamma=1e-10)
    c = M.Compute(per_sample=1e-5, overhead=1e-4, contention=0.8, jitter=-0.1)
    assert c.contention == 1.0 and c.jitter == 0.0
    P = np.array([1, 2, 4, 64, 1024])
    for alg in M.ALGORITHMS:
        eff = M.efficiency(P, 4e6, 512, c, fit, alg)
        assert np.all(eff <= 1.0 + 1e-12) and eff[0] == 1.0


def test_mode_step_times_by_hand():
    fit = M.Fit(1e-4, 8e-9, 0.0)  # 1 Gbit/s
    m, c = 7.45e6, 0.03
    ring = 2 * 1e-4 + m * 8e-9  # P = 2: one send of m each way
    assert M.mode_step_time("allreduce", 2, m, c, fit) == pytest.approx(c + ring)
    # overlapped: hidden behind backward (2/3 of compute) once the first bucket is done
    assert M.mode_step_time("overlapped", 2, m, c, fit, first_bucket=0.25) == pytest.approx(
        c / 3 + max(2 * c / 3, 0.25 * 2 * c / 3 + ring))
    assert M.mode_step_time("overlapped", 2, 1e3, c, fit) == pytest.approx(c)  # all hidden
    # compressed: half the bytes, overlapped alike, plus the codec's CPU seconds
    assert M.mode_step_time("compressed", 2, m, c, fit, codec=0.004) == pytest.approx(
        c / 3 + 2e-4 + m / 2 * 8e-9 + 0.004)
    assert M.mode_step_time("compressed", 2, 1e3, c, fit, codec=0.004) == pytest.approx(
        c + 0.004)  # hidden but for the codec
    # the exchange's CPU work on the computing cores is not hidden (1 ns per byte sent)
    assert M.mode_step_time("overlapped", 2, 1e6, c, fit, cpu_per_byte=1e-9) == pytest.approx(
        c + 1e6 * 1e-9)
    assert M.mode_step_time("compressed", 4, 1e6, c, fit, cpu_per_byte=1e-9) == pytest.approx(
        c + 1.5 * 0.5e6 * 1e-9)
    assert M.mode_step_time("overlapped", 2, m, c, fit, cpu_per_byte=1e-9) == pytest.approx(
        c / 3 + ring)  # a slow link: the wire, not the cores, sets the step
    # finishing in the next forward: the exchange runs beside backward and the next forward
    assert M.mode_step_time("overlapped-forward", 2, m, c, fit, first_bucket=0.25) == pytest.approx(
        max(c, 0.25 * 2 * c / 3 + ring))
    assert M.mode_step_time("overlapped-forward", 2, 1e6, c, fit, cpu_per_byte=1e-9) == pytest.approx(
        c + 1e6 * 1e-9)  # a fast link: compute and the exchange's CPU work
    # the last bucket (the first layer's) starts when backward and the exchange's CPU work
    # are over: its share of the ring follows them, also when it finishes in forward
    ring_last = 2 * 1e-4 + 0.4 * m * 8e-9
    f10 = M.Fit(1e-5, 8e-10, 0.0)  # 10 Gbit/s: the cores, not the wire, set the pace
    ring10, last10 = 2 * 1e-5 + m * 8e-10, 2 * 1e-5 + 0.4 * m * 8e-10
    assert M.mode_step_time("overlapped", 2, m, c, f10, first_bucket=0.25, last_bucket=0.4,
                            cpu_per_byte=1e-9) == pytest.approx(c + m * 1e-9 + last10)
    assert M.mode_step_time("overlapped-forward", 2, m, c, f10, last_bucket=0.4,
                            cpu_per_byte=1e-9) == pytest.approx(c + m * 1e-9 + last10)
    assert M.mode_step_time("compressed", 2, m, c, f10, last_bucket=0.4, codec=0.004) == pytest.approx(
        c + (2 * 1e-5 + 0.2 * m * 8e-10) + 0.004)  # the last bucket's codes: half its bytes
    # on a slow link the whole ring, started early, is still what sets the step
    assert M.mode_step_time("overlapped", 2, m, c, fit, first_bucket=0.25, last_bucket=0.4) == (
        pytest.approx(c / 3 + max(2 * c / 3 + ring_last, 0.25 * 2 * c / 3 + ring)))
    assert ring10 < 2 * c / 3  # (the 10 Gbit/s cases above: the ring alone would hide)
    # two nodes of two ranks: the leaders' ring at P = 2, not the flat one at P = 4
    assert M.mode_step_time("node-aware", 4, m, c, fit, per_node=2) == pytest.approx(c + ring)
    # plus the measured sums inside the nodes and the copies back
    assert M.mode_step_time("node-aware", 4, m, c, fit, per_node=2, node=0.003) == pytest.approx(
        c + ring + 0.003)
    # a flat ring at P = 4 sends 1.5 m per hop; dealt out in turn, two hops share each way
    flat4 = 6 * 1e-4 + 1.5 * m * 8e-9
    assert M.mode_step_time("allreduce", 4, m, c, fit) == pytest.approx(c + flat4)
    assert M.mode_step_time("allreduce", 4, m, c, fit, link_hops=2) == pytest.approx(
        c + 6 * 1e-4 + 2 * 1.5 * m * 8e-9)
    with pytest.raises(ValueError, match="unknown mode"):
        M.mode_step_time("telepathy", 2, m, c, fit)


def test_ranks_that_outnumber_the_cores_share_each_cores_work_per_byte():
    fast = M.Fit(1e-5, 1e-9, 0.0)  # 8 Gbit/s: the cores, at 0.7 ns per byte, nearly keep up
    m, c, cpu = 7.45e6, 0.03, 0.7e-9
    flat4 = lambda per_byte: c + 6 * 1e-5 + 1.5 * m * per_byte
    # a core of its own per rank (or no cores given): the link's beta sets the pace
    for cores in (None, 4, 8):
        assert M.mode_step_time("allreduce", 4, m, c, fast, cpu_per_byte=cpu,
                                cores=cores) == pytest.approx(flat4(1e-9))
    # 4 ranks on 2 cores: two share each core's 0.7 ns per byte, 1.4 ns > beta
    assert M.mode_step_time("allreduce", 4, m, c, fast, cpu_per_byte=cpu,
                            cores=2) == pytest.approx(flat4(1.4e-9))
    # node-aware: only the 2 leaders exchange, one per core: the link again
    assert M.mode_step_time("node-aware", 4, m, c, fast, per_node=2, cpu_per_byte=cpu,
                            cores=2) == pytest.approx(c + 2 * 1e-5 + m * 1e-9)
    # on one core the 2 leaders share it: 1.4 ns per byte
    assert M.mode_step_time("node-aware", 4, m, c, fast, per_node=2, cpu_per_byte=cpu,
                            cores=1) == pytest.approx(c + 2 * 1e-5 + m * 1.4e-9)
    # overlapped on a fast link: the shared cost lengthens the backward pass it hides behind
    b = 2 * c / 3
    assert M.mode_step_time("overlapped", 4, 1e6, c, fast, cpu_per_byte=1e-9,
                            cores=2) == pytest.approx(c / 3 + b + 2 * 1.5e6 * 1e-9)


def test_mpidp_model_into_an_unwritable_place_is_one_line_before_measuring():
    r = run_mpi(2, "model", "--out", "/proc/mpidp-model")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "--out /proc/mpidp-model: cannot write in /proc" in r.stderr
