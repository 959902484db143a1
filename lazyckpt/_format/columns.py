"""The column encoding of a manifest (format version 5).

The same document as the rows of ``lazyckpt._format.manifest``, with "tensors" and "shards" each an
object of parallel lists (docs/format.md lists them), written for states of many tensors:
there it is a fraction of the size and parses in a fraction of the time.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

import crc32c

from .._errors import CorruptionError
from .entries import _DIGEST, Mode, Segment, ShardMeta, TensorMeta, _decode_dist, _int
from .values import dtype_from_name
from .walk import JSON

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
# that no field is ever dropped on the way to disk (``_format.manifest._COLUMNS_HOLD_EVERY_FIELD``).
_COLUMN_FIELDS = {
    "Manifest": (
        "step", "tree", "tensors", "shards", "stream_bytes", "rank", "world_size", "created",
        "pickled", "extra", "metrics", "column_text",
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


class ColumnText:
    """The column text of one plan's tensors and shard layout, kept with the manifests made
    from that plan (``Manifest.with_checksums`` and the other ``with_`` methods hand it on),
    so that snapshots of an unchanged state encode their bulk once.

    Each text is kept with the tuple it was made from and used only for that very tuple (an
    ``is`` check), so a manifest built with other tensors or another layout never reads a
    stale text.
    """

    __slots__ = ("_segments", "_shards_text", "_tensors", "_tensors_text")

    def __init__(self) -> None:
        self._tensors: tuple[TensorMeta, ...] | None = None
        self._tensors_text = ""
        self._segments: tuple[tuple[Segment, ...], ...] | None = None
        self._shards_text = ""

    def __repr__(self) -> str:
        return "ColumnText()"

    def tensors(self, tensors: tuple[TensorMeta, ...]) -> str:
        """The "tensors" object for ``tensors``, encoded at most once per tuple."""
        if self._tensors is not tensors:
            self._tensors_text = _tensor_columns(tensors)
            self._tensors = tensors
        return self._tensors_text

    def shards(self, shards: tuple[ShardMeta, ...]) -> str:
        """The "shards" object for ``shards``: the layout encoded at most once per plan (the
        same segments tuples), the checksums, digests and references each time."""
        cached = self._segments
        if (
            cached is None
            or len(cached) != len(shards)
            or any(a is not b.segments for a, b in zip(cached, shards, strict=True))
        ):
            self._shards_text = _shard_layout(shards)
            self._segments = tuple(s.segments for s in shards)
        return _with_shard_values(self._shards_text, shards)



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
    return _dumps(doc)


def _shard_layout(shards: tuple[ShardMeta, ...]) -> str:
    """The plan's part of the "shards" object: everything but the checksums, digests and
    references (an object missing its closing brace's tail is completed by
    :func:`_with_shard_values`)."""
    segments = [g for s in shards for g in s.segments]
    return _dumps(
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


def _with_shard_values(layout: str, shards: tuple[ShardMeta, ...]) -> str:
    # the digests and references of an incremental snapshot change with every snapshot (and
    # are absent otherwise): sparse [index, value] entries after the checksums
    digests = [[s.index, s.digest] for s in shards if s.digest is not None]
    stored = [[s.index, s.stored_in] for s in shards if s.stored_in is not None]
    extra = ""
    if digests:
        extra += f',"digest":{_dumps(digests)}'
    if stored:
        extra += f',"stored_in":{_dumps(stored)}'
    return f'{layout[:-1]},"crc32c":{_dumps([s.crc32c for s in shards])}{extra}}}'


def _columns_json(
    scalars: dict[str, Any],
    tensors: tuple[TensorMeta, ...],
    shards: tuple[ShardMeta, ...],
    tree: JSON,
    text: ColumnText | None = None,
) -> bytes:
    """A manifest in the column encoding; ``scalars`` are its fields other than the tensors,
    the shards and the tree, in the order the rows write them (``Manifest._scalars``);
    ``text`` holds the plan's encoded parts (a fresh one encodes everything)."""
    if text is None:
        text = ColumnText()
    head = _dumps({"format": "lazyckpt", "format_version": _COLUMNS_VERSION, **scalars})
    # spliced rather than dumped as one object, so that the tensors' part (the bulk) is
    # encoded once per plan; the text is what json.dumps of the whole document would give
    body = "".join(
        (
            head[:-1],
            ',"tensors":',
            text.tensors(tensors),
            ',"shards":',
            text.shards(shards),
            ',"tree":',
            _dumps(tree),
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


def _decode_columns(doc: dict[str, Any]) -> tuple[tuple[TensorMeta, ...], tuple[ShardMeta, ...]]:
    """The tensors and shards of a manifest in the column encoding, checking what the row
    decoder checks; ``_format.manifest`` builds the manifest from them and the document's scalars."""
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
    return tuple(tensors), tuple(shards)
