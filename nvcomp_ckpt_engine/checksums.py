"""CRC-32 of concatenated bytes from the CRC-32s of their pieces (zlib's ``crc32_combine``).

Python's zlib module computes a CRC-32 but does not expose ``crc32_combine``, and the engine
needs it wherever one CRC-32 is assembled from pieces computed apart: a payload's CRC computed
off the writer's thread (`fileio`, `container`), and a large file's CRC computed in segments on
several threads (`manifest_files`). Reading the bytes again to CRC them in order would cost as
much as the first pass; combining costs microseconds.

The algebra: a CRC-32 register is a vector over GF(2), and appending one zero bit to the
message is a linear map of it, a 32 x 32 matrix (stored as its 32 columns, one int each).
Appending n zero bytes is that matrix to the power 8n, built by repeated squaring. Then
``crc(A + B) = zeros(len(B)) applied to crc(A), XOR crc(B)`` (zlib's pre- and
post-conditioning cancel out in the XOR). `ZeroBytes` is that operator for one length, built
once and applied to any number of CRCs (the segments of a file, all the same length);
`crc32_combine` serves any length from the operators for the powers of two, built once.
"""

from __future__ import annotations

import functools

#: The reflected CRC-32 polynomial (zlib's, IEEE 802.3).
_POLYNOMIAL = 0xEDB88320

#: An operator on a CRC-32 register: its 32 columns (column n: the image of bit n).
Operator = tuple[int, ...]


def _apply(operator: Operator, vector: int) -> int:
    """`operator` times `vector` over GF(2): the XOR of the columns of the vector's set bits."""
    total, column = 0, 0
    while vector:
        if vector & 1:
            total ^= operator[column]
        vector >>= 1
        column += 1
    return total


def _compose(outer: Operator, inner: Operator) -> Operator:
    """The operator that applies `inner`, then `outer`."""
    return tuple(_apply(outer, column) for column in inner)


def _one_zero_byte() -> Operator:
    """The operator that appends one zero byte: one zero bit's, squared three times."""
    operator: Operator = (_POLYNOMIAL,) + tuple(1 << n for n in range(31))
    for _ in range(3):
        operator = _compose(operator, operator)
    return operator


@functools.cache
def _powers_of_two() -> tuple[Operator, ...]:
    """The operators that append 2**k zero bytes, k = 0..63 (built once, on first use)."""
    operators = [_one_zero_byte()]
    for _ in range(63):
        operators.append(_compose(operators[-1], operators[-1]))
    return tuple(operators)


class ZeroBytes:
    """The operator that appends `length` zero bytes to a CRC-32 register, built once (a few
    products of 32 x 32 matrices, about a millisecond) so that each `combine` of a piece of
    that length is one matrix-vector product (a few microseconds)."""

    __slots__ = ("length", "_operator")

    def __init__(self, length: int) -> None:
        if not 0 <= length < 1 << 64:
            raise ValueError(f"a length of zero bytes must be in [0, 2**64), got {length}")
        self.length = length
        operator: Operator | None = None  # None: the identity (no zero bytes)
        for k, power in enumerate(_powers_of_two()):
            if length >> k == 0:
                break
            if length >> k & 1:
                operator = power if operator is None else _compose(power, operator)
        self._operator = operator

    def combine(self, crc1: int, crc2: int) -> int:
        """The CRC-32 of A + B, from crc1 = crc32(A) and crc2 = crc32(B), B being `length`
        bytes long."""
        shifted = crc1 if self._operator is None else _apply(self._operator, crc1)
        return shifted ^ crc2


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B), as zlib's
    ``crc32_combine`` computes it: one matrix-vector product per set bit of `len2` (for many
    pieces of one length, `ZeroBytes` makes it one product in all)."""
    if not 0 <= len2 < 1 << 64:
        raise ValueError(f"a length must be in [0, 2**64), got {len2}")
    for power in _powers_of_two():
        if not len2:
            break
        if len2 & 1:
            crc1 = _apply(power, crc1)
        len2 >>= 1
    return crc1 ^ crc2


__all__ = ["ZeroBytes", "crc32_combine"]
