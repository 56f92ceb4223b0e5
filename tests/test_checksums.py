"""CRC-32s combined (`checksums`): the CRC-32 of A + B from those of A and B, against zlib's
CRC-32 of the concatenation. Framework-free and fast."""

from __future__ import annotations

import random
import zlib

import pytest

from nvcomp_ckpt_engine.checksums import ZeroBytes, crc32_combine

#: Lengths where an operator's bits change: empty, one byte, powers of two and their
#: neighbours, and lengths with many bits set.
EDGES = (0, 1, 2, 3, 7, 8, 9, 255, 256, 257, 4095, 4096, 4097, 65535, 65536, 65537, 0x2AAAA)


def _both(crc1: int, crc2: int, len2: int) -> tuple[int, int]:
    return crc32_combine(crc1, crc2, len2), ZeroBytes(len2).combine(crc1, crc2)


@pytest.mark.parametrize("len2", EDGES)
def test_combine_equals_the_crc_of_the_concatenation_at_edge_lengths(len2: int) -> None:
    rng = random.Random(len2)
    for len1 in (0, 1, 5, 4096):
        a, b = rng.randbytes(len1), rng.randbytes(len2)
        expected = zlib.crc32(a + b)
        assert _both(zlib.crc32(a), zlib.crc32(b), len2) == (expected, expected), (len1, len2)


def test_combine_equals_the_crc_of_the_concatenation_at_random_lengths() -> None:
    rng = random.Random(28)
    for _ in range(200):
        data = rng.randbytes(rng.randrange(0, 200_000))
        cut = rng.randrange(0, len(data) + 1)
        a, b = data[:cut], data[cut:]
        expected = zlib.crc32(data)
        assert _both(zlib.crc32(a), zlib.crc32(b), len(b)) == (expected, expected), (len(a), len(b))


@pytest.mark.parametrize("len2", [1 << 26, (1 << 26) + 1, 3 * (1 << 24) + 5, (1 << 27) - 1])
def test_combine_at_the_lengths_of_file_segments(len2: int) -> None:
    """Segments of 64 MiB and the tail of a file: zero bytes, whose CRC zlib computes as fast
    as any, exercise the same high operator bits as data would."""
    a, b = b"a checkpoint's first bytes", bytes(len2)
    expected = zlib.crc32(b, zlib.crc32(a))
    assert _both(zlib.crc32(a), zlib.crc32(b), len2) == (expected, expected)


def test_segments_of_one_length_combined_in_order_give_the_whole_crc() -> None:
    """How a file's CRC is assembled from its segments: one operator, built once, for every
    whole segment, and the general combine for a shorter last one."""
    rng = random.Random(7)
    segment = 4096
    for size in (0, 1, segment - 1, segment, segment + 1, 5 * segment, 5 * segment + 1234):
        data = rng.randbytes(size)
        whole, crc = ZeroBytes(segment), 0
        for start in range(0, size, segment):
            piece = data[start : start + segment]
            crc = (whole.combine(crc, zlib.crc32(piece)) if len(piece) == segment
                   else crc32_combine(crc, zlib.crc32(piece), len(piece)))
        assert crc == zlib.crc32(data), size


@pytest.mark.parametrize("bad", [-1, 1 << 64])
def test_a_length_out_of_range_is_refused(bad: int) -> None:
    with pytest.raises(ValueError, match="length"):
        crc32_combine(0, 0, bad)
    with pytest.raises(ValueError, match="length"):
        ZeroBytes(bad)
