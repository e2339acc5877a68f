"""The gradient codecs, pure NumPy: IEEE float16 (up to 65504), bfloat16 (float32's
range, 8 significant bits), and int8: one float32 scale per :data:`GROUP` values, each
rounded to one of 255 levels between minus and plus its group's largest magnitude.

:func:`encode` and :func:`decode` are the reference formulas; :class:`Codec` does the same
arithmetic in place on blocks. Codes travel as ``uint16`` units (int8: :func:`units`, the
codes padded to 4 bytes, then the scales).
"""

from __future__ import annotations

import functools

import numpy as np

from ..errors import MpidpError

FLOAT_CODECS = ("bfloat16", "float16")  # one 16-bit code per value
CODECS = (*FLOAT_CODECS, "int8")  # the formats of compressed gradients
#: int8: values per float32 scale (a group never spans two blocks of :data:`BLOCK`).
GROUP = 256
#: int8: the least largest magnitude a group is scaled by. Below it ``127 / top`` would
#: overflow float32 (from about 3.7e-37), so such a group is coded on this grid instead:
#: its values round to zero and error feedback keeps them.
INT8_TINY = np.float32(2.0 ** -100)
FLOAT16_MAX = float(np.finfo(np.float16).max)
#: float32 magnitudes from this one on (bits 0x7F7F8000) round to bfloat16 Inf.
BFLOAT16_INF_BITS = 0x7F7F8000
BFLOAT16_INF_FROM = float(np.array(BFLOAT16_INF_BITS, np.uint32).view(np.float32))
#: codecs with compiled kernels (:mod:`mpidp.parallel.compress_jit`, numba)
JIT_CODECS = ("bfloat16", "int8")
#: Values per block of the exchange's passes: a block's scratch (a few arrays of
#: ``BLOCK`` 4-byte values) stays in a core's L2 cache while several NumPy ops run on it.
BLOCK = 1 << 16


