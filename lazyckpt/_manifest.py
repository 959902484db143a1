"""The snapshot layout (how tensors are cut into shards) and the manifest that records it.

Layout
------
A snapshot's tensor bytes form one logical *stream*. Each shard is a window of that stream
that starts on a 4 KiB boundary (so the same bytes can feed an O_DIRECT writer) and is at
most ``shard_size`` bytes long. A shard is either

- a *pack*: several small tensors (at most ``pack_bytes`` each) side by side, 64-byte
  aligned; or
- a *chunk* of one larger tensor: a run of whole rows along dimension 0 (``rows``), or, when a
  single row is larger than a shard, a run of flat elements (``flat``). Chunks of one tensor
  are equal in size but for the last, so a chunk is exactly a regular Zarr chunk.

A tensor of a distributed state (the local chunk of a DTensor, or a tensor marked
replicated) also records where it lies in the global tensor (``global_shape``,
``global_offset``, ``placements``). A replicated tensor is stored by one rank only (its
``writer``); the other ranks' manifests hold it in mode ``replica``, with no bytes.

A file tier writes the stream as it is (one data file per snapshot per rank); an object
store tier writes each shard as one object. Nothing in the layout depends on the tier.

Manifest
--------
JSON, never pickle: ``docs/format.md`` documents every field. :func:`Manifest.from_json`
validates everything it reads and raises :class:`CorruptionError` on any damage. Two
spellings of one document: *rows* (a JSON object per tensor and per shard; format versions
1 to 4) and *columns* (format version 5: one JSON list per field, the keys front-coded),
written for states of many tensors, where it is a fraction of the size and parses in a
fraction of the time (no object per tensor in the JSON, the checks run over whole lists).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import crc32c
import torch

from ._errors import ConfigurationError, CorruptionError
from ._gc import collector_paused
from ._tree import JSON, TensorRef, dtype_from_name, dtype_name

__all__ = [
    "COMPACT_TENSORS",
    "FORMAT_VERSION",
    "LayoutOptions",
    "Manifest",
    "Segment",
    "ShardMeta",
    "TensorMeta",
    "plan_layout",
]

# The newest this lazyckpt reads: 2 added the distributed fields, 3 the value-tree tags of
# trainer state (numpy arrays, generators, dataclasses), 4 the shards an incremental
# snapshot refers to in an earlier step's stored data (``stored_in``), 5 the column encoding.
FORMAT_VERSION = 5
# The column encoding (format version 5) is written for manifests of at least this many
# tensors; smaller ones keep the rows, which every earlier lazyckpt reads and a person can
# read, and which are only a few KiB there.
COMPACT_TENSORS = 256
# How those tags open in a compact JSON encoding; a string a user stored that holds this text
# is escaped (\") there, so it cannot be mistaken for one.
_V3_TAGS = tuple(
    f'{{"{tag}":'
    for tag in ("$ndarray", "$generator", "$np_generator", "$np_random_state", "$random", "$dataclass")
)
SHARD_ALIGN = 4096
PACK_ALIGN = 64

Mode = Literal["pack", "rows", "flat", "alias", "empty", "replica"]
_MODES = ("pack", "rows", "flat", "alias", "empty", "replica")
_DIGEST = re.compile(r"^[0-9a-f]{32}$")
_PLACEMENT = re.compile(r"^(replicate|shard\((\d{1,3})\))$")


@dataclass(frozen=True)
class LayoutOptions:
    """How tensors are cut into shards.

    Attributes:
        shard_size: the largest shard, in bytes (the unit of copying, of writing and of
            Zarr chunks). Larger shards mean fewer objects; smaller shards mean finer
            pipelining and less host memory held per shard.
        pack_bytes: tensors up to this size are packed together into shared shards.
    """

    shard_size: int = 16 << 20
    pack_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if self.shard_size < SHARD_ALIGN or self.shard_size % SHARD_ALIGN:
            raise ConfigurationError(
                f"shard_size must be a positive multiple of {SHARD_ALIGN}, got {self.shard_size}"
            )
        if not 0 <= self.pack_bytes <= self.shard_size:
            raise ConfigurationError(
                f"pack_bytes must be between 0 and shard_size ({self.shard_size}), "
                f"got {self.pack_bytes}"
            )


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


@dataclass(frozen=True)
class Manifest:
    """Everything needed to find, check and rebuild one snapshot (of one rank)."""

    step: int
    tree: JSON
    tensors: tuple[TensorMeta, ...]
    shards: tuple[ShardMeta, ...]
    stream_bytes: int
    rank: int = 0
    world_size: int = 1
    created: float = field(default_factory=time.time)
    pickled: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data (without alignment padding or aliases). O(tensors): a
        caller asking for it per snapshot of an unchanged state keeps it with its plan."""
        return sum(t.nbytes for t in self.tensors if t.alias_of is None)

    def with_checksums(self, crcs: Sequence[int]) -> Manifest:
        """The same manifest with every shard's crc32c filled in."""
        if len(crcs) != len(self.shards):
            raise ValueError("one checksum per shard")
        shards = tuple(replace(s, crc32c=c) for s, c in zip(self.shards, crcs, strict=True))
        return replace(self, shards=shards)

    def with_digests(self, digests: Sequence[str | None]) -> Manifest:
        """The same manifest with every shard's 128-bit digest filled in (incremental)."""
        if len(digests) != len(self.shards):
            raise ValueError("one digest per shard")
        shards = tuple(replace(s, digest=d) for s, d in zip(self.shards, digests, strict=True))
        return replace(self, shards=shards)

    def with_references(self, stored_in: dict[int, int]) -> Manifest:
        """The same manifest with shard ``i``'s bytes found in step ``stored_in[i]``'s data."""
        if not stored_in:
            return self
        shards = tuple(
            replace(s, stored_in=stored_in[s.index]) if s.index in stored_in else s
            for s in self.shards
        )
        return replace(self, shards=shards)

    def references(self) -> frozenset[int]:
        """The earlier steps whose stored data this step's shards are read from."""
        return frozenset(s.stored_in for s in self.shards if s.stored_in is not None)

    def self_contained(self) -> Manifest:
        """The same manifest with no references (for writing every byte elsewhere)."""
        if not self.references():
            return self
        return replace(self, shards=tuple(replace(s, stored_in=None) for s in self.shards))

    def segment_shape(self, seg: Segment) -> tuple[int, ...]:
        """The shape of the tensor piece a segment holds."""
        return self.tensors[seg.tensor].piece_shape(seg.start, seg.stop)

    def segment_nbytes(self, seg: Segment) -> int:
        """The bytes of the tensor piece a segment holds."""
        return math.prod(self.segment_shape(seg)) * self.tensors[seg.tensor].itemsize

    def segment_span(self, seg: Segment) -> tuple[int, int]:
        """Where a segment's bytes sit inside its whole tensor: ``(byte offset, length)``."""
        return seg.start * self.tensors[seg.tensor].unit_bytes, self.segment_nbytes(seg)

    def tensor_part(self, seg: Segment, tensor: torch.Tensor) -> torch.Tensor:
        """The part of ``tensor`` (the segment's whole tensor, or one of its shape) that the
        segment holds; see :meth:`TensorMeta.piece_of`."""
        return self.tensors[seg.tensor].piece_of(tensor, seg.start, seg.stop)

    def shard_part(self, seg: Segment, shard: torch.Tensor) -> torch.Tensor:
        """The segment's bytes inside its shard's bytes (a uint8 tensor of the shard's
        length), as a view of the tensor's dtype and the piece's shape."""
        meta = self.tensors[seg.tensor]
        piece = shard[seg.offset : seg.offset + self.segment_nbytes(seg)]
        return piece.view(meta.torch_dtype).view(meta.piece_shape(seg.start, seg.stop))

    def segment_gaps(self, shard: ShardMeta) -> list[tuple[int, int]]:
        """Byte ranges of ``shard`` that no segment covers (pack alignment, the tail): a
        writer zeroes them so that every byte of a shard is defined."""
        spans = sorted((seg.offset, seg.offset + self.segment_nbytes(seg)) for seg in shard.segments)
        gaps: list[tuple[int, int]] = []
        cursor = 0
        for lo, hi in spans:
            if lo > cursor:
                gaps.append((cursor, lo))
            cursor = max(cursor, hi)
        if cursor < shard.length:
            gaps.append((cursor, shard.length))
        return gaps

    def format_version(self) -> int:
        """The oldest format version that can express this manifest."""
        if any(s.stored_in is not None for s in self.shards):
            return 4  # an older reader would read the shard from this step's own data
        tree = json.dumps(self.tree, separators=(",", ":"), allow_nan=False)
        if any(tag in tree for tag in _V3_TAGS):
            return 3
        return 2 if any(t.placements for t in self.tensors) else 1

    # -- codec -------------------------------------------------------------------------

    def to_json(self, *, compact: bool | None = None) -> bytes:
        """Encode as UTF-8 JSON (stable key order).

        Args:
            compact: write the column encoding (format version 5) rather than the rows
                (versions 1 to 4). ``None``, the default, writes it for manifests of at
                least :data:`COMPACT_TENSORS` tensors, so that smaller ones stay readable by
                earlier lazyckpt versions.
        """
        if compact is None:
            compact = len(self.tensors) >= COMPACT_TENSORS
        if compact and _COLUMNS_HOLD_EVERY_FIELD:
            return _columns_json(self)
        doc = {
            "format": "lazyckpt",
            # the oldest version that can express it, so older readers keep reading
            # checkpoints that use nothing newer
            "format_version": self.format_version(),
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "created": self.created,
            "stream_bytes": self.stream_bytes,
            "pickled": self.pickled,
            "extra": self.extra,
            "tensors": [_tensor_doc(t) for t in self.tensors],
            "shards": [_shard_doc(s) for s in self.shards],
            "tree": self.tree,
        }
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False)
        checksum = crc32c.crc32c(body.encode())
        # the document with "checksum" appended as its last key, without encoding it twice
        return (body[:-1] + f',"checksum":{checksum}}}').encode()

    @classmethod
    def from_json(cls, data: bytes | str, *, source: str = "manifest") -> Manifest:
        """Decode and validate; any damage raises :class:`CorruptionError` naming ``source``."""
        raw = data.encode() if isinstance(data, str) else data
        try:
            # a large manifest parses into a few objects per tensor, none of them cyclic:
            # the collector would only rescan the process (see _gc.py)
            with collector_paused():
                doc = json.loads(raw)
                return _decode_manifest(doc, raw)
        except CorruptionError as exc:
            raise CorruptionError(f"{source}: {exc}") from exc
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise CorruptionError(f"{source} is damaged: {exc!r:.200}") from exc


