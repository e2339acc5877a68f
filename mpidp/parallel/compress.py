"""Gradient compression: the codecs (IEEE float16, bfloat16, int8 with scales) and the
``compressed`` exchange strategy (the codecs are pure NumPy).

The 16-bit codecs store a value in 16 bits (half the bytes of float32). float16 keeps 11
significant bits but overflows beyond 65504; bfloat16 keeps float32's range with 8
significant bits. ``int8`` stores a value in 8 bits plus one float32 scale per
:data:`GROUP` values (about a quarter of float32's bytes): each value is rounded to the
nearest of 255 evenly spaced levels between minus and plus its group's largest magnitude
(or :data:`INT8_TINY`, if that is larger).
:func:`encode` and :func:`decode` are the reference formulas (whole arrays, new arrays
out; an int8 array is one segment whose groups start at its first value); :class:`Codec`
does the same arithmetic in place on blocks, with scratch of its own, for the per-step
passes of :class:`Compressed`. Codes travel as ``uint16`` units: one per value for the
16-bit codecs, :func:`units` for ``k`` values of int8 (the int8 codes, padded to 4 bytes,
then the float32 scales).
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from collections.abc import Callable

import numpy as np

from .. import comm as C
from ..nn import Optimizer
from . import buffer
from .overlap import layer_buckets
from .sync import Buffers, Exchanged, Round, Setup, Sync, global_sums

FLOAT_CODECS = ("float16", "bfloat16")  # one 16-bit code per value
CODECS = (*FLOAT_CODECS, "int8")
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
#: how :class:`Compressed` picks its codec's kernels
KERNELS = ("auto", "numpy", "numba")
#: Values per block of :class:`Compressed`'s passes: a block's scratch (a few arrays of
#: ``BLOCK`` 4-byte values) stays in a core's L2 cache while several NumPy ops run on it.
BLOCK = 1 << 16


def units(k: int, codec: str) -> int:
    """``uint16`` units that the codes of one segment of ``k`` values take."""
    if codec != "int8":
        return k
    return 2 * -(-k // 4) + 2 * -(-k // GROUP)


def chunk_units(m: int, codec: str) -> int:
    """Units of ``m`` values encoded in segments of :data:`BLOCK` (the last one shorter)."""
    return (m // BLOCK) * units(BLOCK, codec) + units(m % BLOCK, codec)


def _int8_parts(codes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The int8 codes ``(k,)`` and float32 scales ``(ceil(k / GROUP),)`` inside one
    segment's ``uint16`` units (views)."""
    b = codes.view(np.uint8)
    at = 4 * -(-k // 4)
    return b[:k].view(np.int8), b[at:at + 4 * -(-k // GROUP)].view(np.float32)


def _int8_encode(x: np.ndarray) -> np.ndarray:
    """The reference int8 encoding of one segment ``x`` (float32)."""
    k, groups = len(x), -(-len(x) // GROUP)
    padded = np.zeros(groups * GROUP, np.float32)
    padded[:k] = x
    g = padded.reshape(groups, GROUP)
    top = np.maximum(np.maximum(g.max(axis=1), -g.min(axis=1)), INT8_TINY)  # NaN stays
    inv = np.float32(127) / top
    out = np.zeros(units(k, "int8"), np.uint16)
    q, scale = _int8_parts(out, k)
    scale[...] = top / np.float32(127)
    q[...] = np.rint(g * inv[:, None]).reshape(-1)[:k].astype(np.int8)
    return out


def _int8_decode(codes: np.ndarray, k: int) -> np.ndarray:
    q, scale = _int8_parts(codes, k)
    return (q.astype(np.float32) * np.repeat(scale, GROUP)[:k]).astype(np.float32)


def encode(x: np.ndarray, codec: str) -> np.ndarray:
    """``x`` (float32/64) → ``uint16`` codes. bfloat16 rounds to nearest, ties to even;
    float16 turns values beyond 65504 into Inf (callers check for overflow first); int8
    rounds ``x * (127 / top)`` to the nearest integer (ties to even), ``top``
    the largest magnitude of the value's group (at least :data:`INT8_TINY`); a group
    holding NaN or Inf decodes to NaN or Inf."""
    if codec == "int8":
        with np.errstate(invalid="ignore", over="ignore"):
            return _int8_encode(np.asarray(x, np.float32))
    if codec == "float16":
        with np.errstate(over="ignore"):
            return np.asarray(x, np.float16).view(np.uint16)
    bits = np.asarray(x, np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    return (rounded >> 16).astype(np.uint16)


def decode(codes: np.ndarray, codec: str, n: int | None = None) -> np.ndarray:
    """``uint16`` codes → float32 values (int8: the segment's ``n`` values)."""
    if codec == "int8":
        with np.errstate(invalid="ignore"):
            return _int8_decode(codes, int(n))
    if codec == "float16":
        return codes.view(np.float16).astype(np.float32)
    return (codes.astype(np.uint32) << 16).view(np.float32)


class Codec:
    """:func:`encode` and :func:`decode` in place, bit for bit, on blocks of at most
    ``block`` values: no allocation per call. Call inside ``np.errstate(over="ignore",
    invalid="ignore")`` (float16 overflow and NaN arithmetic are expected there).

    ``x``, ``acc``, ``lost``: float32 ``(k,)``; ``codes``: uint16 ``(units(k),)``, one
    segment; ``out``: float32 or float64 ``(k,)``; ``k <= block``. ``lost`` may be ``x``
    itself.

    The 16-bit codecs work on the float32 bits with integer ops, float16 too (faster than
    NumPy's float16 casts); its subnormals go through two float ops that round exactly as
    the cast. int8 takes each group's largest magnitude as an integer max of the float
    bits with the sign cleared, and scales whole groups at once.
    """

    def __init__(self, codec: str, block: int = BLOCK, jit: bool = False) -> None:
        if codec not in CODECS:
            raise C.MpidpError(f"unknown compression {codec!r}; expected one of {CODECS}")
        if jit and codec not in JIT_CODECS:
            raise C.MpidpError(f"compiled compression kernels exist for {JIT_CODECS} only, "
                               f"not {codec!r}")
        self.codec, self.block, self.jit = codec, int(block), bool(jit)
        self._bits, self._a, self._t, self._o = (np.zeros(self.block, np.uint32) for _ in "abto")
        self._top, self._inv = (np.zeros(self.block // GROUP + 1, np.float32) for _ in "ti")
        self._x = np.zeros(self.block, np.float32)  # values to encode, or a block of sums
        self._one, self._none = np.zeros(1, np.float32), np.zeros(0, np.float32)
        self._k = None
        if jit:
            from . import compress_jit  # imports numba
            self._k = compress_jit

    def encode_sum_(self, src: np.ndarray, codes: np.ndarray, res: np.ndarray | None = None,
                    lost: np.ndarray | None = None, scan: bool = False) -> tuple[bool, bool]:
        """``codes[...] = encode(src + res)`` (the sum in float32; ``src`` alone without
        ``res``); with ``lost`` (and ``res``), what that loses into ``lost``. ``src``:
        float32 or float64 ``(k,)``; ``res``, ``lost``: float32 ``(k,)``, ``lost`` may be
        ``res``. With ``scan``, returns :func:`_scan`'s verdict on the values encoded,
        else ``(False, False)``."""
        if (res is None) != (lost is None):
            raise ValueError("encode_sum_ takes res and lost together")
        f16 = self.codec == "float16"
        if self.jit:
            ef = res is not None
            res, lost = (res, lost) if ef else (self._none, self._none)
            if self.codec == "int8":
                q, scale = _int8_parts(codes, len(src))
                top = self._k.i8_encode(src, res, ef, self._x[:len(src)], lost, ef, q, scale,
                                        INT8_TINY, self._one)
            else:
                top = self._k.bf16_encode(src, res, ef, lost, ef, codes, self._one)
            return (scan and top >= BFLOAT16_INF_BITS), False
        x = lost if lost is not None else self._x[:len(src)]
        if res is not None:
            np.add(src, res, out=x)
        else:
            np.copyto(x, src, casting="same_kind")
        verdict = _scan(x, f16) if scan else (False, False)
        self.encode_(x, codes, lost)
        return verdict

    def sum_encode_(self, mine: np.ndarray, recv: np.ndarray, starts: np.ndarray, k: int,
                    res: np.ndarray | None = None,
                    lost: np.ndarray | None = None) -> tuple[bool, bool]:
        """``mine[...] = encode(sum + res)``: ``sum``, the float32 sum in rank order of the
        ``P`` ranks' codes of one segment of ``k`` values, rank ``r``'s being ``mine``
        where ``starts[r] < 0`` (int64 ``(P,)``), else ``recv[starts[r]:]``; with
        ``lost`` (and ``res``, float32 ``(k,)``), what the encoding loses into ``lost``.
        Returns :func:`_scan`'s verdict on ``sum + res``."""
        if (res is None) != (lost is None):
            raise ValueError("sum_encode_ takes res and lost together")
        if self.jit:
            ef, acc = res is not None, self._x[:k]
            res, lost = (res, lost) if ef else (self._none, self._none)
            if self.codec == "int8":
                top = self._k.i8_sum(mine, recv, starts, k, res, ef, lost, ef, acc, INT8_TINY,
                                     self._one)
            else:
                top = self._k.bf16_sum(mine, recv, starts, res, ef, lost, ef, acc,
                                       acc.view(np.uint32), self._one)
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
        if self.codec == "int8":
            self._encode_i8(x, codes, lost)
            return
        if self.codec == "float16":
            self._encode_f16(x, codes, lost)
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
        if self.jit and self.codec == "int8":
            self._k.i8_decode(*_int8_parts(codes, len(out)), out)
            return
        if self.jit:
            self._k.bf16_decode(codes, out, self._one)
            return
        if self.codec == "int8":
            value = out if out.dtype == np.float32 else self._o[:len(out)].view(np.float32)
            self._decode_i8(codes, value)
            if value is not out:
                np.copyto(out, value)
            return
        if self.codec == "bfloat16" and out.dtype == np.float32:
            bits = out.view(np.uint32)
            bits[...] = codes
            np.left_shift(bits, 16, out=bits)
            return
        for lo, hi in _blocks(0, len(codes), self.block):
            mine = out.dtype == np.float32
            value = out[lo:hi] if mine else self._o[:hi - lo].view(np.float32)
            self._decode32(codes[lo:hi], value)
            if not mine:
                np.copyto(out[lo:hi], value)

    def decode_add_(self, codes: np.ndarray, acc: np.ndarray) -> None:
        """``acc += decode(codes)`` (float32 arithmetic)."""
        value = self._o[:len(acc)].view(np.float32)
        (self._decode_i8 if self.codec == "int8" else self._decode32)(codes, value)
        np.add(acc, value, out=acc)

    def _decode32(self, codes: np.ndarray, out: np.ndarray) -> None:
        """``out`` (float32, a block, not this codec's scratch but ``_o``) = decode(codes)."""
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

    def _grouped(self, k: int):
        """``(groups, full)``: int8 groups of ``k`` values, of which ``full`` are whole."""
        return -(-k // GROUP), k // GROUP

    def _encode_i8(self, x: np.ndarray, codes: np.ndarray, lost: np.ndarray | None) -> None:
        """int8 codes and scales of one segment ``x``, as :func:`encode`. Scratch: ``_o``."""
        k = len(x)
        (groups, full), cut = self._grouped(k), k // GROUP * GROUP
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
        if full:
            np.multiply(x[:cut].reshape(full, GROUP), inv[:full, None],
                        out=f[:cut].reshape(full, GROUP))
        if full < groups:
            np.multiply(x[cut:], inv[full], out=f[cut:])
        np.rint(f, out=f)
        np.copyto(q, f, casting="unsafe")
        if lost is not None:
            if full:
                np.multiply(f[:cut].reshape(full, GROUP), scale[:full, None],
                            out=f[:cut].reshape(full, GROUP))
            if full < groups:
                np.multiply(f[cut:], scale[full], out=f[cut:])
            np.subtract(x, f, out=lost)

    def _decode_i8(self, codes: np.ndarray, out: np.ndarray) -> None:
        """``out`` (float32 ``(k,)``) = the values of one int8 segment of ``k`` values."""
        k = len(out)
        (groups, full), cut = self._grouped(k), k // GROUP * GROUP
        q, scale = _int8_parts(codes, k)
        if full:
            np.multiply(q[:cut].reshape(full, GROUP), scale[:full, None],
                        out=out[:cut].reshape(full, GROUP), dtype=np.float32)
        if full < groups:
            np.multiply(q[cut:], scale[full], out=out[cut:], dtype=np.float32)

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


def _blocks(lo: int, hi: int, block: int = BLOCK):
    """``(lo, hi)`` slices of at most ``block`` values covering ``lo .. hi`` (none if empty)."""
    return [(a, min(a + block, hi)) for a in range(lo, hi, block)]


def _segments(lo: int, hi: int, at: int, codec: str):
    """``(a, b, ca, cb)``: the blocks ``a .. b`` of values ``lo .. hi`` whose codes start
    at unit ``at``, each with its codes' units ``ca .. cb`` (every block a segment)."""
    whole = units(BLOCK, codec)
    out = []
    for j, (a, b) in enumerate(_blocks(lo, hi)):
        ca = at + j * whole
        out.append((a, b, ca, ca + units(b - a, codec)))
    return out


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


#: Values per exchange at most: a bucket goes in pieces, so that one piece travels while
#: the next is encoded (or summed), and the last bucket's codec work overlaps its link time.
PIECE = 1 << 18


def _piece_length(size: int) -> int:
    """Gradient values per exchange: at most :data:`PIECE` per rank, and never a count or
    displacement beyond ``MAX_COUNT``: a piece's codes, ``size`` chunks apart (sent,
    gathered), and the other ranks' parts of a chunk (received)."""
    limit = int(C.collectives.MAX_COUNT)
    return max(1, min(limit if size == 1 else size * (limit // size), size * PIECE))


@functools.cache
def numba_available() -> bool:
    """Whether numba, which the compiled kernels need, can be imported here (installed,
    and its import works: a numba built for another NumPy fails there)."""
    if importlib.util.find_spec("numba") is None:
        return False
    try:
        import numba  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure of a third party's import: not usable
        return False
    return True


def _kernels_compile(codec: str, dtype: np.dtype) -> str | None:
    """:func:`_compile_kernels` here; None if it worked, else why not."""
    try:
        _compile_kernels(codec, dtype)
    except Exception as exc:  # noqa: BLE001 - numba's errors have no common base
        return f"{type(exc).__name__}: {exc}"
    return None


def _compile_kernels(codec: str, dtype: np.dtype) -> None:
    """Compile (or load from numba's cache) the kernels that :class:`Compressed` calls for
    ``codec`` and a gradient buffer of ``dtype``, once per process: every call of a step
    then runs compiled code (a first compile takes seconds)."""
    k, n = Codec(codec, jit=True), GROUP + 1
    src, res, lost = np.zeros(n, dtype), np.zeros(n, np.float32), np.zeros(n, np.float32)
    codes = np.zeros(units(n, codec), np.uint16)
    k.encode_sum_(src, codes, res, lost, scan=True)
    k.encode_sum_(src, codes, scan=True)
    for r, out in ((res, lost), (None, None)):
        k.sum_encode_(codes, codes[:0], np.array([-1], np.int64), n, r, out)
    k.decode_(codes, src)


class Float16Overflow(C.MpidpError):
    """A gradient, or a chunk's sum, beyond float16's 65504: raised on every rank by
    :meth:`Compressed.reduce` before anything is decoded, so the gradient buffer still
    holds this rank's own gradients (``auto`` exchanges them another way)."""


class _Piece:
    """One exchange: gradient values ``s0 .. s1`` (at most ``MAX_COUNT``) in ``size`` chunks
    whose sizes differ by at most one (some empty when there are fewer values than ranks).
    Their codes live at ``codes[o : o + size * cu]``, chunk ``j`` at ``o + j * cu`` (``cu``:
    the units of the largest chunk, ``c`` values, :func:`chunk_units`), so that one
    ``Allgather`` of ``cu`` units per rank gathers them; chunk ``rank``, values
    ``lo .. hi`` (``m`` of them, ``mu`` units) and codes from ``own``, is summed on this
    rank."""

    def __init__(self, s0: int, s1: int, size: int, rank: int, o: int, at: int,
                 codec: str = "bfloat16") -> None:
        length, self.s1 = s1 - s0, s1
        counts = np.full(size, length // size, np.int64)
        counts[:length % size] += 1
        starts = s0 + np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        sizes = np.array([chunk_units(int(k), codec) for k in counts], np.int64)
        self.c, self.cu = int(counts[0]), int(sizes[0])
        cu = self.cu
        self.o, self.end, self.m, self.at = o, o + size * cu, int(counts[rank]), at
        self.mu = int(sizes[rank])
        self.lo, self.own = int(starts[rank]), o + rank * cu
        self.hi = self.lo + self.m
        #: ``(values lo, values hi, codes lo)`` of every non-empty chunk
        self.runs = [(int(starts[j]), int(starts[j] + counts[j]), o + j * cu)
                     for j in range(size) if counts[j]]
        send = sizes.copy()
        send[rank] = 0  # this rank's own chunk never travels to itself
        self.send = (send, np.arange(size, dtype=np.int64) * cu)
        recv = np.full(size, self.mu, np.int64)
        recv[rank] = 0
        slot = np.arange(size) - (np.arange(size) > rank)  # the other senders, packed
        self.slot = (slot * self.mu).astype(np.int64)  # where sender r's part starts
        self.recv = (recv, self.slot)
        self.sent = int(send.sum()) + cu  # units handed to MPI: chunks out, summed chunk in


class Compressed(Sync):
    """Gradients exchanged as 16-bit codes (``float16`` or ``bfloat16``; or ``int8`` with
    scales) in two steps, with error feedback: about half (int8: a quarter) the bytes of a
    float32 ring allreduce at every P; started during backward, bucket by bucket, as
    :class:`~mpidp.parallel.overlap.Overlapped` does.

    The ``n`` gradient values are cut into buckets of whole layers (last layers first, at
    least ``bucket_bytes`` of gradients each), and each bucket into P chunks whose sizes
    differ by at most one (some empty); rank ``j`` owns chunk ``j`` of every bucket. When
    backward has finished a bucket's layers, each rank encodes that bucket's gradient plus
    its residual, and one ``Ialltoallv`` hands chunk ``j`` of every rank's codes to rank
    ``j`` (a reduce-scatter). Once it has arrived (``MPI_Testsome`` at every layer boundary
    of backward moves it), the owner decodes the P contributions and sums them in float32
    in rank order, the same sum whatever order they arrived in, encodes its summed chunk
    (plus its chunk residual), and one ``Iallgather`` (chunks padded to the largest, on a
    communicator of its own, so that the two kinds never need matching starts) gives every
    rank every chunk's codes. Every rank decodes the same codes, so every replica holds
    bit-identical sums; with a 16-bit codec the buckets change who sums a value, never
    how, so the sums are the same for every bucket size. Per step ``2 (P-1)/P n`` values
    of 2 bytes (int8: 1 byte, plus 4 per :data:`GROUP`) leave a rank, against
    ``2 (P-1)/P n`` of 4 for a float32 ring allreduce; ``bytes_sent``
    counts the codes it hands to MPI (its chunks for the others, its summed chunks with
    their padding) plus the extras. Loss, counts, stop and two flags (float16 overflow, a
    non-finite sum) go in one small float64 ``Allreduce`` once every bucket has been
    started. A bucket goes in pieces of at most :data:`PIECE` values per rank (and
    ``MAX_COUNT`` in all), each split alike and started once encoded, so that one travels
    while the next is encoded. A piece starts as soon as its values are final: a layer
    that announces its gradient in parts (a large ``Dense``, ``on_layer_part``) lets the
    first pieces of its bucket go before it has finished. The sums of a piece whose
    gather has arrived are decoded into the gradient buffer while backward still runs
    (its values there were encoded and are read no more), except with float16, whose
    overflow must leave every rank's own gradients in the buffer.

    Error feedback: what each rounding loses is added back at the next step, so no
    rounding error is lost for good. Each rank keeps the residual of its own encoding
    ``(n,)`` (what ``gradient + residual`` lost to 16 bits) and, as owner, the residual of
    re-encoding its chunk sums ``(about n/P,)``. A step that is not applied (the NaN policy
    drops it) leaves both residuals as they were; ``error_feedback=False`` keeps none.
    Residuals are not checkpointed: a resumed run starts them at zero.

    A value beyond float16's 65504, in a rank's gradient or in a chunk's sum, is a
    :class:`Float16Overflow` on every rank, never an Inf; a non-finite sum goes to
    the NaN policy (this strategy gives the trainer its verdict). The passes over the
    vector run in blocks of :data:`BLOCK` values with preallocated scratch.

    Parameters
    ----------
    codec : ``"bfloat16"`` (float32's range, 8 significant bits), ``"float16"`` (11
        significant bits, up to 65504) or ``"int8"`` (255 levels per :data:`GROUP` values;
        int8 groups start at each block of a chunk, so its sums depend on P and the
        buckets, the 16-bit codecs' do not).
    error_feedback : keep both residuals (False: every step's rounding is lost).
    bucket_bytes : a bucket closes once its layers hold at least this many bytes of
        gradients; a size beyond the whole gradient makes one bucket, started when
        backward ends.
    kernels : how the codec's passes run: ``"numpy"``, ``"numba"`` (compiled, about 3x
        faster; bfloat16 only, and numba importable on every rank, else refused) or
        ``"auto"`` (numba where it can be, on every rank alike). Both give the same bits.
    """

    name = "compressed"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.gather_comm: C.Comm | None = None
        self._step = 0  # of the current exchange, for messages

    def setup(self, s: Setup) -> Buffers:
        out = super().setup(s)
        n, size, rank = self.n, s.comm.size, s.comm.rank
        buckets = layer_buckets(s.model.layer_ranges, n, self.buf.itemsize, self.bucket_bytes)
        #: ``(layer, pieces)`` per bucket in launch order: started once ``layer`` is done
        self.buckets: list[tuple[int, list[_Piece]]] = []
        self.pieces, at, o, r, step = [], 0, 0, 0, _piece_length(size)
        for layer, b0, b1 in buckets or [(0, 0, 0)]:
            mine = []
            for s0 in range(b0, b1, step) if b1 > b0 else [b0]:
                p = _Piece(s0, min(s0 + step, b1), size, rank, o, at, self.codec)
                p.recv_at, r = r, r + (size - 1) * p.mu  # its own room: pieces overlap in time
                mine.append(p)
                at, o = at + p.m, p.end
            self.pieces += mine
            self.buckets.append((layer, mine))
        for p in self.pieces:
            #: ``(values lo, values hi, codes lo, codes hi)`` of every block of every chunk
            p.blocks = [seg for lo, hi, clo in p.runs for seg in _segments(lo, hi, clo, self.codec)]
        self.kernel = Codec(self.codec, jit=self._compiled(s.comm))
        self.layer_lo = [lo for lo, _ in s.model.layer_ranges]
        self.piece = step
        self.codes = np.zeros(o, np.uint16)  # this rank's codes, then the summed ones
        self.recv = np.zeros(r, np.uint16)  # the other ranks' codes of this rank's chunks
        self._starts = np.zeros(size, np.int64)  # where each rank's codes of a chunk start
        self.extras = np.zeros(buffer.N_EXTRA + 2, np.float64)  # | overflow | non-finite
        self.step_bytes = self.extras.nbytes + (  # one rank: its codes are the sums
            sum(p.sent for p in self.pieces) * 2 if size > 1 else 0)
        # what rounding lost, in use and next, kept apart so that a skipped (non-finite)
        # step leaves the residuals as they were instead of poisoning them
        ef = self.error_feedback
        self.residual, self._next = (np.zeros(n if ef else 0, np.float32) for _ in "ab")
        self.chunk_residual, self._chunk_next = (np.zeros(at if ef else 0, np.float32)
                                                 for _ in "ab")
        self.gather_comm = C.companion(s.comm) if size > 1 else None
        self._begin()
        return out

    def _compiled(self, comm: C.Comm) -> bool:
        """Whether the codec runs numba's kernels: decided alike on every rank (numba
        importable on all of them), then compiled (or loaded from numba's cache) on each.
        Collective unless the codec or ``kernels`` rules them out."""
        if self.kernels == "numpy" or self.codec not in JIT_CODECS:
            return False
        here = numba_available()
        if self.kernels == "numba":
            C.agree(comm, None if here else "compression kernels 'numba': numba cannot be "
                    "imported (pip install numba); use kernels 'auto' or 'numpy'")
            C.run_agreed(comm, _compile_kernels, self.codec, self.buf.dtype)
            return True
        # auto: compiled where every rank can import numba and compile the kernels
        why = _kernels_compile(self.codec, self.buf.dtype) if here else "no numba"
        if here and why is not None:
            warnings.warn(f"compression kernels: numba's failed to compile on rank "
                          f"{comm.rank} ({why}); every rank runs NumPy's passes",
                          RuntimeWarning, stacklevel=2)
        return not C.allreduce_max(comm, [0.0 if why is None else 1.0])[0]

    def _begin(self) -> None:
        """Nothing started: the state of every step's start."""
        self.launched = 0  # buckets started
        self.started = 0  # pieces started of the next bucket
        self.scattering: list = []  # the Ialltoallv of each started piece, in order
        self.summed = 0  # pieces of those whose chunk this rank has summed
        self.gathering: list = []  # the Iallgather of each summed piece, in order
        self.decoded = 0  # pieces of those whose sums are in the gradient buffer already
        self.nonfinite = self.overflow = False

    def on_layer_done(self) -> Callable[[int], None]:
        def launch(i: int) -> None:
            self._advance(wait=False)  # first what has arrived: its gather starts at once
            if self.launched < len(self.buckets) and self.buckets[self.launched][0] == i:
                self._launch()
        return launch

    def on_layer_part(self) -> tuple[Callable[[int, int], None], int] | None:
        if self.comm.size == 1:
            return None  # nothing travels: codes are encoded when backward ends

        def launch(i: int, done: int) -> None:
            self._advance(wait=False)
            if self.launched < len(self.buckets) and self.buckets[self.launched][0] == i:
                self._launch(upto=self.layer_lo[i] + done)
        return launch, self.piece

    def exchange(self, r: Round) -> Exchanged:
        self._step = r.step
        with self.timer.communicate(self.name, bytes=self.step_bytes):
            finite = self.reduce()
        got = global_sums(self.buf, self.n)
        got.finite = finite if r.checks else None
        return got

    def update(self, optimizer: Optimizer, count: int) -> None:
        if self.error_feedback:  # applied: this step's rounding residuals count
            self.residual, self._next = self._next, self.residual
            self.chunk_residual, self._chunk_next = self._chunk_next, self.chunk_residual
        super().update(optimizer, count)

    def at_boundary(self) -> bool:
        return self.launched == 0 and self.started == 0

    def reduce(self) -> bool:
        """The global sums into ``self.buf`` on every rank; returns whether they are finite
        (loss and counts included). Starts the buckets backward has not started, completes
        them all. Collective: per piece one ``Ialltoallv`` and one ``Iallgather``, and one
        ``Allreduce`` (only the ``Allreduce`` on one rank, whose codes are the sums)."""
        n = self.n
        self._advance(wait=False)
        while self.launched < len(self.buckets):
            self._launch()
        self._advance(wait=True)
        extras = self.extras
        extras[:buffer.N_EXTRA] = self.buf[n:]
        extras[buffer.N_EXTRA:] = (self.overflow, self.nonfinite)
        C.allreduce_sum_(self.comm, extras)
        gathering, pieces, decoded = self.gathering, self.pieces, self.decoded
        self._begin()
        if extras[buffer.N_EXTRA]:
            C.wait_all(gathering)
            raise Float16Overflow(
                f"float16 gradient compression overflowed at step {self._step}: a gradient "
                f"exceeds {FLOAT16_MAX:g}; use bfloat16 or no compression")
        with np.errstate(invalid="ignore"):  # float16 NaN codes: casts warn
            for j in range(decoded, len(pieces)):
                if gathering:
                    C.wait_all(gathering[j:j + 1])
                self._decode(pieces[j])
        self.buf[n:] = extras[:buffer.N_EXTRA]
        self.bytes_sent += self.step_bytes
        return not extras[buffer.N_EXTRA + 1] and bool(np.isfinite(extras[:buffer.N_EXTRA]).all())

    def _launch(self, upto: int | None = None) -> None:
        """Encode the next bucket's pieces not started yet (its gradient plus residual;
        what that loses into ``_next``) and start their reduce-scatters; with ``upto``,
        only those whose values end by ``upto`` (the rest are not final yet)."""
        g, codes, k, ef = self.buf[:self.n], self.codes, self.kernel, self.error_feedback
        f16, alone = self.codec == "float16", self.comm.size == 1
        scan = f16 or alone  # else the owners scan the sums (always: one dot per block)
        _, pieces = self.buckets[self.launched]
        ready = [p for p in pieces[self.started:] if upto is None or p.s1 <= upto]
        self.started += len(ready)
        if self.started == len(pieces):
            self.launched, self.started = self.launched + 1, 0
        with np.errstate(over="ignore", invalid="ignore"):
            for p in ready:
                for lo, hi, ca, cb in p.blocks:
                    bad, beyond = k.encode_sum_(g[lo:hi], codes[ca:cb],
                                                self.residual[lo:hi] if ef else None,
                                                self._next[lo:hi] if ef else None, scan)
                    self.nonfinite, self.overflow = self.nonfinite or bad, self.overflow or beyond
                if not alone:
                    recv = self.recv[p.recv_at:p.recv_at + (self.comm.size - 1) * p.mu]
                    self.scattering.append(C.ialltoallv_(self.comm, codes[p.o:p.end], p.send,
                                                         recv, p.recv))
                    self._advance(wait=False)  # moves what has started while the next encodes

    def _advance(self, wait: bool) -> None:
        """Sum the chunks whose codes have all arrived (in launch order) and start their
        gathers; with ``wait``, every started piece's."""
        if not self.scattering:
            return
        if not wait:
            C.test_some(self.scattering)
            if self.gathering:
                C.test_some(self.gathering)
                self._decode_arrived()
        while self.summed < len(self.scattering):
            request = self.scattering[self.summed:self.summed + 1]
            if wait:
                C.wait_all(request)
            elif request[0] != C.MPI_REQUEST_NULL:
                return
            p = self.pieces[self.summed]
            self.summed += 1
            with np.errstate(over="ignore", invalid="ignore"):
                bad, beyond = self._sum_chunk(p)
            self.nonfinite, self.overflow = self.nonfinite or bad, self.overflow or beyond
            self.gathering.append(C.iallgather_in_place(self.gather_comm,
                                                        self.codes[p.o:p.end]))

    def _decode(self, p: _Piece) -> None:
        """The sums of piece ``p`` (every chunk's codes gathered) into the gradient buffer."""
        g, codes, k = self.buf[:self.n], self.codes, self.kernel
        for a, b, ca, cb in p.blocks:
            k.decode_(codes[ca:cb], g[a:b])

    def _decode_arrived(self) -> None:
        """Decode the gathered pieces, in order, while backward runs: a piece's gradient
        values were encoded already and are read no more. Not for float16, whose overflow
        must leave this rank's own gradients in the buffer (see :class:`Float16Overflow`)."""
        if self.codec == "float16":
            return
        gathering = self.gathering
        with np.errstate(invalid="ignore"):
            while self.decoded < len(gathering) and gathering[self.decoded] == C.MPI_REQUEST_NULL:
                self._decode(self.pieces[self.decoded])
                self.decoded += 1

    def _sum_chunk(self, p: _Piece) -> tuple[bool, bool]:
        """Rank-order float32 sums of the P codes of this rank's chunk of ``p`` (its own in
        ``self.codes``, the others' in ``self.recv``), plus the chunk residual, encoded back
        into ``self.codes``; returns the :func:`_scan` verdict on the sums (computed while
        backward may still run, before the policy of the step is known, so always)."""
        k, codes, ef, starts = self.kernel, self.codes, self.error_feedback, self._starts
        nonfinite = overflow = False
        for a, b, ca, cb in _segments(0, p.m, 0, self.codec):  # offsets in the chunk
            starts[:] = p.recv_at + p.slot + ca  # rank order: the sum never depends on arrival
            starts[self.comm.rank] = -1  # this rank's own codes, in place
            bad, beyond = k.sum_encode_(codes[p.own + ca:p.own + cb], self.recv, starts, b - a,
                                        self.chunk_residual[p.at + a:p.at + b] if ef else None,
                                        self._chunk_next[p.at + a:p.at + b] if ef else None)
            nonfinite, overflow = nonfinite or bad, overflow or beyond
        return nonfinite, overflow
