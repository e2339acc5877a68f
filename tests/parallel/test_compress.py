"""The 16-bit codecs' in-place kernels against the reference formulas, bit for bit; the
chunk layout of the compressed exchange for any n and P; its bytes per rank counted at the
communicator in real jobs of 2, 4 and 8 ranks (oversubscribed)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import ROOT, run_mpi

from mpidp.parallel import codecs as K
from mpidp.parallel import compress as Z

LOW = np.array([0, 1, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)


def _bit_patterns(seed: int = 0) -> np.ndarray:
    """float32 bit patterns: every high half with low halves at and around the rounding
    points of both codecs (ties included), then random patterns (NaN, Inf, subnormals)."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    sweep = (high[:, None] | LOW[None, :]).reshape(-1)
    for bit in range(13, 16):  # float16 keeps 10 mantissa bits: bits 13-15 decide parity
        sweep = np.concatenate([sweep, high | (1 << bit), high | (1 << bit) | 0x1000])
    rand = np.random.default_rng(seed).integers(0, 1 << 32, 1 << 20, dtype=np.uint64)
    return np.concatenate([sweep, rand.astype(np.uint32)])


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def _blockwise(fn, n: int, block: int):
    for lo in range(0, n, block):
        fn(lo, min(lo + block, n))


@pytest.mark.parametrize("codec", K.FLOAT_CODECS)
def test_in_place_encode_is_the_reference_bit_for_bit(codec):
    x = _bit_patterns().view(np.float32)
    block = 1 << 12
    k = K.Codec(codec, block)
    codes, lost = np.empty(len(x), np.uint16), np.empty(len(x), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        _blockwise(lambda lo, hi: k.encode_(x[lo:hi], codes[lo:hi], lost[lo:hi]), len(x), block)
        want = K.encode(x, codec)
        assert _same_bits(codes, want)
        finite = np.isfinite(x) & np.isfinite(K.decode(want, codec))
        assert _same_bits(lost[finite], x[finite] - K.decode(want, codec)[finite])
        again = x.copy()  # lost may be x itself (the strategy encodes in place)
        _blockwise(lambda lo, hi: k.encode_(again[lo:hi], codes[lo:hi], again[lo:hi]),
                   len(x), block)
    assert _same_bits(again[finite], lost[finite]) and _same_bits(codes, want)


def test_bfloat16_encode_keeps_nan_and_rounds_ties_to_even():
    top = np.float32(K.BFLOAT16_INF_FROM)
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, np.nan, -np.inf, top, np.nextafter(top, 0)],
                 np.float32)
    codes = np.empty(len(x), np.uint16)
    K.Codec("bfloat16").encode_(x, codes)
    back = K.decode(codes, "bfloat16")
    assert back[:2].tolist() == [1.0, 1 + 2**-6] and np.isnan(back[2])
    assert back[3] == -np.inf and back[4] == np.inf  # from BFLOAT16_INF_FROM on: Inf
    assert back[5] == np.float32(3.3895314e38)  # the largest bfloat16 just below it


@pytest.mark.parametrize("codec", K.FLOAT_CODECS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_in_place_decode_is_the_reference_for_every_code(codec, dtype):
    codes = np.arange(1 << 16, dtype=np.uint16)
    want = K.decode(codes, codec)
    k = K.Codec(codec, 1000)  # the float64 path goes through scratch of 1000 values
    out = np.empty(len(codes), dtype)
    with np.errstate(invalid="ignore"):
        k.decode_(codes, out)
        assert np.array_equal(out, want.astype(dtype), equal_nan=True)
    acc = np.linspace(-3, 3, len(codes)).astype(np.float32)
    with np.errstate(invalid="ignore"):
        expect = acc + want
        _blockwise(lambda lo, hi: k.decode_add_(codes[lo:hi], acc[lo:hi]), len(codes), 1000)
    assert _same_bits(acc, expect)


def test_unknown_codec_is_refused():
    with pytest.raises(Z.C.MpidpError, match="unknown compression 'int4'"):
        K.Codec("int4")
    with pytest.raises(Z.C.MpidpError, match="unknown compression 'int4'"):
        Z.Compressed("int4")


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 100, 1001])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8, 9])
def test_chunks_cover_every_value_once_evenly(n, size):
    pieces = [Z._Piece(0, n, size, r, 0, 0) for r in range(size)]
    owned = np.concatenate([np.arange(p.lo, p.hi) for p in pieces])
    assert np.array_equal(owned, np.arange(n))  # in rank order, each value once
    sizes = [p.m for p in pieces]
    assert max(sizes) - min(sizes) <= 1 and pieces[0].c == max(sizes)
    runs = pieces[0].runs  # the same layout on every rank
    assert [(lo, hi) for lo, hi, _ in runs] == [(p.lo, p.hi) for p in pieces if p.m]
    for r, p in enumerate(pieces):
        assert p.runs == runs and p.end == size * p.c and p.own == r * p.c
        send, displs = p.send
        assert send[r] == 0 and send.sum() == n - p.m  # its own chunk never travels
        assert np.array_equal(displs, np.arange(size) * p.c)
        assert p.recv[0][r] == 0 and p.recv[0].sum() == (size - 1) * p.m
        assert p.sent == n - p.m + p.c  # codes out, then its summed chunk (padded) gathered


