"""The entries of a manifest (:class:`TensorMeta`, :class:`Segment`, :class:`ShardMeta`) and
the checks of their fields that both manifest encodings share.

What a segment's ``start:stop`` counts, by tensor mode, is defined on :class:`TensorMeta`
and nowhere else. ``lazyckpt._format.manifest`` builds the manifest from these entries and re-exports
them; the column encoding (``_format.columns``) builds them too, so they live below both.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch

from .._errors import CorruptionError
from .values import dtype_from_name

__all__ = ["Mode", "Segment", "ShardMeta", "TensorMeta"]

Mode = Literal["pack", "rows", "flat", "alias", "empty", "replica"]
_MODES = ("pack", "rows", "flat", "alias", "empty", "replica")
_DIGEST = re.compile(r"^[0-9a-f]{32}$")
_PLACEMENT = re.compile(r"^(replicate|shard\((\d{1,3})\))$")

@dataclass(frozen=True)
class TensorMeta:
    """One tensor of the state: where its bytes are."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    mode: Mode
    shards: tuple[int, ...] = ()
    chunk: int = 0
    offset: int = 0
    alias_of: int | None = None
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    placements: tuple[str, ...] | None = None
    writer: int | None = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    # What a segment's ``start:stop`` counts, by mode, is defined here and nowhere else:
    # whole rows along dimension 0 for ``rows``, flat elements for ``flat``, and for a
    # ``pack`` the elements of the whole tensor (always ``0:numel``).

    @property
    def unit_bytes(self) -> int:
        """Bytes per index of a segment's ``start:stop``: a row (``rows``), else an element."""
        if self.mode == "rows":
            return self.itemsize * math.prod(self.shape[1:])
        return self.itemsize

    def piece_shape(self, start: int, stop: int) -> tuple[int, ...]:
        """The shape of the piece ``start:stop`` of this tensor."""
        if self.mode == "rows":
            return (stop - start, *self.shape[1:])
        if self.mode == "flat":
            return (stop - start,)
        return self.shape

    def piece_of(self, tensor: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """The piece ``start:stop`` of ``tensor`` (this tensor, or one of its shape), as a
        view where ``tensor`` is contiguous (a flat piece of a non-contiguous tensor is a
        copy: write only into contiguous tensors)."""
        if self.mode == "rows":
            return tensor[start:stop]
        if self.mode == "flat":
            return tensor.reshape(-1)[start:stop]
        return tensor


@dataclass(frozen=True)
class Segment:
    """Part of one tensor inside a shard: rows (or flat elements, or the whole tensor for a
    pack) ``start:stop``, at byte ``offset`` of the shard."""

    tensor: int
    offset: int
    start: int
    stop: int


@dataclass(frozen=True)
class ShardMeta:
    """One shard: a window ``[offset, offset + length)`` of the snapshot's byte stream."""

    index: int
    offset: int
    length: int
    kind: Literal["pack", "chunk"]
    segments: tuple[Segment, ...]
    crc32c: int | None = None
    # incremental snapshots (docs/format.md): the 128-bit BLAKE2b digest of the shard's bytes
    # (hex), and the earlier step whose stored data holds those bytes at the same offset
    # (None: this step's own data)
    digest: str | None = None
    stored_in: int | None = None


def _int(doc: Any, key: str, *, minimum: int = 0) -> int:
    v = doc[key]
    if type(v) is not int or v < minimum:
        raise CorruptionError(f"field {key!r} must be an integer >= {minimum}, got {v!r:.40}")
    return v



def _indexes(values: Any, what: str) -> tuple[int, ...]:
    """A JSON list of non-negative integers, as a tuple."""
    found = tuple(values)
    for v in found:
        if type(v) is not int or v < 0:
            raise CorruptionError(f"{what}: {v!r:.40} is not an integer >= 0")
    return found


def _decode_dist(t: dict[str, Any], shape: tuple[int, ...]) -> dict[str, Any]:
    """The optional distributed fields of a tensor entry, validated."""
    found: dict[str, Any] = {}
    if "writer" in t:
        found["writer"] = _int(t, "writer")
    if "placements" not in t:
        return found
    gshape, goffset, placements = t["global_shape"], t["global_offset"], t["placements"]
    for dims in (gshape, goffset):
        if not isinstance(dims, list) or len(dims) != len(shape):
            raise CorruptionError(f"tensor {t['key']!r}: global shape/offset rank mismatch")
        if any(type(d) is not int or d < 0 for d in dims):
            raise CorruptionError(f"tensor {t['key']!r}: bad global shape/offset")
    if any(o + n > g for o, n, g in zip(goffset, shape, gshape, strict=True)):
        raise CorruptionError(f"tensor {t['key']!r}: its chunk lies outside the global tensor")
    if not isinstance(placements, list) or not 1 <= len(placements) <= 16:
        raise CorruptionError(f"tensor {t['key']!r}: bad placements {placements!r:.40}")
    for p in placements:
        m = _PLACEMENT.match(p) if isinstance(p, str) else None
        if m is None or (m.group(2) is not None and int(m.group(2)) >= len(shape)):
            raise CorruptionError(f"tensor {t['key']!r}: bad placement {p!r:.40}")
    found.update(
        global_shape=tuple(gshape), global_offset=tuple(goffset), placements=tuple(placements)
    )
    return found

