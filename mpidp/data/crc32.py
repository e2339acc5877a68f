"""CRC-32 (of ``.zip``/``.npz`` members) in pieces, so that ranks can each check a part of
one file: ``combine(crc(A), crc(B), len(B)) == crc(A + B)`` (the CRC of ``A`` times
``x**(8*len(B))`` modulo the reflected polynomial). ISA-L's CRC (``isal``, the ``fast``
extra, docs/benchmarks-data.md) when installed, else zlib's: the same value."""

from __future__ import annotations

import contextlib
import mmap
import os

try:
    from isal.isal_zlib import crc32
except ImportError:  # the same checksum, slower
    from zlib import crc32

POLY = 0xEDB88320  # x^32 + x^26 + ... + 1, bit-reflected
_ONE = 1 << 31  # the polynomial 1 (x^0) in the reflected representation


def _mul(a: int, b: int) -> int:
    """``a * b`` modulo :data:`POLY`, both reflected 32-bit polynomials."""
    product = 0
    for bit in range(31, -1, -1):  # x^0 is bit 31, x^31 is bit 0
        if a & (1 << bit):
            product ^= b
        b = (b >> 1) ^ POLY if b & 1 else b >> 1  # b *= x
    return product


def _x_to_8n(n: int) -> int:
    """``x ** (8 * n)`` modulo :data:`POLY` by repeated squaring."""
    result, power = _ONE, _ONE >> 8  # power = x^8
    while n:
        if n & 1:
            result = _mul(result, power)
        power, n = _mul(power, power), n >> 1
    return result


def combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32 of ``A + B`` from the CRC-32 of ``A``, of ``B`` and ``len(B)`` in bytes."""
    if len_b < 0:
        raise ValueError(f"length must be >= 0, got {len_b}")
    return _mul(_x_to_8n(len_b), crc_a) ^ crc_b


def of_range(path: str, offset: int, length: int, chunk: int = 1 << 22) -> int:
    """CRC-32 of ``length`` bytes of file ``path`` from byte ``offset`` (mapped, or read
    ``chunk`` bytes at a time where it cannot be); ``OSError`` if the file ends before."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if length and offset + length <= os.fstat(fd).st_size:
            with contextlib.suppress(OSError, ValueError):
                return _of_mapped(fd, offset, length)
        buf, crc = memoryview(bytearray(min(chunk, max(length, 1)))), 0
        for a in range(0, length, len(buf)):
            view = buf[:min(len(buf), length - a)]
            pread_into(fd, view, offset + a)
            crc = crc32(view, crc)
        return crc
    finally:
        os.close(fd)


def _of_mapped(fd: int, offset: int, length: int) -> int:
    base = offset - offset % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, offset - base + length, access=mmap.ACCESS_READ, offset=base) as mm:
        with contextlib.suppress(AttributeError, OSError):
            mm.madvise(mmap.MADV_SEQUENTIAL)
        with memoryview(mm) as view, view[offset - base:] as part:
            return crc32(part)


def share(length: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, stop)`` of part ``index`` of ``parts`` near-equal parts of ``length`` bytes."""
    return length * index // parts, length * (index + 1) // parts


def pread_into(fd: int, out, offset: int) -> None:
    """Fill ``out`` (a C-contiguous array or buffer) from byte ``offset`` of ``fd``, no page faults."""
    view = memoryview(out).cast("B")
    while len(view):
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise OSError(f"unexpected end of file at byte {offset}")
        view, offset = view[got:], offset + got