def _shard_doc(s: ShardMeta) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "index": s.index,
        "offset": s.offset,
        "length": s.length,
        "kind": s.kind,
        "crc32c": s.crc32c,
        "segments": [[g.tensor, g.offset, g.start, g.stop] for g in s.segments],
    }
    # absent unless the snapshot is incremental: other manifests stay as they were
    if s.digest is not None:
        doc["digest"] = s.digest
    if s.stored_in is not None:
        doc["stored_in"] = s.stored_in
    return doc


def _tensor_doc(t: TensorMeta) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "key": t.key,
        "dtype": t.dtype,
        "shape": list(t.shape),
        "mode": t.mode,
        "shards": list(t.shards),
        "chunk": t.chunk,
        "offset": t.offset,
        "alias_of": t.alias_of,
    }
    if t.placements is not None:  # absent otherwise: plain manifests stay as they were
        assert t.global_shape is not None and t.global_offset is not None
        doc["global_shape"] = list(t.global_shape)
        doc["global_offset"] = list(t.global_offset)
        doc["placements"] = list(t.placements)
    if t.writer is not None:
        doc["writer"] = t.writer
    return doc


def _int(doc: Any, key: str, *, minimum: int = 0) -> int:
    v = doc[key]
    if type(v) is not int or v < minimum:
        raise CorruptionError(f"field {key!r} must be an integer >= {minimum}, got {v!r:.40}")
    return v