@pytest.mark.parametrize("size", [1, 2, 3, 7, 8, 5000])
def test_pieces_fit_one_mpi_call(monkeypatch, size):
    monkeypatch.setattr(Z.C.collectives, "MAX_COUNT", 7)
    step = Z._piece_length(size)
    assert 1 <= step <= max(7, size)
    if size <= 7:  # else no piece fits: the collective refuses it
        p = Z._Piece(0, step, size, 0, 0, 0)
        assert p.end <= 7 and (size - 1) * p.m <= 7


@pytest.mark.parametrize("P", [2, 4, 8])
def test_bytes_per_rank_are_half_a_float32_ring_allreduce(P):
    """Each rank's calls, counted at its communicator (tests/mpi/test_compress_mpi.py run as
    a script, which also names what is wrong with them): about ``2 (P-1)/P n`` values of 2
    bytes leave each rank, half of what a float32 ring allreduce sends; ``bytes_sent`` is
    exactly what the rank handed to MPI."""
    r = run_mpi(P, str(ROOT / "tests" / "mpi" / "test_compress_mpi.py"), module=False,
                timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout.strip().splitlines()[-1])
    assert [row["rank"] for row in rows] == list(range(P))
    assert all(row["wrong"] == [] for row in rows), [row["wrong"] for row in rows]
    for row in rows:
        ring = 2 * (P - 1) / P * row["n"] * 4 * row["steps"]
        assert 0.49 < row["leaving"] / ring < 0.51 and row["handed"] == row["bytes_sent"]
    assert len({row["sums"] for row in rows}) == 1, "every rank decodes the same sums"


def test_int8_keeps_groups_too_small_to_scale_in_its_error_feedback():
    """A group whose largest magnitude is below ``127 / float32 max`` (about 3.7e-37) has
    no finite ``127 / top``: it is coded on the grid of :data:`INT8_TINY`, so its values
    decode to zero and what was lost is exactly the values, never NaN."""
    x = np.zeros(3 * K.GROUP, np.float32)
    x[:4] = [1e-39, -3e-37, 2e-45, 0.0]  # group 0: subnormal and tiny values
    x[K.GROUP:K.GROUP + 2] = [1e-34, -2.5e-34]  # group 1: under half a step of the grid
    x[2 * K.GROUP] = 0.5  # group 2: an ordinary one
    codes, lost = np.zeros(K.units(len(x), "int8"), np.uint16), np.zeros_like(x)
    with np.errstate(invalid="ignore", over="ignore"):
        K.Codec("int8").encode_(x, codes, lost)
    want = K.encode(x, "int8")
    back = K.decode(want, "int8", len(x))
    assert _same_bits(codes, want) and np.isfinite(K._int8_parts(want, len(x))[1]).all()
    assert np.array_equal(back[:2 * K.GROUP], np.zeros(2 * K.GROUP, np.float32))
    assert back[2 * K.GROUP] == np.float32(0.5)
    assert _same_bits(lost, x - back) and np.array_equal(lost[:2 * K.GROUP], x[:2 * K.GROUP])


