"""Joining crc32c checksums: the checksum of ``a + b`` from the checksums of ``a`` and ``b``.

A shard read in pieces side by side, each piece checksummed by the thread that read it while
its bytes are still in the cache, needs the shard's checksum from the pieces' checksums
(:func:`crc32c_combine`). ``crc32c.crc32c(data, value)`` can only continue a checksum, in
order, which would make the pieces wait for each other.

The arithmetic: a crc32c (reflected, with the usual pre- and post-inversion) of ``a + b`` is
``crc(a) * x^(8 * len(b)) mod P  xor  crc(b)`` over GF(2); the inversions cancel. The power of
``x`` is built from the squares ``x^(2^k)`` (32 of them, computed once), and cached per length
(a restore combines pieces of a handful of lengths).
"""

from __future__ import annotations

import functools

__all__ = ["crc32c_combine"]

_POLY = 0x82F63B78  # the Castagnoli polynomial, bit-reflected
_ONE = 1 << 31  # the polynomial 1 in the reflected representation


def _multiply(a: int, b: int) -> int:
    """``a * b mod P``, both reflected."""
    product = 0
    bit = _ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _squares() -> tuple[int, ...]:
    """``x^(2^k) mod P`` for k = 0..31."""
    table = [_ONE >> 1]  # x^1
    for _ in range(31):
        table.append(_multiply(table[-1], table[-1]))
    return tuple(table)


_X_2K = _squares()


@functools.lru_cache(maxsize=64)
def _shift(nbytes: int) -> int:
    """``x^(8 * nbytes) mod P``: what appending ``nbytes`` bytes multiplies a crc by."""
    power = _ONE
    k = 3  # 8 * n = n * 2^3
    while nbytes:
        if nbytes & 1:
            power = _multiply(_X_2K[k % 32], power)
        nbytes >>= 1
        k += 1
    return power


def crc32c_combine(first: int, second: int, second_len: int) -> int:
    """The crc32c of ``a + b``, given ``first = crc32c(a)``, ``second = crc32c(b)`` and
    ``second_len = len(b)``."""
    if second_len == 0:
        return first
    return _multiply(_shift(second_len), first) ^ second
