"""Where a snapshot lives in a Zarr store, and the metadata documents written by hand.

Names and prefixes of step and rank groups, the plan of a snapshot (which object holds
which shard) and the ``zarr.json`` documents of its arrays, groups and packed array; no
I/O. The documents are written by hand rather than through zarr so that ``begin`` is one
batch of small writes and plain zarr reads them as its own.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lazyckpt.tier import FORMAT_VERSION, CorruptionError, Manifest, TensorMeta

from .codec import _PackGeometry
from .dtype import _bytes_codec, _fill_value, storage_dtype

# a step's group: ``step-NNNNNNNNNNNN``, or on S3 ``step-NNNNNNNNNNNN-<writer token>`` (the
# objects of one writer incarnation, which no other incarnation ever names; docs/zarr.md)
_STEP_GROUP = re.compile(r"^step-(\d{12})(?:-([0-9a-f]{16}))?$")
_PART_GROUP = re.compile(r"^rank-\d{5}$")
_STEP_CHILDREN = {"zarr.json", "tensors", "packed"}  # besides rank parts: all a step group holds
_OURS_AT_ROOT = re.compile(r"^\.lazyckpt-(writer-rank-\d{5}\.(lock|json)|probe-[0-9a-f]{16})$")  # locks, leases, probes
_MAX_NAME = 200  # bytes: file systems allow 255 per component, temporary names need a few


def node_name(component: str) -> str:
    """One component of a state-dict key as a Zarr node name that cannot escape its group.

    Bytes outside ``[A-Za-z0-9._-]`` are percent-encoded (``%`` too, so the mapping is
    one-to-one), and so are a leading ``.`` (``.``, ``..``, hidden files, zarr v2's
    ``.zarray``), the first ``_`` of a ``__`` prefix (reserved by the Zarr v3 spec) and the
    ``.`` of ``zarr.json`` (a node's own metadata key); the empty name becomes ``%``. A name
    still longer than 200 bytes is cut and suffixed with ``~`` and a hash (``~`` never occurs
    otherwise).
    """
    if not component:
        return "%"
    out = []
    for i, byte in enumerate(component.encode()):
        ch = chr(byte)
        literal = (ch.isascii() and ch.isalnum()) or ch in "._-"
        if i == 0 and (ch == "." or (ch == "_" and component.startswith("__"))):
            literal = False
        out.append(ch if literal else f"%{byte:02X}")
    name = "".join(out)
    if name == "zarr.json":
        name = "zarr%2Ejson"
    if len(name) > _MAX_NAME:
        digest = hashlib.sha256(component.encode()).hexdigest()[:32]
        name = f"{name[: _MAX_NAME - 33]}~{digest}"
    return name


def _json(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _group_doc(attributes: dict[str, Any] | None = None) -> bytes:
    return _json({"zarr_format": 3, "node_type": "group", "attributes": attributes or {}})


def _step_prefix(step: int, token: str | None = None) -> str:
    """The group of ``step``: the plain name, or the one of writer incarnation ``token``."""
    return f"step-{step:012d}" if token is None else f"step-{step:012d}-{token}"


def _rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def _part_prefix(step: int, rank: int, world_size: int, group: str | None = None) -> str:
    """Where one rank's part of a snapshot lives: the step's group itself for a snapshot of
    one rank (the layout of every earlier version), ``step-.../rank-NNNNN`` otherwise.
    ``group`` is the step's group when it is not the plain name (see :func:`_step_prefix`)."""
    group = group or _step_prefix(step)
    if world_size == 1:
        return group
    return f"{group}/{_rank_name(rank)}"


# -- the plan of a snapshot: which object holds which shard ------------------------------------


@dataclass(frozen=True)
class _ChunkTarget:
    """A chunk shard: one chunk object of one tensor's array."""

    key: str
    chunk_bytes: int  # the stored chunk, padded to the full chunk shape, without the crc


@dataclass(frozen=True)
class _PackTarget:
    """A pack shard: one shard object of the packed array."""

    key: str
    slot: int


@dataclass
class _Plan:
    """Where each shard and tensor of one snapshot lives in the store."""

    manifest: Manifest
    prefix: str
    targets: list[_ChunkTarget | _PackTarget]
    arrays: dict[str, str]  # tensor key -> array path relative to the snapshot group
    pack: _PackGeometry | None
    # incremental snapshots: pack slots whose shard is stored with an earlier step, as
    # (that step's packed array, from the store's root; the slot's offset in it)
    external: dict[int, tuple[str, int]] = field(default_factory=dict)


def _chunk_shape(meta: TensorMeta) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The stored array's shape and chunk shape."""
    if meta.mode == "rows":
        return meta.shape, (meta.chunk, *meta.shape[1:])
    if meta.mode == "flat":
        if not meta.shape:
            return (), ()
        return (meta.numel,), (meta.chunk,)
    return meta.shape, tuple(max(1, d) for d in meta.shape)  # empty: no chunk is ever written


def _chunk_key(meta: TensorMeta, i: int) -> str:
    if meta.mode == "flat" and not meta.shape:
        return "c"
    ndim = len(meta.shape) if meta.mode == "rows" else 1
    return "/".join(["c", str(i), *(["0"] * (ndim - 1))])


def plan_snapshot(manifest: Manifest, pack_chunk_bytes: int, group: str | None = None) -> _Plan:
    """Map every tensor and shard of ``manifest`` to Zarr arrays and objects (no I/O), in
    the step's group ``group`` (the plain name by default)."""
    prefix = _part_prefix(manifest.step, manifest.rank, manifest.world_size, group)
    paths: dict[int, str] = {}
    targets: list[_ChunkTarget | _PackTarget | None] = [None] * len(manifest.shards)
    for t, meta in enumerate(manifest.tensors):
        if meta.mode in ("rows", "flat", "empty"):
            paths[t] = "tensors/" + "/".join(node_name(c) for c in meta.key.split("/"))
    for shard in manifest.shards:
        if shard.kind != "chunk":
            continue
        if len(shard.segments) != 1:
            raise CorruptionError(f"chunk shard {shard.index} holds {len(shard.segments)} pieces")
        (seg,) = shard.segments
        meta = manifest.tensors[seg.tensor]
        i = seg.start // meta.chunk if meta.chunk else -1  # the chunk's index in its array
        if (
            meta.mode not in ("rows", "flat")
            or not 0 <= i < len(meta.shards)
            or meta.shards[i] != shard.index
            or seg.start != i * meta.chunk
        ):
            raise CorruptionError(f"shard {shard.index} is not a chunk of {meta.key!r}")
        if shard.length != manifest.segment_nbytes(seg):
            raise CorruptionError(
                f"shard {shard.index} claims {shard.length} bytes but holds "
                f"{manifest.segment_nbytes(seg)} of {meta.key!r}"
            )
        _, chunks = _chunk_shape(meta)
        targets[shard.index] = _ChunkTarget(
            f"{prefix}/{paths[seg.tensor]}/{_chunk_key(meta, i)}",
            math.prod(chunks) * np.dtype(storage_dtype(meta)).itemsize,
        )
    packs = [s for s in manifest.shards if s.kind == "pack"]
    geometry = None
    if packs:
        longest = max(s.length for s in packs)
        chunk = min(pack_chunk_bytes, -(-longest // 4096) * 4096)
        geometry = _PackGeometry(
            -(-longest // chunk) * chunk, chunk, tuple(s.length for s in packs)
        )
        for slot, shard in enumerate(packs):
            targets[shard.index] = _PackTarget(f"{prefix}/packed/c/{slot}", slot)
    placed = [t for t in targets if t is not None]
    if len(placed) != len(targets):
        raise CorruptionError(f"step {manifest.step}: a shard belongs to no tensor")
    return _Plan(
        manifest=manifest,
        prefix=prefix,
        targets=placed,
        arrays=dict(_aliases(manifest, paths)),
        pack=geometry,
    )


def _aliases(manifest: Manifest, paths: Mapping[int, str]) -> Iterator[tuple[str, str]]:
    for t, meta in enumerate(manifest.tensors):
        source = t if meta.alias_of is None else meta.alias_of
        if source in paths:
            yield meta.key, paths[source]


def _placement(meta: TensorMeta) -> dict[str, Any]:
    """Where a chunk of a sharded (DTensor) tensor lies in the global tensor, for a plain
    reader to reassemble it; nothing for an ordinary tensor, so its attributes stay as they
    were before several ranks could write a snapshot."""
    if meta.placements is None:
        return {}
    assert meta.global_shape is not None and meta.global_offset is not None
    return {
        "global_shape": list(meta.global_shape),
        "global_offset": list(meta.global_offset),
        "placements": list(meta.placements),
    }


def _part_attributes(plan: _Plan) -> dict[str, Any]:
    """The attributes of the group holding one rank's part (the snapshot group itself when
    one rank wrote the snapshot): what plain zarr needs to find each tensor, and the
    manifest, so that restoring from this tier alone is exact."""
    m = plan.manifest
    lazy: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "step": m.step,
        "rank": m.rank,
        "world_size": m.world_size,
        "arrays": plan.arrays,
        "packed": "packed" if plan.pack is not None else None,
    }
    replicas = {t.key: t.writer for t in m.tensors if t.mode == "replica"}
    if replicas:  # written once, by another rank: its part holds the array
        lazy["replicas"] = {k: _rank_name(w) for k, w in replicas.items() if w is not None}
    lazy["manifest"] = json.loads(m.to_json())
    return {"lazyckpt": lazy}


def _documents(plan: _Plan) -> dict[str, bytes]:
    """The metadata objects ``begin()`` writes: arrays, their parent groups, the pack."""
    m = plan.manifest
    docs: dict[str, bytes] = {}
    for t, meta in enumerate(m.tensors):
        if meta.alias_of is not None or meta.mode not in ("rows", "flat", "empty"):
            continue
        path = plan.arrays[meta.key]
        parts = path.split("/")
        for depth in range(1, len(parts)):
            docs.setdefault(f"{plan.prefix}/{'/'.join(parts[:depth])}/zarr.json", _group_doc())
        shape, chunks = _chunk_shape(meta)
        data_type = storage_dtype(meta)
        attrs = {
            "lazyckpt": {
                "format_version": FORMAT_VERSION,
                "key": meta.key,
                "dtype": meta.dtype,
                "shape": list(meta.shape),
                "layout": meta.mode,
                "tensor": t,
                **_placement(meta),
            }
        }
        docs[f"{plan.prefix}/{path}/zarr.json"] = _json(
            {
                "zarr_format": 3,
                "node_type": "array",
                "shape": list(shape),
                "data_type": data_type,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
                "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
                "fill_value": _fill_value(data_type),
                "codecs": [_bytes_codec(data_type), {"name": "crc32c"}],
                "attributes": attrs,
                "storage_transformers": [],
            }
        )
    if plan.pack is not None:
        docs[f"{plan.prefix}/packed/zarr.json"] = _pack_document(plan)
    return docs


def _pack_document(plan: _Plan) -> bytes:
    m, geometry = plan.manifest, plan.pack
    assert geometry is not None
    slot_of_shard = {
        shard.index: target.slot
        for shard, target in zip(m.shards, plan.targets, strict=True)
        if isinstance(target, _PackTarget)
    }
    index: dict[str, Any] = {}
    for t, meta in enumerate(m.tensors):
        source = m.tensors[meta.alias_of] if meta.alias_of is not None else meta
        if source.mode != "pack":
            continue
        slot = slot_of_shard[source.shards[0]]
        where = {}
        base = slot * geometry.shard_bytes
        if slot in plan.external:  # stored with an earlier step: its packed array holds it
            array, base = plan.external[slot]
            where = {"array": array}
        index[meta.key] = {
            **where,
            "offset": base + source.offset,
            "nbytes": source.nbytes,
            "dtype": source.dtype,
            "data_type": storage_dtype(source),
            "shape": list(source.shape),
            "tensor": t,
            **_placement(source),
        }
    inner = [{"name": "bytes"}, {"name": "crc32c"}]
    return _json(
        {
            "zarr_format": 3,
            "node_type": "array",
            "shape": [len(geometry.lengths) * geometry.shard_bytes],
            "data_type": "uint8",
            "chunk_grid": {
                "name": "regular",
                "configuration": {"chunk_shape": [geometry.shard_bytes]},
            },
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": 0,
            "codecs": [
                {
                    "name": "sharding_indexed",
                    "configuration": {
                        "chunk_shape": [geometry.chunk_bytes],
                        "codecs": inner,
                        "index_codecs": [
                            {"name": "bytes", "configuration": {"endian": "little"}},
                            {"name": "crc32c"},
                        ],
                        "index_location": "end",
                    },
                }
            ],
            "attributes": {
                "lazyckpt": {
                    "format_version": FORMAT_VERSION,
                    "index": index,
                    "shard_lengths": list(geometry.lengths),
                }
            },
            "storage_transformers": [],
        }
    )


def _geometry_from_document(raw: bytes, source: str) -> _PackGeometry:
    try:
        doc = json.loads(raw)
        (codec,) = doc["codecs"]
        shard_bytes = int(doc["chunk_grid"]["configuration"]["chunk_shape"][0])
        chunk_bytes = int(codec["configuration"]["chunk_shape"][0])
        lengths = tuple(int(n) for n in doc["attributes"]["lazyckpt"]["shard_lengths"])
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CorruptionError(f"{source} is damaged: {exc!r:.200}") from exc
    if chunk_bytes <= 0 or shard_bytes % chunk_bytes or any(n > shard_bytes for n in lengths):
        raise CorruptionError(f"{source} describes an impossible packed array")
    return _PackGeometry(shard_bytes, chunk_bytes, lengths)