def _raw_checksum_ok(raw: bytes, checksum: Any) -> bool:
    """Whether ``raw`` is a body followed by ``,"checksum":N}`` whose crc32c is ``checksum``:
    the form :meth:`Manifest.to_json` writes, checked on the bytes as read (no re-encoding)."""
    cut = raw.rfind(b',"checksum":')
    if cut <= 0 or type(checksum) is not int or not raw.rstrip().endswith(b"}"):
        return False
    return crc32c.crc32c(b"}", value=crc32c.crc32c(memoryview(raw)[:cut])) == checksum


def _decode_manifest(doc: Any, raw: bytes | None = None) -> Manifest:
    if not isinstance(doc, dict) or doc.get("format") != "lazyckpt":
        raise CorruptionError("not a lazyckpt manifest")
    checksum = doc.pop("checksum", None)
    if raw is None or not _raw_checksum_ok(raw, checksum):
        # another encoder's spelling of the same document: check it as encoded here
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
        if checksum != crc32c.crc32c(body):
            raise CorruptionError("manifest checksum mismatch")
    version = _int(doc, "format_version", minimum=1)
    if version > FORMAT_VERSION:
        raise CorruptionError(
            f"manifest format {version} is newer than this lazyckpt ({FORMAT_VERSION}); upgrade"
        )
    if version >= _COLUMNS_VERSION:
        return _decode_columns(doc)
    tensors: list[TensorMeta] = []
    for t in doc["tensors"]:
        shape = tuple(t["shape"])
        if any(type(d) is not int or d < 0 for d in shape):
            raise CorruptionError(f"bad shape {shape!r:.60}")
        dtype_from_name(t["dtype"])
        if t["mode"] not in _MODES:
            raise CorruptionError(f"bad tensor mode {t['mode']!r:.20}")
        alias = t["alias_of"]
        if alias is not None and (type(alias) is not int or not 0 <= alias < len(tensors)):
            raise CorruptionError(f"bad alias {alias!r:.20}")
        if not isinstance(t["key"], str):
            raise CorruptionError("tensor key must be a string")
        tensors.append(
            TensorMeta(
                key=t["key"],
                dtype=t["dtype"],
                shape=shape,
                mode=t["mode"],
                shards=_indexes(t["shards"], "shards"),
                chunk=_int(t, "chunk"),
                offset=_int(t, "offset"),
                alias_of=alias,
                **_decode_dist(t, shape),
            )
        )
    shards = []
    stream = _int(doc, "stream_bytes")
    for i, s in enumerate(doc["shards"]):
        if _int(s, "index") != i:
            raise CorruptionError(f"shard {i} is out of order")
        crc = s["crc32c"]
        if crc is not None and (type(crc) is not int or not 0 <= crc < 2**32):
            raise CorruptionError(f"bad checksum {crc!r:.20}")
        if s["kind"] not in ("pack", "chunk"):
            raise CorruptionError(f"bad shard kind {s['kind']!r:.20}")
        segments = []
        for g in s["segments"]:
            tensor, offset, start, stop = _indexes(g, "segment")
            if tensor >= len(tensors) or stop < start:
                raise CorruptionError(f"bad segment {g!r:.60}")
            segments.append(Segment(tensor, offset, start, stop))
        digest = s.get("digest")
        if digest is not None and (not isinstance(digest, str) or not _DIGEST.match(digest)):
            raise CorruptionError(f"shard {i}: bad digest {digest!r:.40}")
        stored_in = _int(s, "stored_in") if "stored_in" in s else None
        if stored_in is not None and stored_in == doc["step"]:
            raise CorruptionError(f"shard {i} refers to its own step")
        shard = ShardMeta(
            index=i,
            offset=_int(s, "offset"),
            length=_int(s, "length"),
            kind=s["kind"],
            segments=tuple(segments),
            crc32c=crc,
            digest=digest,
            stored_in=stored_in,
        )
        if shard.offset + shard.length > stream:
            raise CorruptionError(f"shard {i} lies outside the stream")
        shards.append(shard)
    manifest = Manifest(
        step=_int(doc, "step"),
        rank=_int(doc, "rank"),
        world_size=_int(doc, "world_size", minimum=1),
        created=float(doc["created"]),
        stream_bytes=stream,
        pickled=bool(doc["pickled"]),
        extra=dict(doc["extra"]),
        tensors=tuple(tensors),
        shards=tuple(shards),
        tree=doc["tree"],
    )
    for t in manifest.tensors:
        if any(s >= len(shards) for s in t.shards):
            raise CorruptionError(f"tensor {t.key!r} names a missing shard")
        if (t.mode == "replica") != (t.writer is not None) or (
            t.writer is not None and (t.writer >= manifest.world_size or t.writer == manifest.rank)
        ):
            raise CorruptionError(f"tensor {t.key!r}: bad replica writer {t.writer!r}")
    # bytes per unit of a segment's start:stop, per tensor, looked up once per tensor (a
    # pack segment holds the whole tensor): Manifest.segment_nbytes without its per-call cost
    units: dict[int, int] = {}
    for s in manifest.shards:
        for g in s.segments:
            unit = units.get(g.tensor)
            if unit is None:
                meta = manifest.tensors[g.tensor]
                # negative for a pack: the segment's size does not depend on start:stop
                unit = -meta.nbytes if meta.mode == "pack" else meta.unit_bytes
                units[g.tensor] = unit
            nbytes = -unit if unit < 0 else (g.stop - g.start) * unit
            if g.offset + nbytes > s.length:
                raise CorruptionError(f"shard {s.index}: a segment overruns the shard")
    return manifest


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
    if not isinstance(placements, list) or len(placements) != 1:
        raise CorruptionError(f"tensor {t['key']!r}: bad placements {placements!r:.40}")
    for p in placements:
        m = _PLACEMENT.match(p) if isinstance(p, str) else None
        if m is None or (m.group(2) is not None and int(m.group(2)) >= len(shape)):
            raise CorruptionError(f"tensor {t['key']!r}: bad placement {p!r:.40}")
    found.update(
        global_shape=tuple(gshape), global_offset=tuple(goffset), placements=tuple(placements)
    )
    return found


