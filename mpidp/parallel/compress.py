"""16-bit gradient codecs: IEEE float16 and a bfloat16-style truncation of float32. Pure NumPy.

Both store a value in 16 bits (half the bytes of float32). float16 keeps 11 significant bits
but overflows beyond 65504; bfloat16 keeps float32's range with 8 significant bits.
"""

from __future__ import annotations

import numpy as np

CODECS = ("float16", "bfloat16")
FLOAT16_MAX = float(np.finfo(np.float16).max)


def encode(x: np.ndarray, codec: str) -> np.ndarray:
    """``x`` (float32/64) → ``uint16`` codes. bfloat16 rounds to nearest, ties to even;
    float16 turns values beyond 65504 into Inf (callers check for overflow first)."""
    if codec == "float16":
        with np.errstate(over="ignore"):
            return np.asarray(x, np.float16).view(np.uint16)
    bits = np.asarray(x, np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))
    return (rounded >> 16).astype(np.uint16)


def decode(codes: np.ndarray, codec: str) -> np.ndarray:
    """``uint16`` codes → float32 values."""
    if codec == "float16":
        return codes.view(np.float16).astype(np.float32)
    return (codes.astype(np.uint32) << 16).view(np.float32)


def add(a: np.ndarray, b: np.ndarray, codec: str) -> np.ndarray:
    """Codes of ``decode(a) + decode(b)`` (the sum is formed in float32)."""
    return encode(decode(a, codec) + decode(b, codec), codec)