def units(k: int, codec: str) -> int:
    """``uint16`` units that the codes of one segment of ``k`` values take."""
    return k if codec != "int8" else 2 * -(-k // 4) + 2 * -(-k // GROUP)


def chunk_units(m: int, codec: str) -> int:
    """Units of ``m`` values encoded in segments of :data:`BLOCK` (the last one shorter)."""
    return (m // BLOCK) * units(BLOCK, codec) + units(m % BLOCK, codec)


def _int8_parts(codes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The int8 codes ``(k,)`` and float32 scales ``(ceil(k / GROUP),)`` inside one
    segment's ``uint16`` units (views)."""
    b = codes.view(np.uint8)
    at = 4 * -(-k // 4)
    return b[:k].view(np.int8), b[at:at + 4 * -(-k // GROUP)].view(np.float32)


def encode(x: np.ndarray, codec: str) -> np.ndarray:
    """``x`` (float32/64) → ``uint16`` codes, rounded to nearest, ties to even (float16:
    beyond 65504 Inf; int8: ``x * (127 / top)``, ``top`` the group's largest magnitude,
    at least :data:`INT8_TINY`; a group holding NaN or Inf decodes to NaN or Inf)."""
    if codec == "int8":  # one segment
        k, groups = len(x), -(-len(x) // GROUP)
        g = np.zeros((groups, GROUP), np.float32)
        g.flat[:k] = x
        out = np.zeros(units(k, "int8"), np.uint16)
        q, scale = _int8_parts(out, k)
        with np.errstate(invalid="ignore", over="ignore"):
            top = np.maximum(np.maximum(g.max(axis=1), -g.min(axis=1)), INT8_TINY)  # NaN stays
            scale[...] = top / np.float32(127)
            inv = np.float32(127) / top
            q[...] = np.rint(g * inv[:, None]).reshape(-1)[:k].astype(np.int8)
        return out
    if codec == "float16":
        with np.errstate(over="ignore"):
            return np.asarray(x, np.float16).view(np.uint16)
    bits = np.asarray(x, np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    return (rounded >> 16).astype(np.uint16)


def decode(codes: np.ndarray, codec: str, n: int | None = None) -> np.ndarray:
    """``uint16`` codes → float32 values (int8: the segment's ``n`` values)."""
    if codec == "int8":
        q, scale = _int8_parts(codes, int(n))
        with np.errstate(invalid="ignore"):
            return (q.astype(np.float32) * np.repeat(scale, GROUP)[:int(n)]).astype(np.float32)
    if codec == "float16":
        return codes.view(np.float16).astype(np.float32)
    return (codes.astype(np.uint32) << 16).view(np.float32)


class Codec:
    """:func:`encode` and :func:`decode` in place, bit for bit, on blocks of at most
    ``block`` values (``jit``: numba's kernels), inside ``np.errstate(over="ignore",
    invalid="ignore")``. ``x``, ``acc``, ``lost``: float32 ``(k,)``; ``codes``: uint16
    ``(units(k),)``, one segment; ``out``: float32 or float64 ``(k,)``."""

    def __init__(self, codec: str, block: int = BLOCK, jit: bool = False) -> None:
        if codec not in CODECS:
            raise MpidpError(f"unknown compression {codec!r}; expected one of {CODECS}")
        if jit and codec not in JIT_CODECS:
            raise MpidpError(f"compiled compression kernels exist for {JIT_CODECS} only, "
                               f"not {codec!r}")
        self.codec, self.block, self.jit = codec, int(block), bool(jit)
        self._bits, self._a, self._t, self._o = (np.zeros(self.block, np.uint32) for _ in "abto")
        self._top, self._inv = (np.zeros(self.block // GROUP + 1, np.float32) for _ in "ti")
        self._x = np.zeros(self.block, np.float32)  # values to encode, or a block of sums
        self._one, self._none = np.zeros(1, np.float32), np.zeros(0, np.float32)
        if jit:
            from . import compress_jit  # imports numba
        self._k = compress_jit if jit else None

    def encode_sum_(self, src: np.ndarray, codes: np.ndarray, res: np.ndarray | None = None,
                    lost: np.ndarray | None = None, scan: bool = False) -> tuple[bool, bool]:
        """``codes[...] = encode(src + res)`` (float32; ``src`` alone without ``res``), what
        that loses into ``lost`` (given with ``res``; may be ``res``). With ``scan``,
        returns :func:`_scan`'s verdict on the values encoded, else ``(False, False)``."""
        if (res is None) != (lost is None):
            raise ValueError("encode_sum_ takes res and lost together")
        if self.jit:
            ef = res is not None
            res, lost = (res, lost) if ef else (self._none, self._none)
            if self.codec == "int8":
                top = self._k.i8_encode(src, res, ef, self._x[:len(src)], lost, ef,
                                        *_int8_parts(codes, len(src)), INT8_TINY, self._one)
            else:
                top = self._k.bf16_encode(src, res, ef, lost, ef, codes, self._one)
            return (scan and top >= BFLOAT16_INF_BITS), False
        x = lost if lost is not None else self._x[:len(src)]
        if res is not None:
            np.add(src, res, out=x)
        else:
            np.copyto(x, src, casting="same_kind")
        verdict = _scan(x, self.codec == "float16") if scan else (False, False)
        self.encode_(x, codes, lost)
        return verdict

    def sum_encode_(self, mine: np.ndarray, recv: np.ndarray, starts: np.ndarray, k: int,
                    res: np.ndarray | None = None,
                    lost: np.ndarray | None = None) -> tuple[bool, bool]:
        """``mine[...] = encode(sum + res)``, ``sum`` the float32 sum in rank order of the
        ``P`` ranks' codes of one segment of ``k`` values (rank ``r``'s: ``mine`` where
        ``starts[r] < 0``, else ``recv[starts[r]:]``); ``lost`` as :meth:`encode_sum_`'s.
        Returns :func:`_scan`'s verdict on ``sum + res``."""
        if (res is None) != (lost is None):
            raise ValueError("sum_encode_ takes res and lost together")
        if self.jit:
            ef, acc = res is not None, self._x[:k]
            res, lost = (res, lost) if ef else (self._none, self._none)
            if self.codec == "int8":
                top = self._k.i8_sum(mine, recv, starts, k, res, ef, lost, ef, acc,
                                     *_int8_parts(mine, k), INT8_TINY, self._one)
            else:
                top = self._k.bf16_sum(mine, recv, starts, res, ef, lost, ef, acc, self._one)
            return bool(top >= BFLOAT16_INF_BITS), False
        acc, u = self._x[:k], len(mine)
        for r, at in enumerate(starts):
            src = mine if at < 0 else recv[at:at + u]
            (self.decode_add_ if r else self.decode_)(src, acc)
        if res is not None:
            np.add(acc, res, out=acc)
        verdict = _scan(acc, self.codec == "float16")
        self.encode_(acc, mine, lost)
        return verdict

    def encode_(self, x: np.ndarray, codes: np.ndarray, lost: np.ndarray | None = None) -> None:
        """``codes[...] = encode(x)``; with ``lost``, ``lost[...] = x - decode(codes)``."""
        if self.codec != "bfloat16":
            (self._encode_i8 if self.codec == "int8" else self._encode_f16)(x, codes, lost)
            return
        b, u = x.view(np.uint32), self._bits[:len(x)]
        np.right_shift(b, 16, out=u)  # round to nearest, ties to even: add 0x7FFF + lsb
        np.bitwise_and(u, 1, out=u)
        np.add(u, 0x7FFF, out=u)
        np.add(u, b, out=u)  # wraps modulo 2**32 as the reference formula does
        if lost is not None:
            np.bitwise_and(u, 0xFFFF0000, out=u)  # the decoded value's bits
            np.subtract(x, u.view(np.float32), out=lost)
        np.right_shift(u, 16, out=u)
        codes[...] = u

    def decode_(self, codes: np.ndarray, out: np.ndarray) -> None:
        """``out[...] = decode(codes)`` (converted to ``out``'s dtype; any length, but one
        segment of ``len(out)`` values for int8)."""
        if self.jit:
            if self.codec == "int8":
                self._k.i8_decode(*_int8_parts(codes, len(out)), out)
            else:
                self._k.bf16_decode(codes, out, self._one)
            return
        f32 = out.dtype == np.float32  # else decoded into scratch, then converted
        whole = self.codec == "int8"  # one segment; 16-bit codes go block by block
        for lo, hi in [(0, len(out))] if whole else _blocks(0, len(out), self.block):
            value = out[lo:hi] if f32 else self._o[:hi - lo].view(np.float32)
            self._decode32(codes if whole else codes[lo:hi], value)
            if not f32:
                np.copyto(out[lo:hi], value)

    def decode_add_(self, codes: np.ndarray, acc: np.ndarray) -> None:
        """``acc += decode(codes)`` (float32 arithmetic)."""
        value = self._o[:len(acc)].view(np.float32)
        self._decode32(codes, value)
        np.add(acc, value, out=acc)

    def _decode32(self, codes: np.ndarray, out: np.ndarray) -> None:
        """``out`` (float32: one int8 segment, or a block; not this codec's scratch but
        ``_o``) = decode(codes)."""
        if self.codec == "int8":
            _by_group(*_int8_parts(codes, len(out)), out, np.float32)
            return
        o, h = out.view(np.uint32), self._bits[:len(codes)]
        if self.codec == "bfloat16":
            o[...] = codes
            np.left_shift(o, 16, out=o)
            return
        h[...] = codes
        t = self._t[:len(codes)]
        np.bitwise_and(h, 0x7FFF, out=t)
        self._f16_magnitude(t, o)
        np.bitwise_and(h, 0x8000, out=h)
        np.left_shift(h, 16, out=h)
        np.bitwise_or(o, h, out=o)

    def _encode_i8(self, x: np.ndarray, codes: np.ndarray, lost: np.ndarray | None) -> None:
        """int8 codes and scales of one segment ``x``, as :func:`encode`. Scratch: ``_o``."""
        k = len(x)
        groups, full, cut = -(-k // GROUP), k // GROUP, k // GROUP * GROUP
        q, scale = _int8_parts(codes, k)
        top, inv = self._top[:groups], self._inv[:groups]
        f = self._o[:k].view(np.float32)
        # the largest magnitude per group: the sign bit cleared, float32 bits order as
        # integers do (NaN above Inf, so a group holding one gets a NaN scale)
        mag, tops = self._bits[:k], top.view(np.uint32)
        np.bitwise_and(x.view(np.uint32), 0x7FFFFFFF, out=mag)
        if full:
            np.max(mag[:cut].reshape(full, GROUP), axis=1, out=tops[:full])
        if full < groups:
            tops[full] = mag[cut:].max()
        np.maximum(top, INT8_TINY, out=top)
        np.divide(top, np.float32(127), out=scale)
        np.divide(np.float32(127), top, out=inv)
        _by_group(x, inv, f)
        np.rint(f, out=f)
        np.copyto(q, f, casting="unsafe")
        if lost is not None:
            _by_group(f, scale, f)
            np.subtract(x, f, out=lost)

    def _f16_magnitude(self, c: np.ndarray, out: np.ndarray) -> None:
        """``out`` (uint32 float bits) = the value of float16 magnitudes ``c`` (uint32,
        sign bit clear). Scratch: ``_a``."""
        np.left_shift(c, 13, out=out)
        np.add(out, 0x38000000, out=out)  # t, the value of a normal half (exponent rebased)
        t, u = out.view(np.float32), self._a[:len(c)].view(np.float32)
        np.add(t, t, out=u)
        np.subtract(u, 2.0 ** -14, out=u)  # 2t - 2**-14: exact, the value of a subnormal one
        np.minimum(t, u, out=t)  # the smaller is the right one (both normal floats)
        if c.max(initial=0) >= 0x7C00:  # Inf, NaN (payload kept)
            np.bitwise_or(out, 0x7F800000, out=out, where=c >= 0x7C00)

    def _encode_f16(self, x: np.ndarray, codes: np.ndarray, lost: np.ndarray | None) -> None:
        """float16 codes of ``x``, rounded to nearest, ties to even, as NumPy's cast."""
        k, b = len(x), x.view(np.uint32)
        a, h, t = self._a[:k], self._bits[:k], self._t[:k]
        np.bitwise_and(b, 0x7FFFFFFF, out=a)
        special = a.max(initial=0) >= 0x47800000  # |x| >= 65536, Inf or NaN
        np.add(a.view(np.float32), 0.5, out=t.view(np.float32))
        np.subtract(t, 0x3F000000, out=t)  # |x| in units of 2**-24, rounded by the FPU
        np.maximum(a, 0x38800000, out=a)  # normal halves: rebase the exponent, round at bit 13
        np.right_shift(a, 13, out=h)
        np.bitwise_and(h, 1, out=h)
        np.add(h, a, out=h)
        np.add(h, 0xFFF - 0x38000000 + (1 << 32), out=h)
        np.right_shift(h, 13, out=h)
        np.minimum(h, t, out=h)  # the subnormal reading where it is the smaller
        if special:
            np.bitwise_and(b, 0x7FFFFFFF, out=a)
            np.right_shift(a, 13, out=t)  # NaN: 0x7C00 + the payload's top bits (at least 1)
            np.bitwise_and(t, 0x3FF, out=t)
            np.maximum(t, 1, out=t)
            np.add(t, 0x7C00, out=t)
            np.copyto(h, 0x7C00, where=a >= 0x47800000)
            np.copyto(h, t, where=a > 0x7F800000)
        if lost is not None:
            self._f16_magnitude(h, t)
            np.bitwise_and(b, 0x80000000, out=a)
            np.bitwise_or(t, a, out=t)
        np.right_shift(b, 16, out=a)
        np.bitwise_and(a, 0x8000, out=a)
        np.bitwise_or(a, h, out=a)
        codes[...] = a
        if lost is not None:
            np.subtract(x, t.view(np.float32), out=lost)


def _by_group(a: np.ndarray, per_group: np.ndarray, out: np.ndarray, dtype=None) -> None:
    """``out = a * per_group[g]`` for each group ``g`` of :data:`GROUP` values of ``a``."""
    k = len(a)
    full, cut = k // GROUP, k // GROUP * GROUP
    if full:
        np.multiply(a[:cut].reshape(full, GROUP), per_group[:full, None],
                    out=out[:cut].reshape(full, GROUP), dtype=dtype)
    if cut < k:
        np.multiply(a[cut:], per_group[full], out=out[cut:], dtype=dtype)


def _blocks(lo: int, hi: int, block: int = BLOCK):
    """``(lo, hi)`` slices of at most ``block`` values covering ``lo .. hi`` (none if empty)."""
    return [(a, min(a + block, hi)) for a in range(lo, hi, block)]


def segments(lo: int, hi: int, at: int, codec: str):
    """``(a, b, ca, cb)``: the blocks ``a .. b`` of values ``lo .. hi`` whose codes start
    at unit ``at``, each with its codes' units ``ca .. cb`` (every block a segment)."""
    whole = units(BLOCK, codec)
    return [(a, b, at + j * whole, at + j * whole + units(b - a, codec))
            for j, (a, b) in enumerate(_blocks(lo, hi))]


def _scan(x: np.ndarray, f16: bool) -> tuple[bool, bool]:
    """Of a float32 block about to be encoded: whether it holds a value that is not finite
    or that the codec turns into Inf, and (``f16``) whether it holds a finite value beyond
    float16's 65504. One dot product clears most blocks; the others are searched."""
    if float(np.dot(x, x)) < (FLOAT16_MAX ** 2 if f16 else np.inf):  # NaN: searched
        return False, False
    top = float(np.maximum(x.max(), -x.min())) if len(x) else 0.0  # NaN if x holds one
    if not top < (np.inf if f16 else BFLOAT16_INF_FROM):
        return True, False
    return False, f16 and top > FLOAT16_MAX


@functools.cache
def numba_available() -> bool:
    """Whether numba, which the compiled kernels need, imports here (installed and working)."""
    try:
        import numba  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or any failure of its import
        return False
    return True


def compile_error(codec: str, dtype: np.dtype) -> str | None:
    """:func:`compile_kernels` here; None if it worked, else why not."""
    try:
        compile_kernels(codec, dtype)
    except Exception as exc:  # noqa: BLE001 - numba's errors have no common base
        return f"{type(exc).__name__}: {exc}"
    return None


def compile_kernels(codec: str, dtype: np.dtype) -> None:
    """Compile (or load from numba's cache) the kernels that :class:`Codec` runs for
    ``codec`` and a gradient buffer of ``dtype``, once per process: every call of a step
    then runs compiled code (a first compile takes seconds)."""
    k, n = Codec(codec, jit=True), GROUP + 1
    src, res, lost = np.zeros(n, dtype), np.zeros(n, np.float32), np.zeros(n, np.float32)
    codes = np.zeros(units(n, codec), np.uint16)
    for r, out in ((res, lost), (None, None)):
        k.encode_sum_(src, codes, r, out, scan=True)
        k.sum_encode_(codes, codes[:0], np.array([-1], np.int64), n, r, out)
    k.decode_(codes, src)