# -- the column encoding (format version 5) ----------------------------------------------------
#
# The same document as the rows, with "tensors" and "shards" each an object of parallel
# lists (docs/format.md lists them). Lists of small integers are a few bytes an entry and
# json parses them in C; positions that mostly grow by a constant (offsets in a pack, shard
# and tensor indices) are stored as differences from the previous entry, and each key as the
# number of leading characters it shares with the previous key plus the rest.

_COLUMNS_VERSION = 5
_MODE_LETTERS = {"pack": "p", "rows": "r", "flat": "f", "alias": "a", "empty": "e", "replica": "x"}
_LETTER_MODES: dict[str, Mode] = {v: k for k, v in _MODE_LETTERS.items()}  # type: ignore[misc]
_KIND_LETTERS = {"pack": "p", "chunk": "c"}
_LETTER_KINDS: dict[str, Literal["pack", "chunk"]] = {"p": "pack", "c": "chunk"}

# The fields the columns spell out. A field added to one of these classes that the columns do
# not know yet makes to_json write the rows (which carry it) until the columns learn it, so
# that no field is ever dropped on the way to disk.
_COLUMN_FIELDS = {
    "Manifest": (
        "step", "tree", "tensors", "shards", "stream_bytes", "rank", "world_size", "created",
        "pickled", "extra",
    ),
    "TensorMeta": (
        "key", "dtype", "shape", "mode", "shards", "chunk", "offset", "alias_of",
        "global_shape", "global_offset", "placements", "writer",
    ),
    "ShardMeta": (
        "index", "offset", "length", "kind", "segments", "crc32c", "digest", "stored_in"
    ),
    "Segment": ("tensor", "offset", "start", "stop"),
}
_COLUMNS_HOLD_EVERY_FIELD = all(
    tuple(f.name for f in dataclasses.fields(cls)) == _COLUMN_FIELDS[cls.__name__]
    for cls in (Manifest, TensorMeta, ShardMeta, Segment)
)

