"""CRC-32 in pieces: combined CRCs equal zlib's CRC of the whole, for any split."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from mpidp.data import crc32


@pytest.mark.parametrize("len_a,len_b", [(0, 0), (1, 0), (0, 5), (7, 13), (1000, 1),
                                         (12345, 67890), (3, 1 << 20)])
def test_combine_equals_the_crc_of_the_concatenation(len_a, len_b):
    rng = np.random.default_rng(len_a + len_b)
    a, b = rng.bytes(len_a), rng.bytes(len_b)
    assert crc32.combine(zlib.crc32(a), zlib.crc32(b), len_b) == zlib.crc32(a + b)


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7])
def test_shares_of_a_file_combine_to_its_crc(tmp_path, parts):
    data = np.random.default_rng(parts).bytes(100_003)
    path = tmp_path / "f"
    path.write_bytes(b"head" + data + b"tail")
    crc, covered = 0, 0
    for i in range(parts):
        a, b = crc32.share(len(data), parts, i)
        assert a == covered  # the shares tile the range, in order
        crc = crc32.combine(crc, crc32.of_range(str(path), 4 + a, b - a, chunk=4096), b - a)
        covered = b
    assert covered == len(data) and crc == zlib.crc32(data)


def test_a_range_past_the_end_of_the_file_is_an_error(tmp_path):
    (tmp_path / "f").write_bytes(b"abc")
    with pytest.raises(OSError, match="unexpected end of file"):
        crc32.of_range(str(tmp_path / "f"), 1, 5)
    with pytest.raises(ValueError):
        crc32.combine(0, 0, -1)


@pytest.mark.parametrize("offset,length", [(0, 1), (4095, 2), (4096, 70_000), (5, 99_990)])
def test_mapped_and_read_ranges_give_zlibs_crc(tmp_path, monkeypatch, offset, length):
    data = np.random.default_rng(length).bytes(100_000)
    (tmp_path / "f").write_bytes(data)
    want = zlib.crc32(data[offset:offset + length])
    assert crc32.crc32(data) == zlib.crc32(data)  # ISA-L's where installed: the same value
    assert crc32.of_range(str(tmp_path / "f"), offset, length) == want  # over a memory map

    def no_map(*args):
        raise OSError("this file system cannot map files")

    monkeypatch.setattr(crc32, "_of_mapped", no_map)
    assert crc32.of_range(str(tmp_path / "f"), offset, length, chunk=1000) == want
