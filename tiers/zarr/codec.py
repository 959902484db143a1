"""Encoding a shard as the object Zarr stores: a chunk (data, padding to the chunk shape,
crc32c) or a pack shard (Zarr's ``sharding_indexed`` layout: inner chunks, each with its
crc32c, then the index of (offset, nbytes) pairs and its crc32c)."""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import crc32c
import numpy as np

from lazyckpt.tier import CorruptionError

_NO_CHUNK = 2**64 - 1  # a shard index entry for an inner chunk that was not written


@dataclass(frozen=True)
class _PackGeometry:
    """How the packed array cuts its bytes: shard objects of ``shard_bytes``, made of inner
    chunks of ``chunk_bytes``; ``lengths`` are the real bytes of each pack shard."""

    shard_bytes: int
    chunk_bytes: int
    lengths: tuple[int, ...]

    @property
    def chunks_per_shard(self) -> int:
        return self.shard_bytes // self.chunk_bytes


_zeros = bytes(1 << 20)


def _zero_bytes(n: int) -> memoryview:
    global _zeros
    if n > len(_zeros):
        _zeros = bytes(max(n, 2 * len(_zeros)))
    return memoryview(_zeros)[:n]


def _chunk_parts(data: memoryview, crc: int | None, chunk_bytes: int) -> list[memoryview]:
    """A chunk object as pieces: the data, zeros up to the full chunk shape (zarr stores edge
    chunks whole), and the crc32c of both, little-endian (zarr's crc32c codec)."""
    if crc is None:
        crc = crc32c.crc32c(data)
    parts = [data]
    pad = chunk_bytes - len(data)
    if pad:
        zeros = _zero_bytes(pad)
        crc = crc32c.crc32c(zeros, value=crc)
        parts.append(zeros)
    parts.append(memoryview(struct.pack("<I", crc)))
    return parts


def _join(parts: Iterable[memoryview]) -> np.ndarray[Any, np.dtype[np.uint8]]:
    chunks = list(parts)
    out = np.empty(sum(len(p) for p in chunks), dtype=np.uint8)
    at = 0
    for p in chunks:
        out[at : at + len(p)] = np.frombuffer(p, dtype=np.uint8)
        at += len(p)
    return out


def _encode_pack_shard(data: memoryview, geometry: _PackGeometry) -> np.ndarray[Any, Any]:
    """A pack shard as a zarr ``sharding_indexed`` object: inner chunks (data + crc32c), then
    the index of (offset, nbytes) pairs and its crc32c. Chunks past the data are left out."""
    c = geometry.chunk_bytes
    n = geometry.chunks_per_shard
    written = -(-len(data) // c)
    out = np.zeros(written * (c + 4) + n * 16 + 4, dtype=np.uint8)
    index = np.full(2 * n, _NO_CHUNK, dtype="<u8")
    src = np.frombuffer(data, dtype=np.uint8)
    for k in range(written):
        at = k * (c + 4)
        piece = src[k * c : (k + 1) * c]
        out[at : at + len(piece)] = piece
        crc = crc32c.crc32c(out[at : at + c].data)
        out[at + c : at + c + 4] = np.frombuffer(struct.pack("<I", crc), dtype=np.uint8)
        index[2 * k : 2 * k + 2] = (at, c + 4)
    raw_index = index.tobytes()
    tail = written * (c + 4)
    out[tail : tail + n * 16] = np.frombuffer(raw_index, dtype=np.uint8)
    out[tail + n * 16 :] = np.frombuffer(struct.pack("<I", crc32c.crc32c(raw_index)), np.uint8)
    return out


def _decode_pack_shard(blob: memoryview, out: memoryview, geometry: _PackGeometry) -> None:
    """Fill ``out`` from a stored pack shard; :class:`CorruptionError` on any inconsistency."""
    c, n = geometry.chunk_bytes, geometry.chunks_per_shard
    tail = len(blob) - (n * 16 + 4)
    if tail < 0:
        raise CorruptionError("shard object is shorter than its index")
    raw_index = blob[tail : tail + n * 16]
    (stored,) = struct.unpack("<I", blob[tail + n * 16 :])
    if crc32c.crc32c(raw_index) != stored:
        raise CorruptionError("shard index fails its checksum")
    index = np.frombuffer(raw_index, dtype="<u8").reshape(n, 2)
    dst = np.frombuffer(out, dtype=np.uint8)
    src = np.frombuffer(blob, dtype=np.uint8)
    for k in range(-(-len(out) // c)):
        offset, nbytes = (int(v) for v in index[k])
        lo, hi = k * c, min((k + 1) * c, len(out))
        if offset == _NO_CHUNK:
            raise CorruptionError(f"inner chunk {k} of the shard was never written")
        if nbytes != c + 4 or offset + nbytes > tail:
            raise CorruptionError(f"inner chunk {k} lies outside the shard object")
        dst[lo:hi] = src[offset : offset + hi - lo]