@pytest.mark.parametrize("k", [1, 5, 255, 256, 257, 1000, K.BLOCK])
def test_int8_kernel_is_the_reference_bit_for_bit(k):
    """Codes, scales, what rounding lost and the decoded values, as :func:`encode` and
    :func:`decode` give them; a group holding NaN or Inf decodes to no finite value."""
    rng = np.random.default_rng(k)
    x = (rng.standard_normal(k) * 10.0 ** rng.integers(-8, 3, k)).astype(np.float32)
    if k > 300:
        x[3], x[290], x[-1] = np.nan, np.inf, -np.inf
    kernel, want = K.Codec("int8"), K.encode(x, "int8")
    codes, lost = np.zeros(K.units(k, "int8"), np.uint16), np.zeros(k, np.float32)
    out, acc = np.zeros(k, np.float32), np.ones(k, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        kernel.encode_(x, codes, lost)
        kernel.decode_(codes, out)
        kernel.decode_add_(codes, acc)
        back = K.decode(want, "int8", k)
    (q, scale), (q0, scale0) = K._int8_parts(codes, k), K._int8_parts(want, k)
    finite = np.isfinite(np.repeat(scale0, K.GROUP)[:k])
    assert _same_bits(scale, scale0) and np.array_equal(q[finite], q0[finite])
    assert _same_bits(lost[finite], (x - back)[finite]) and _same_bits(out[finite], back[finite])
    assert _same_bits(acc[finite], (np.float32(1) + back)[finite])
    assert not np.isfinite(out[~finite]).any() and finite.any()
    assert (k > 300) == (not finite.all())


numba_kernels = pytest.mark.skipif(not K.numba_available(), reason="numba not installed")


def _jit_inputs(k: int, seed: int):
    """float32 values over every magnitude with the bit patterns' NaN, Inf, subnormals and
    rounding ties mixed in; residuals of other magnitudes."""
    rng = np.random.default_rng(seed)
    bits = _bit_patterns(seed).view(np.float32)
    x = (rng.standard_normal(k) * 10.0 ** rng.integers(-45, 38, k)).astype(np.float32)
    at = rng.integers(0, k, k // 8)
    x[at] = bits[rng.integers(0, len(bits), len(at))]
    res = (rng.standard_normal(k) * 10.0 ** rng.integers(-40, 30, k)).astype(np.float32)
    return x, res


def _same_up_to_nan_payload(a: np.ndarray, b: np.ndarray, codec: str = "bfloat16",
                            k: int = 0) -> bool:
    """Equal bits, except that a NaN may be another NaN (a compiled sum of two NaNs may
    keep either one's payload and sign). ``a``, ``b``: codes (bfloat16: one per value;
    int8: one segment of ``k`` values) or float32/64 values."""
    if a.dtype == np.uint16 and codec == "int8":
        (qa, sa), (qb, sb) = K._int8_parts(a, k), K._int8_parts(b, k)
        return _same_bits(qa, qb) and _same_up_to_nan_payload(sa, sb)
    fa, fb = ((K.decode(v, codec) if v.dtype == np.uint16 else v) for v in (a, b))
    nan = np.isnan(fa)
    return bool(np.array_equal(nan, np.isnan(fb)) and _same_bits(a[~nan], b[~nan]))



@numba_kernels
@pytest.mark.parametrize("codec", K.JIT_CODECS)
@pytest.mark.parametrize("k", [1, 3, 255, 4099, K.BLOCK])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compiled_encode_and_decode_are_numpys_bit_for_bit(codec, k, dtype):
    """Codes, what they lose, the scan's verdict and decoded values (into float32 and
    float64), with and without a residual, for finite and non-finite values alike (a NaN's
    payload aside)."""
    ref, jit = K.Codec(codec), K.Codec(codec, jit=True)
    for seed in range(3):
        x, res = _jit_inputs(k, seed)
        with np.errstate(invalid="ignore"):
            src = x.astype(dtype)
        if seed == 0:
            src[:] = np.abs(src)  # a block that is all finite: the verdict is False
            src[~np.isfinite(src)] = 1.0
        elif seed == 1 and k >= 8:  # int8 ties: a group scaled by 127 / 127
            src[:8] = [127, 0.5, 1.5, 2.5, -0.5, -1.5, 126.5, -2.5]
            src[8:256] = np.clip(src[8:256], -1, 1)
        elif seed == 2:
            src[-1] = np.inf
        with np.errstate(all="ignore"):
            for with_res in (True, False):
                got = []
                for kern in (ref, jit):
                    codes = np.zeros(K.units(k, codec), np.uint16)
                    lost = np.zeros(k, np.float32)
                    verdict = kern.encode_sum_(src, codes, res if with_res else None,
                                               lost if with_res else None, scan=True)
                    out = np.zeros(k, dtype)
                    kern.decode_(codes, out)
                    got.append((codes, lost, verdict, out))
                (c0, l0, v0, o0), (c1, l1, v1, o1) = got
                assert _same_up_to_nan_payload(c0, c1, codec, k)
                assert _same_up_to_nan_payload(l0, l1) and _same_up_to_nan_payload(o0, o1)
                assert v0 == v1
    assert v0 == (True, False)  # the last block held Inf


@numba_kernels
@pytest.mark.parametrize("codec", K.JIT_CODECS)
@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("k", [1, 1000, K.BLOCK])
def test_compiled_chunk_sums_are_numpys_bit_for_bit(codec, P, k):
    """P ranks' codes summed in rank order (this rank's own in place, the others' from
    one receive buffer at offsets), plus the chunk residual, encoded again: the same bits
    for every finite sum (the rows hold NaN, Inf and ties too)."""
    ref, jit = K.Codec(codec), K.Codec(codec, jit=True)
    rng = np.random.default_rng(P * k)
    with np.errstate(all="ignore"):
        rows = [K.encode(_jit_inputs(k, r)[0], codec) for r in range(P)]
    u = K.units(k, codec)
    mine_rank = P // 2
    others = [rows[r] for r in range(P) if r != mine_rank]
    recv = np.concatenate(others + [np.zeros(7, np.uint16)])
    starts = np.array([-1 if r == mine_rank else u * (r - (r > mine_rank)) for r in range(P)],
                      np.int64)
    res = (rng.standard_normal(k) * 1e-3).astype(np.float32)
    with np.errstate(all="ignore"):
        for with_res in (True, False):
            got = []
            for kern in (ref, jit):
                mine, lost = rows[mine_rank].copy(), np.zeros(k, np.float32)
                verdict = kern.sum_encode_(mine, recv, starts, k, res if with_res else None,
                                           lost if with_res else None)
                got.append((mine, lost, verdict))
            (m0, l0, v0), (m1, l1, v1) = got
            assert _same_up_to_nan_payload(m0, m1, codec, k) and _same_up_to_nan_payload(l0, l1)
            assert v0 == v1


def test_compiled_kernels_exist_for_bfloat16_and_int8_only():
    with pytest.raises(Z.C.MpidpError, match="bfloat16"):
        K.Codec("float16", jit=True)
    with pytest.raises(Z.C.MpidpError, match="kernels 'numba' exist for"):
        Z.Compressed("float16", kernels="numba")
    with pytest.raises(Z.C.MpidpError, match="unknown compression kernels 'fast'"):
        Z.Compressed(kernels="fast")


def test_encode_takes_residual_and_lost_together():
    codes, x = np.zeros(4, np.uint16), np.ones(4, np.float32)
    with pytest.raises(ValueError, match="together"):
        K.Codec("bfloat16").encode_sum_(x, codes, res=x)


@pytest.mark.slow
def test_a_numba_that_fails_to_import_leaves_numpys_passes(tmp_path):
    """numba installed but broken on one rank (built for another NumPy: its import fails):
    the default kernels run NumPy's passes on every rank, and training runs."""
    broken = tmp_path / "broken" / "numba"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(
        "from mpi4py import MPI\n"
        "if MPI.COMM_WORLD.rank == 1:\n"
        "    raise ImportError('numba: built against another NumPy')\n"
        "# elsewhere: the real numba\n"
        "import sys\n"
        "del sys.modules['numba']\n"
        "sys.path.remove(__path__[0].rsplit('/', 1)[0])\n"
        "sys.modules['numba'] = __import__('numba')\n")
    env = {"PYTHONPATH": f"{tmp_path / 'broken'}:{ROOT}"}
    args = ("train", "--dataset", "synthetic", "--n-samples", "600", "--n-features", "16",
            "--epochs", "1", "--sync", "compressed", "-q")
    r = run_mpi(2, *args, "--out", str(tmp_path / "auto"), env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "auto" / "model.npz").exists()