# The encoded "tensors" object of the last few plans, by the identity of their tensors tuple
# (snapshots of an unchanged state share it): the tuple is kept so the id stays its own.
_TENSOR_COLUMNS: dict[int, tuple[tuple[TensorMeta, ...], str]] = {}
# The same for the shards' layout, by (offset, length, kind, id of segments) per shard.
_SHARD_COLUMNS: dict[tuple[Any, ...], tuple[tuple[tuple[Segment, ...], ...], str]] = {}


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), allow_nan=False)


def _deltas(values: Sequence[int]) -> list[int]:
    return [b - a for a, b in zip(itertools.chain((0,), values), values, strict=False)]


def _shared_prefix(a: str, b: str) -> int:
    """How many leading characters ``a`` and ``b`` share (a binary search over slices, which
    compare in C)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _tensor_columns(tensors: tuple[TensorMeta, ...]) -> str:
    hit = _TENSOR_COLUMNS.get(id(tensors))
    if hit is not None and hit[0] is tensors:
        return hit[1]
    shared: list[int] = []
    rest: list[str] = []
    previous = ""
    for t in tensors:
        n = _shared_prefix(previous, t.key)
        shared.append(n)
        rest.append(t.key[n:])
        previous = t.key
    dtypes: dict[str, int] = {}
    shards = [s for t in tensors for s in t.shards]
    doc = {
        "count": len(tensors),
        "key_shared": shared,
        "key_rest": rest,
        "dtype": [dtypes.setdefault(t.dtype, len(dtypes)) for t in tensors],
        "dtypes": list(dtypes),
        "mode": "".join([_MODE_LETTERS[t.mode] for t in tensors]),
        "ndim": [len(t.shape) for t in tensors],
        "dims": [d for t in tensors for d in t.shape],
        "nshards": [len(t.shards) for t in tensors],
        "shards": _deltas(shards),
        "chunk": [t.chunk for t in tensors],
        "offset": _deltas([t.offset for t in tensors]),
        "alias_of": [[i, t.alias_of] for i, t in enumerate(tensors) if t.alias_of is not None],
        "dist": [
            [i, list(t.global_shape or ()), list(t.global_offset or ()), list(t.placements)]
            for i, t in enumerate(tensors)
            if t.placements is not None
        ],
        "writer": [[i, t.writer] for i, t in enumerate(tensors) if t.writer is not None],
    }
    text = _dumps(doc)
    if len(_TENSOR_COLUMNS) >= 4:
        _TENSOR_COLUMNS.clear()
    _TENSOR_COLUMNS[id(tensors)] = (tensors, text)
    return text


def _shard_columns(shards: tuple[ShardMeta, ...]) -> str:
    # everything but the checksums is the plan's: encoded once per plan (with_checksums
    # keeps each shard's segments tuple), the checksums appended
    layout = tuple((s.offset, s.length, s.kind, id(s.segments)) for s in shards)
    hit = _SHARD_COLUMNS.get(layout)
    if hit is None or any(a is not b.segments for a, b in zip(hit[0], shards, strict=True)):
        segments = [g for s in shards for g in s.segments]
        text = _dumps(
            {
                "count": len(shards),
                "offset": [s.offset for s in shards],
                "length": [s.length for s in shards],
                "kind": "".join([_KIND_LETTERS[s.kind] for s in shards]),
                "nsegments": [len(s.segments) for s in shards],
                "segment_tensor": _deltas([g.tensor for g in segments]),
                "segment_offset": _deltas([g.offset for g in segments]),
                "segment_start": [g.start for g in segments],
                "segment_length": [g.stop - g.start for g in segments],
            }
        )
        if len(_SHARD_COLUMNS) >= 4:
            _SHARD_COLUMNS.clear()
        hit = _SHARD_COLUMNS[layout] = (tuple(s.segments for s in shards), text)
    # the digests and references of an incremental snapshot change with every snapshot (and
    # are absent otherwise): sparse [index, value] entries after the checksums
    digests = [[s.index, s.digest] for s in shards if s.digest is not None]
    stored = [[s.index, s.stored_in] for s in shards if s.stored_in is not None]
    extra = ""
    if digests:
        extra += f',"digest":{_dumps(digests)}'
    if stored:
        extra += f',"stored_in":{_dumps(stored)}'
    return f'{hit[1][:-1]},"crc32c":{_dumps([s.crc32c for s in shards])}{extra}}}'


def _columns_json(m: Manifest) -> bytes:
    head = _dumps(
        {
            "format": "lazyckpt",
            "format_version": _COLUMNS_VERSION,
            "step": m.step,
            "rank": m.rank,
            "world_size": m.world_size,
            "created": m.created,
            "stream_bytes": m.stream_bytes,
            "pickled": m.pickled,
            "extra": m.extra,
        }
    )
    # spliced rather than dumped as one object, so that the tensors' part (the bulk) is
    # encoded once per plan; the text is what json.dumps of the whole document would give
    body = "".join(
        (
            head[:-1],
            ',"tensors":',
            _tensor_columns(m.tensors),
            ',"shards":',
            _shard_columns(m.shards),
            ',"tree":',
            _dumps(m.tree),
            "}",
        )
    )
    checksum = crc32c.crc32c(body.encode())
    return (body[:-1] + f',"checksum":{checksum}}}').encode()


def _column(doc: dict[str, Any], name: str, length: int, *, minimum: int | None = 0) -> list[int]:
    """``doc[name]``: a list of ``length`` integers, each at least ``minimum`` (if given)."""
    values = doc[name]
    if type(values) is not list or len(values) != length:
        raise CorruptionError(f"column {name!r} must be a list of {length} integers")
    if values:
        if not set(map(type, values)) <= {int}:
            raise CorruptionError(f"column {name!r} holds a value that is not an integer")
        if minimum is not None and min(values) < minimum:
            raise CorruptionError(f"column {name!r} holds a value below {minimum}")
    return values


def _positions(doc: dict[str, Any], name: str, length: int) -> list[int]:
    """A column of differences, summed back into the non-negative values it encodes."""
    values = list(itertools.accumulate(_column(doc, name, length, minimum=None)))
    if values and min(values) < 0:
        raise CorruptionError(f"column {name!r} encodes a negative position")
    return values


def _letters(doc: dict[str, Any], name: str, length: int, allowed: dict[str, Any]) -> str:
    value = doc[name]
    if type(value) is not str or len(value) != length or not set(value) <= allowed.keys():
        raise CorruptionError(f"column {name!r} must be {length} letters of {sorted(allowed)}")
    return value


def _pairs(doc: dict[str, Any], name: str, count: int) -> list[list[Any]]:
    """A sparse column: ``[index, value...]`` entries with distinct indexes below ``count``."""
    entries = doc[name]
    if type(entries) is not list or any(type(e) is not list or len(e) < 2 for e in entries):
        raise CorruptionError(f"column {name!r} must be a list of [index, value] entries")
    indexes = [e[0] for e in entries]
    if not set(map(type, indexes)) <= {int} or len(set(indexes)) != len(indexes) or (
        indexes and not 0 <= min(indexes) <= max(indexes) < count
    ):
        raise CorruptionError(f"column {name!r} names a tensor that does not exist")
    return entries


def _decode_columns(doc: dict[str, Any]) -> Manifest:
    """Rebuild a manifest from the column encoding, checking what the row decoder checks."""
    cols, scols = doc["tensors"], doc["shards"]
    if type(cols) is not dict or type(scols) is not dict:
        raise CorruptionError("format 5 keeps 'tensors' and 'shards' as objects of columns")
    n, nshards = _int(cols, "count"), _int(scols, "count")
    stream, rank, world_size = (
        _int(doc, "stream_bytes"), _int(doc, "rank"), _int(doc, "world_size", minimum=1)
    )

    shared = _column(cols, "key_shared", n)
    rest = cols["key_rest"]
    if type(rest) is not list or len(rest) != n or not set(map(type, rest)) <= {str}:
        raise CorruptionError(f"column 'key_rest' must be a list of {n} strings")
    keys: list[str] = []
    previous = ""
    for count, tail in zip(shared, rest, strict=True):
        if count > len(previous):
            raise CorruptionError(f"tensor {len(keys)}: its key shares more than the last one has")
        previous = previous[:count] + tail
        keys.append(previous)

    names = cols["dtypes"]
    if type(names) is not list:
        raise CorruptionError("column 'dtypes' must be a list of dtype names")
    itemsizes = [dtype_from_name(name).itemsize for name in names]
    dtype_index = _column(cols, "dtype", n)
    if dtype_index and max(dtype_index) >= len(names):
        raise CorruptionError("column 'dtype' names a dtype that 'dtypes' does not list")
    modes = [_LETTER_MODES[c] for c in _letters(cols, "mode", n, _LETTER_MODES)]

    ndim = _column(cols, "ndim", n)
    dims = _column(cols, "dims", sum(ndim))
    nshards_of = _column(cols, "nshards", n)
    shard_ids = _positions(cols, "shards", sum(nshards_of))
    if shard_ids and max(shard_ids) >= nshards:
        raise CorruptionError("a tensor names a missing shard")
    chunks = _column(cols, "chunk", n)
    offsets = _positions(cols, "offset", n)

    aliases: list[int | None] = [None] * n
    for i, j, *_ in _pairs(cols, "alias_of", n):
        if type(j) is not int or not 0 <= j < i:
            raise CorruptionError(f"bad alias {j!r:.20}")
        aliases[i] = j
    writers: list[int | None] = [None] * n
    for i, w, *_ in _pairs(cols, "writer", n):
        if type(w) is not int or w < 0:
            raise CorruptionError(f"tensor {keys[i]!r}: bad replica writer {w!r:.20}")
        writers[i] = w

    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}  # one tuple per distinct shape
    tensors: list[TensorMeta] = []
    # bytes per unit of a segment's start:stop, per tensor (negative: a pack segment holds
    # the whole tensor), as the row decoder computes them
    units: list[int] = []
    at = sat = 0
    for i in range(n):
        k, d, mode = ndim[i], dtype_index[i], modes[i]
        shape = tuple(dims[at : at + k])
        shape = shapes.setdefault(shape, shape)
        at += k
        held = tuple(shard_ids[sat : sat + nshards_of[i]])
        sat += nshards_of[i]
        tensors.append(
            TensorMeta(
                keys[i], names[d], shape, mode, held, chunks[i], offsets[i], aliases[i],
                writer=writers[i],
            )
        )
        if mode == "pack":
            units.append(-math.prod(shape) * itemsizes[d])
        elif mode == "rows":
            units.append(math.prod(shape[1:]) * itemsizes[d])
        else:
            units.append(itemsizes[d])
    for entry in _pairs(cols, "dist", n):
        if len(entry) != 4:
            raise CorruptionError("column 'dist' entries are [index, shape, offset, placements]")
        i, gshape, goffset, placements = entry
        meta = tensors[i]
        found = _decode_dist(
            {
                "key": meta.key,
                "global_shape": gshape,
                "global_offset": goffset,
                "placements": placements,
            },
            meta.shape,
        )
        tensors[i] = replace(meta, **found)
    replicas = [i for i, letter in enumerate(cols["mode"]) if letter == "x"]
    if replicas != sorted(e[0] for e in cols["writer"]):
        raise CorruptionError("the tensors of mode replica and those with a writer differ")
    for i in replicas:
        meta = tensors[i]
        if meta.writer is None or meta.writer >= world_size or meta.writer == rank:
            raise CorruptionError(f"tensor {meta.key!r}: bad replica writer {meta.writer!r}")

    starts = _column(scols, "offset", nshards)
    lengths = _column(scols, "length", nshards)
    kinds = _letters(scols, "kind", nshards, _LETTER_KINDS)
    crcs = scols["crc32c"]
    if type(crcs) is not list or len(crcs) != nshards or any(
        c is not None and (type(c) is not int or not 0 <= c < 2**32) for c in crcs
    ):
        raise CorruptionError("column 'crc32c' must hold a 32-bit checksum or null per shard")
    nsegments = _column(scols, "nsegments", nshards)
    total = sum(nsegments)
    seg_tensor = _positions(scols, "segment_tensor", total)
    if seg_tensor and max(seg_tensor) >= n:
        raise CorruptionError("a segment names a tensor that does not exist")
    seg_offset = _positions(scols, "segment_offset", total)
    seg_start = _column(scols, "segment_start", total)
    seg_length = _column(scols, "segment_length", total)

    digests: list[str | None] = [None] * nshards
    for j, digest, *_ in _pairs(scols, "digest", nshards) if "digest" in scols else ():
        if not isinstance(digest, str) or not _DIGEST.match(digest):
            raise CorruptionError(f"shard {j}: bad digest {digest!r:.40}")
        digests[j] = digest
    stored_in: list[int | None] = [None] * nshards
    for j, where, *_ in _pairs(scols, "stored_in", nshards) if "stored_in" in scols else ():
        if type(where) is not int or where < 0:
            raise CorruptionError(f"shard {j}: bad stored_in {where!r:.20}")
        if where == doc["step"]:
            raise CorruptionError(f"shard {j} refers to its own step")
        stored_in[j] = where

    shards: list[ShardMeta] = []
    at = 0
    for j in range(nshards):
        if starts[j] + lengths[j] > stream:
            raise CorruptionError(f"shard {j} lies outside the stream")
        segments = []
        length = lengths[j]
        for k in range(at, at + nsegments[j]):
            tensor, offset, start, count = seg_tensor[k], seg_offset[k], seg_start[k], seg_length[k]
            unit = units[tensor]
            if offset + (-unit if unit < 0 else count * unit) > length:
                raise CorruptionError(f"shard {j}: a segment overruns the shard")
            segments.append(Segment(tensor, offset, start, start + count))
        at += nsegments[j]
        shards.append(
            ShardMeta(
                j, starts[j], lengths[j], _LETTER_KINDS[kinds[j]], tuple(segments), crcs[j],
                digests[j], stored_in[j],
            )
        )
    return Manifest(
        step=_int(doc, "step"),
        rank=rank,
        world_size=world_size,
        created=float(doc["created"]),
        stream_bytes=stream,
        pickled=bool(doc["pickled"]),
        extra=dict(doc["extra"]),
        tensors=tuple(tensors),
        shards=tuple(shards),
        tree=doc["tree"],
    )


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def plan_layout(
    step: int,
    tree: JSON,
    refs: Sequence[TensorRef],
    options: LayoutOptions,
    *,
    pickled: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> Manifest:
    """Cut the tensors of a walked state into shards (see the module docstring).

    Costs O(number of tensors); reads no tensor data.
    """
    shard_size, pack_bytes = options.shard_size, options.pack_bytes
    metas: list[TensorMeta | None] = []
    shards: list[ShardMeta] = []
    cursor = 0  # end of the stream so far
    pack: list[Segment] = []
    pack_fill = 0
    # packed tensors get their TensorMeta once their shard's index is known
    pack_members: list[tuple[int, str, str, tuple[int, ...], int]] = []

    def close_pack() -> None:
        nonlocal cursor, pack, pack_fill, pack_members
        if pack:
            index = len(shards)
            shards.append(ShardMeta(index, cursor, pack_fill, "pack", tuple(pack)))
            for i, key, dtype, shape, offset in pack_members:
                metas[i] = TensorMeta(key, dtype, shape, "pack", (index,), offset=offset)
            cursor = _align(cursor + pack_fill, SHARD_ALIGN)
        pack, pack_fill, pack_members = [], 0, []

    for i, ref in enumerate(refs):
        t = ref.tensor
        shape = tuple(t.shape)
        dtype = dtype_name(t.dtype)
        nbytes = t.numel() * t.element_size()
        if ref.alias_of is not None:
            metas.append(TensorMeta(ref.key, dtype, shape, "alias", alias_of=ref.alias_of))
            continue
        if ref.dist is not None and ref.dist.writer not in (None, rank):
            metas.append(TensorMeta(ref.key, dtype, shape, "replica", writer=ref.dist.writer))
            continue
        if nbytes == 0:
            metas.append(TensorMeta(ref.key, dtype, shape, "empty"))
            continue
        if nbytes <= pack_bytes:
            offset = _align(pack_fill, PACK_ALIGN)
            if offset + nbytes > shard_size:
                close_pack()
                offset = 0
            numel = t.numel()
            pack.append(Segment(i, offset, 0, numel))
            pack_fill = offset + nbytes
            pack_members.append((i, ref.key, dtype, shape, offset))
            metas.append(None)
            continue
        row_bytes = nbytes // shape[0] if t.dim() >= 1 and shape[0] > 0 else nbytes
        if t.dim() >= 1 and row_bytes <= shard_size:
            rows = shape[0]
            nchunks = math.ceil(nbytes / shard_size)
            while math.ceil(rows / nchunks) * row_bytes > shard_size:
                nchunks += 1
            per = math.ceil(rows / nchunks)
            mode: Mode = "rows"
            total, unit = rows, row_bytes
        else:
            per = shard_size // t.element_size()
            mode = "flat"
            total, unit = t.numel(), t.element_size()
        indices = []
        for start in range(0, total, per):
            stop = min(start + per, total)
            length = (stop - start) * unit
            indices.append(len(shards))
            shards.append(
                ShardMeta(len(shards), cursor, length, "chunk", (Segment(i, 0, start, stop),))
            )
            cursor = _align(cursor + length, SHARD_ALIGN)
        metas.append(TensorMeta(ref.key, dtype, shape, mode, tuple(indices), chunk=per))
    close_pack()
    done: list[TensorMeta] = []
    for meta in metas:
        assert meta is not None  # every packed tensor got its meta in close_pack
        done.append(meta)
    for i, ref in enumerate(refs):
        if ref.dist is not None:
            done[i] = replace(
                done[i],
                global_shape=ref.dist.global_shape,
                global_offset=ref.dist.global_offset,
                placements=ref.dist.placements,
            )
    return Manifest(
        step=step,
        tree=tree,
        tensors=tuple(done),
        shards=tuple(shards),
        stream_bytes=cursor,
        rank=rank,
        world_size=world_size,
        pickled=pickled,
    )
