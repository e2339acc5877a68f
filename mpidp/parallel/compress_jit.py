"""Compiled kernels of the bfloat16 and int8 codecs (numba, imported here): each fuses NumPy
passes of :class:`~mpidp.parallel.codecs.Codec` with the same float32 arithmetic in the same
order, so the bits are NumPy's (a sum of two NaNs aside). ``group`` is ``codecs.GROUP``."""

from __future__ import annotations

import numba
import numpy as np

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)
_inline = numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")
u32 = np.uint32
half, low1, round_bias, top16 = u32(16), u32(1), u32(0x7FFF), u32(0xFFFF0000)
sign_off, group = u32(0x7FFFFFFF), 256


@_inline
def bf16_round(bits):
    """float32 bits rounded to bfloat16 (nearest, ties to even), as float32 bits."""
    return (bits + (round_bias + ((bits >> half) & low1))) & top16


@_jit
def bf16_encode(src, res, use_res, lost, keep_lost, codes, scratch):
    """codes = bf16(x), x = src + res (float32) or src; lost = x - decode (lost may be res);
    returns the largest magnitude of x (float32 bits). ``scratch``: float32 (1,)."""
    sb = scratch.view(np.uint32)
    top = u32(0)
    for i in range(src.shape[0]):
        scratch[0] = src[i] + res[i] if use_res else src[i]
        x = scratch[0]
        b = sb[0]
        top = max(top, b & sign_off)
        u = bf16_round(b)
        codes[i] = np.uint16(u >> half)
        if keep_lost:
            sb[0] = u
            lost[i] = x - scratch[0]
    return top


@_jit
def bf16_decode(codes, out, scratch):
    """out = the float32 values of bfloat16 codes (converted to out's dtype)."""
    sb = scratch.view(np.uint32)
    for i in range(codes.shape[0]):
        sb[0] = u32(codes[i]) << half
        out[i] = scratch[0]


@_jit
def bf16_sum(mine, recv, starts, res, use_res, lost, keep_lost, acc, scratch):
    """The rank-order float32 sum of P rows of codes (row r: ``mine`` where
    ``starts[r] < 0``, else ``recv[starts[r]:]``), plus res, re-encoded into mine.
    ``acc``: float32 scratch of the row's length."""
    k = mine.shape[0]
    bf16_decode(mine if starts[0] < 0 else recv[starts[0]:starts[0] + k], acc, scratch)
    sb = scratch.view(np.uint32)
    for r in range(1, starts.shape[0]):
        row = mine if starts[r] < 0 else recv[starts[r]:starts[r] + k]
        for i in range(k):
            sb[0] = u32(row[i]) << half
            acc[i] = acc[i] + scratch[0]
    return bf16_encode(acc, res, use_res, lost, keep_lost, mine, scratch)


@_inline
def i8_quantize(xs, qs, ls, keep_lost, top_bits, scale, g, tiny, scratch, scratch_bits):
    """int8 codes of one group ``xs`` (float32), its scale into ``scale[g]``: the
    group's largest magnitude (bits ``top_bits``, at least ``tiny``; NaN stays) over
    127; what rounding loses into ``ls`` (may be ``xs``). ``scratch_bits``: the uint32
    view of ``scratch``, made once by the caller."""
    scratch_bits[0] = top_bits
    t = scratch[0]
    if not t != t:
        t = max(t, tiny)
    scale[g] = t / np.float32(127)
    inv = np.float32(127) / t
    s = scale[g]
    for i in range(xs.shape[0]):
        f = np.rint(xs[i] * inv)
        qs[i] = np.int8(f) if abs(f) <= np.float32(127) else np.int8(0)
        if keep_lost:
            ls[i] = xs[i] - f * s


@_jit
def i8_encode(src, res, use_res, x, lost, keep_lost, q, scale, tiny, scratch):
    """int8 codes and scales of one segment x = src + res (float32) or src, groups
    from its start; lost = x - decode (lost may be res; x may be src, and scratch apart
    from lost keeps the group loops vectorized)."""
    k = src.shape[0]
    xb, sb = x.view(np.uint32), scratch.view(np.uint32)
    top = u32(0)
    for g in range(-(-k // group)):
        lo = g * group
        hi = min(lo + group, k)
        ss, rs, xs, xbs = src[lo:hi], res[lo:hi], x[lo:hi], xb[lo:hi]
        for i in range(ss.shape[0]):
            xs[i] = ss[i] + rs[i] if use_res else ss[i]
        t = u32(0)
        for i in range(xbs.shape[0]):
            t = max(t, xbs[i] & sign_off)
        i8_quantize(xs, q[lo:hi], lost[lo:hi], keep_lost, t, scale, g, tiny, scratch, sb)
        top = max(top, t)
    return top


@_jit
def i8_decode(q, scale, out, add=False):
    """out = q * its group's scale (float32 products, converted to out's dtype); with add,
    out += them (float32 sums)."""
    k = q.shape[0]
    for g in range(-(-k // group)):
        lo = g * group
        hi = min(lo + group, k)
        qs, os, s = q[lo:hi], out[lo:hi], scale[g]
        if add:
            for i in range(qs.shape[0]):
                os[i] = os[i] + np.float32(qs[i]) * s
        else:
            for i in range(qs.shape[0]):
                os[i] = np.float32(qs[i]) * s


@_jit
def i8_sum(mine, recv, starts, k, res, use_res, lost, keep_lost, acc, q, scale, tiny, scratch):
    """The rank-order float32 sum of P int8 segments of k values (row r: ``mine``
    where ``starts[r] < 0``, else ``recv[starts[r]:]``; uint16 units), plus res,
    re-encoded into mine's codes ``q`` and scales ``scale``. ``acc``: float32 (k,) scratch."""
    at, groups, u = 4 * -(-k // 4), -(-k // group), mine.shape[0]
    for r in range(starts.shape[0]):
        row = mine if starts[r] < 0 else recv[starts[r]:starts[r] + u]
        b = row.view(np.uint8)
        i8_decode(b[:k].view(np.int8), b[at:at + 4 * groups].view(np.float32), acc, r > 0)
    return i8_encode(acc, res, use_res, acc, lost, keep_lost, q, scale, tiny, scratch)
