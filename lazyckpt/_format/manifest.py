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

Here: the layout planner, the :class:`Manifest` and its row encoding. The entries of a
manifest and the checks of their fields are in ``_format.entries``, the column encoding in
``_format.columns``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import crc32c
import torch

from .._errors import ConfigurationError, CorruptionError
from .._gcpause import collector_paused
from .columns import (
    _COLUMN_FIELDS,
    _COLUMNS_VERSION,
    ColumnText,
    _columns_json,
    _decode_columns,
)
from .entries import (
    _DIGEST,
    _MODES,
    Mode,
    Segment,
    ShardMeta,
    TensorMeta,
    _decode_dist,
    _indexes,
    _int,
)
from .values import dtype_from_name, dtype_name
from .walk import JSON, TensorRef

__all__ = [
    "COMPACT_TENSORS",
    "FORMAT_VERSION",
    "LayoutOptions",
    "Manifest",
    "check_metrics",
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
    # what the snapshot was passed in ``metrics=`` (finite floats by name), for retention's
    # keep_best; written only when there are some, so other manifests stay as they were
    metrics: dict[str, float] = field(default_factory=dict)
    # not part of the manifest: its plan's encoded column text, handed on by replace() to the
    # manifests made from this one (each text is checked against the tuple it encodes)
    column_text: ColumnText = field(
        default_factory=ColumnText, compare=False, repr=False, hash=False
    )

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
            return _columns_json(
                self._scalars(), self.tensors, self.shards, self.tree, self.column_text
            )
        doc = {
            "format": "lazyckpt",
            # the oldest version that can express it, so older readers keep reading
            # checkpoints that use nothing newer
            "format_version": self.format_version(),
            **self._scalars(),
            "tensors": [_tensor_doc(t) for t in self.tensors],
            "shards": [_shard_doc(s) for s in self.shards],
            "tree": self.tree,
        }
        body = json.dumps(doc, separators=(",", ":"), allow_nan=False)
        checksum = crc32c.crc32c(body.encode())
        # the document with "checksum" appended as its last key, without encoding it twice
        return (body[:-1] + f',"checksum":{checksum}}}').encode()

    def _scalars(self) -> dict[str, Any]:
        """The fields other than the tensors, the shards and the tree, in the order both
        encodings write them."""
        scalars = {
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "created": self.created,
            "stream_bytes": self.stream_bytes,
            "pickled": self.pickled,
            "extra": self.extra,
        }
        if self.metrics:  # absent otherwise: manifests without metrics stay byte for byte
            scalars["metrics"] = self.metrics
        return scalars

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
        return _manifest_of(doc, *_decode_columns(doc))
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
    manifest = _manifest_of(doc, tuple(tensors), tuple(shards))
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



def _manifest_of(
    doc: dict[str, Any], tensors: tuple[TensorMeta, ...], shards: tuple[ShardMeta, ...]
) -> Manifest:
    """The manifest of a decoded document (either encoding) with its tensors and shards."""
    return Manifest(
        step=_int(doc, "step"),
        rank=_int(doc, "rank"),
        world_size=_int(doc, "world_size", minimum=1),
        created=float(doc["created"]),
        stream_bytes=_int(doc, "stream_bytes"),
        pickled=bool(doc["pickled"]),
        extra=dict(doc["extra"]),
        metrics=_decode_metrics(doc.get("metrics", {})),
        tensors=tensors,
        shards=shards,
        tree=doc["tree"],
    )


def check_metrics(metrics: Any) -> dict[str, float]:
    """Metrics as a manifest keeps them: a dict of finite floats by non-empty string name
    (ints and other real numbers are turned into floats; bools are refused).

    Raises:
        ConfigurationError: ``metrics`` is not a mapping of that kind, naming what is wrong.
    """
    if not isinstance(metrics, Mapping):
        raise ConfigurationError(
            f"metrics must be a mapping of names to numbers, got {metrics!r:.80}"
        )
    checked: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ConfigurationError(
                f"metrics: a name must be a non-empty string, got {name!r:.80}"
            )
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigurationError(f"metrics: {name!r} must be a number, got {value!r:.80}")
        number = float(value)
        if not math.isfinite(number):
            raise ConfigurationError(f"metrics: {name!r} must be finite, got {number!r}")
        checked[name] = number
    return checked


def _decode_metrics(value: Any) -> dict[str, float]:
    """A manifest's ``metrics`` as read: finite floats by name, or :class:`CorruptionError`."""
    if not isinstance(value, dict) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in value.values()
    ):
        raise CorruptionError(f"bad metrics {value!r:.80}")
    try:
        return check_metrics(value)
    except ConfigurationError as exc:
        raise CorruptionError(str(exc)) from None


# Whether the column encoding spells out every field of the manifest's classes (see
# ``_format.columns._COLUMN_FIELDS``); if not, to_json writes the rows.
_COLUMNS_HOLD_EVERY_FIELD = all(
    tuple(f.name for f in dataclasses.fields(cls)) == _COLUMN_FIELDS[cls.__name__]
    for cls in (Manifest, TensorMeta, ShardMeta, Segment)
)


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


# Building a frozen dataclass runs ``object.__setattr__`` once per field: 1.5 us for a
# TensorMeta, most of a first plan's cost (a first snapshot's). plan_layout builds its
# entries with their ``__dict__`` set at once instead, about three times faster; the entries
# are the same (equal, hashed alike, still frozen). Only while the classes are what this
# code spells out: otherwise, the ordinary constructors.
_META_FIELDS = (
    "key", "dtype", "shape", "mode", "shards", "chunk", "offset", "alias_of",
    "global_shape", "global_offset", "placements", "writer",
)
_SEGMENT_FIELDS = ("tensor", "offset", "start", "stop")
_FAST_ENTRIES = all(
    tuple(f.name for f in dataclasses.fields(cls)) == names
    and "__slots__" not in vars(cls)
    and not hasattr(cls, "__post_init__")
    for cls, names in ((TensorMeta, _META_FIELDS), (Segment, _SEGMENT_FIELDS))
)
_new_entry = object.__new__
_set_attr = object.__setattr__


def _meta(
    key: str,
    dtype: str,
    shape: tuple[int, ...],
    mode: Mode,
    shards: tuple[int, ...] = (),
    *,
    chunk: int = 0,
    offset: int = 0,
    alias_of: int | None = None,
    writer: int | None = None,
) -> TensorMeta:
    """``TensorMeta(key, dtype, shape, mode, shards, chunk=..., ...)``, built faster."""
    if not _FAST_ENTRIES:
        return TensorMeta(
            key, dtype, shape, mode, shards, chunk=chunk, offset=offset, alias_of=alias_of,
            writer=writer,
        )
    meta: TensorMeta = _new_entry(TensorMeta)
    _set_attr(meta, "__dict__", {
        "key": key, "dtype": dtype, "shape": shape, "mode": mode, "shards": shards,
        "chunk": chunk, "offset": offset, "alias_of": alias_of, "global_shape": None,
        "global_offset": None, "placements": None, "writer": writer,
    })
    return meta


def _segment(tensor: int, offset: int, start: int, stop: int) -> Segment:
    """``Segment(tensor, offset, start, stop)``, built faster."""
    if not _FAST_ENTRIES:
        return Segment(tensor, offset, start, stop)
    seg: Segment = _new_entry(Segment)
    _set_attr(seg, "__dict__", {"tensor": tensor, "offset": offset, "start": start, "stop": stop})
    return seg


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
                metas[i] = _meta(key, dtype, shape, "pack", (index,), offset=offset)
            cursor = _align(cursor + pack_fill, SHARD_ALIGN)
        pack, pack_fill, pack_members = [], 0, []

    for i, ref in enumerate(refs):
        t = ref.tensor
        shape = tuple(t.shape)
        dtype = dtype_name(t.dtype)
        nbytes = t.numel() * t.element_size()
        if ref.alias_of is not None:
            metas.append(_meta(ref.key, dtype, shape, "alias", alias_of=ref.alias_of))
            continue
        if ref.dist is not None and ref.dist.writer not in (None, rank):
            metas.append(_meta(ref.key, dtype, shape, "replica", writer=ref.dist.writer))
            continue
        if nbytes == 0:
            metas.append(_meta(ref.key, dtype, shape, "empty"))
            continue
        if nbytes <= pack_bytes:
            offset = _align(pack_fill, PACK_ALIGN)
            if offset + nbytes > shard_size:
                close_pack()
                offset = 0
            numel = t.numel()
            pack.append(_segment(i, offset, 0, numel))
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
                ShardMeta(len(shards), cursor, length, "chunk", (_segment(i, 0, start, stop),))
            )
            cursor = _align(cursor + length, SHARD_ALIGN)
        metas.append(_meta(ref.key, dtype, shape, mode, tuple(indices), chunk=per))
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
