"""ZarrTier: snapshots as Zarr v3 groups, on a local or Lustre path or on S3.

Layout under the root (a directory, an S3 prefix, or any Zarr v3 store)::

    zarr.json                        root group; attributes.lazyckpt.committed lists the
                                     committed steps (the commit index)
    step-000000000100/               one group per snapshot
        zarr.json                    written at commit: format version, step, key -> array
                                     map, and the lazyckpt manifest (so restore is exact)
        tensors/                     one array per large tensor, at its state-dict key
            model/zarr.json
            model/layer.weight/zarr.json
            model/layer.weight/c/0/0, c/1/0, ...
        packed/                      the small tensors, side by side in a sharded uint8
            zarr.json                array; attributes.lazyckpt.index: key -> offset, dtype,
            c/0, c/1, ...            shape. One shard object per pack shard.

A snapshot written by several ranks has one such group per rank inside the step's group,
and the step's own ``zarr.json`` is the commit record (step, world size, no manifest)::

    step-000000000100/
        zarr.json                    the commit record, written by rank 0
        rank-00000/                  rank 0's part: zarr.json (its manifest), tensors/, packed/
        rank-00001/                  rank 1's part, written by rank 1 alone

Every array is uncompressed with a crc32c codec, so plain ``zarr`` (no lazyckpt installed)
reads every tensor and detects a damaged chunk. dtypes zarr lacks (bfloat16, float8,
complex32) are stored as unsigned integers of the same width; the real dtype is in the
attributes. A shard of the lazyckpt layout is exactly one zarr chunk (a pack shard is one
zarr shard), so each is written as one object, already encoded, straight to the store:
zarr's ``setitem`` would copy it twice more on the way.

Commit protocol: ``begin`` writes the array metadata, ``put_shard`` one object per shard,
``commit`` the snapshot group's ``zarr.json`` and then, last, the root ``zarr.json`` with
the step added to its index: one atomic object write (an S3 PUT, or a rename here). A step
missing from the index does not exist for ``steps()`` or restore, and ``open()`` removes
what a crash left of it. Listing committed steps reads that one small object and never
lists the keys of a snapshot.

With several ranks, ``commit`` publishes only the rank's part (its group's ``zarr.json``);
once every rank's part is durable and the ranks agreed (the engine's coordinator), rank 0's
``commit_global`` writes the commit record and then the index. Only rank 0 ever writes the
index (and deletes steps, and cleans up at ``open()``), so no two processes read-modify-write
the same object, and no two ranks write any object in common.

One writer per location: on a path each writing rank holds an ``flock`` on
``.lazyckpt-writer-rank-NNNNN.lock`` in the root for its life; on S3 it holds a lease, the
object ``.lazyckpt-writer-rank-NNNNN.json``, created with a conditional PUT (``If-None-Match``)
and renewed with ``If-Match`` on its ETag, so a second writer is refused at ``open()`` and a
writer that lost its lease (it stalled past ``lease_seconds`` and another took over) fails
before it writes again. The index on S3 is fenced by that lease: it names the owning
writer's token and is replaced only with ``If-Match`` on the ETag just read, and a writer that
takes over writes its token there before it sweeps anything, so a writer that stalls past its
lease after its last check still never commits. Readers take neither.

``open()`` deletes only what it can prove is its own uncommitted leftover: a step group
missing from the index, under a root whose ``zarr.json`` carries lazyckpt's attributes, that
holds nothing but this layout. A location another store wrote is refused
(:class:`~lazyckpt.ForeignLocationError`). A root whose ``zarr.json`` was lost is rebuilt
from the step groups whose commit records verify, and nothing is deleted on that open.

``docs/zarr.md`` has the plain-zarr recipe and the S3 configuration.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import re
import secrets
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import crc32c
import numpy as np
from zarr.abc.store import Store
from zarr.core.buffer import Buffer, default_buffer_prototype
from zarr.core.buffer.cpu import Buffer as CpuBuffer

from lazyckpt import (
    FORMAT_VERSION,
    ConfigurationError,
    CorruptionError,
    ForeignLocationError,
    LazyCkptError,
    LocationInUseError,
    Manifest,
    ShardMeta,
    SnapshotNotFoundError,
    TensorMeta,
    Tier,
    TierBrokenError,
    TierClosedError,
    TierFullError,
    TierLevel,
)

from ._fs import WriterLock, lock_name, read_small
from ._zarr_store import DurableLocalStore

__all__ = ["ZarrTier"]

log = logging.getLogger("lazyckpt")

T = TypeVar("T")

_STEP_GROUP = re.compile(r"^step-(\d{12})$")
_PART_GROUP = re.compile(r"^rank-\d{5}$")
_STEP_CHILDREN = {"zarr.json", "tensors", "packed"}  # besides rank parts: all a step group holds
_OURS_AT_ROOT = re.compile(r"^\.lazyckpt-writer-rank-\d{5}\.(lock|json)$")  # locks, leases
_NO_CHUNK = 2**64 - 1  # a shard index entry for an inner chunk that was not written
_MAX_NAME = 200  # bytes: file systems allow 255 per component, temporary names need a few

# Zarr v3 data types for torch dtypes. Those zarr lacks are stored as unsigned integers of the
# same width; the attributes say what they really are.
_STORAGE_DTYPE: Mapping[str, str] = {
    "float64": "float64",
    "float32": "float32",
    "float16": "float16",
    "complex128": "complex128",
    "complex64": "complex64",
    "complex32": "uint32",
    "bool": "bool",
    "uint8": "uint8",
    "int8": "int8",
    "int16": "int16",
    "int32": "int32",
    "int64": "int64",
    "uint16": "uint16",
    "uint32": "uint32",
    "uint64": "uint64",
    "bfloat16": "uint16",
    "float8_e4m3fn": "uint8",
    "float8_e5m2": "uint8",
    "float8_e4m3fnuz": "uint8",
    "float8_e5m2fnuz": "uint8",
    "float8_e8m0fnu": "uint8",
}
_UNSIGNED_OF_WIDTH = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


def storage_dtype(meta: TensorMeta) -> str:
    """The Zarr data type a tensor is stored as (``bfloat16`` -> ``uint16``)."""
    found = _STORAGE_DTYPE.get(meta.dtype) or _UNSIGNED_OF_WIDTH.get(meta.itemsize)
    if found is None:  # pragma: no cover - every torch dtype lazyckpt accepts has a width above
        raise ConfigurationError(f"tensor {meta.key!r}: no Zarr data type for {meta.dtype}")
    return found


def _fill_value(data_type: str) -> Any:
    if data_type == "bool":
        return False
    if data_type.startswith("complex"):
        return [0.0, 0.0]
    if data_type.startswith("float"):
        return 0.0
    return 0


def _bytes_codec(data_type: str) -> dict[str, Any]:
    if np.dtype(data_type).itemsize == 1:
        return {"name": "bytes"}
    return {"name": "bytes", "configuration": {"endian": "little"}}


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


def _step_prefix(step: int) -> str:
    return f"step-{step:012d}"


def _rank_name(rank: int) -> str:
    return f"rank-{rank:05d}"


def _part_prefix(step: int, rank: int, world_size: int) -> str:
    """Where one rank's part of a snapshot lives: the step's group itself for a snapshot of
    one rank (the layout of every earlier version), ``step-.../rank-NNNNN`` otherwise."""
    if world_size == 1:
        return _step_prefix(step)
    return f"{_step_prefix(step)}/{_rank_name(rank)}"


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


@dataclass
class _Plan:
    """Where each shard and tensor of one snapshot lives in the store."""

    manifest: Manifest
    prefix: str
    targets: list[_ChunkTarget | _PackTarget]
    arrays: dict[str, str]  # tensor key -> array path relative to the snapshot group
    pack: _PackGeometry | None


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


def plan_snapshot(manifest: Manifest, pack_chunk_bytes: int) -> _Plan:
    """Map every tensor and shard of ``manifest`` to Zarr arrays and objects (no I/O)."""
    prefix = _part_prefix(manifest.step, manifest.rank, manifest.world_size)
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
        index[meta.key] = {
            "offset": slot * geometry.shard_bytes + source.offset,
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


# -- encoding chunks and shards -----------------------------------------------------------------

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


# -- S3 configuration ---------------------------------------------------------------------------


def _env_flag(value: str | None) -> bool | None:
    if value is None or value == "":
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class _S3Settings:
    bucket: str
    prefix: str
    endpoint: str | None
    region: str | None
    allow_http: bool
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    @property
    def secrets(self) -> tuple[str, ...]:
        found = (self.access_key_id, self.secret_access_key, self.session_token)
        return tuple(s for s in found if s)

    def scrub(self, text: str) -> str:
        """``text`` with every credential replaced by ``***``."""
        for secret in self.secrets:
            text = text.replace(secret, "***")
        return text

    @property
    def public_endpoint(self) -> str | None:
        """The endpoint without any user:password part."""
        if self.endpoint is None:
            return None
        parts = urlsplit(self.endpoint)
        host = parts.hostname or ""
        if parts.port is not None:
            host = f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, host, parts.path, "", ""))


def _s3_settings(url: str, overrides: Mapping[str, Any]) -> _S3Settings:
    parts = urlsplit(url)
    if not parts.netloc or parts.query or parts.fragment:
        raise ConfigurationError("an S3 location looks like 's3://bucket/prefix'")
    env = os.environ

    def pick(name: str, *variables: str) -> Any:
        if overrides.get(name) is not None:
            return overrides[name]
        for var in variables:
            if env.get(var):
                return env[var]
        return None

    endpoint = pick("endpoint_url", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
    allow_http = overrides.get("allow_http")
    if allow_http is None:
        allow_http = bool(_env_flag(env.get("AWS_ALLOW_HTTP")))
    if endpoint is not None and urlsplit(endpoint).scheme == "http" and not allow_http:
        raise ConfigurationError(
            "the S3 endpoint uses plain HTTP; pass allow_http=True (or set AWS_ALLOW_HTTP=true) "
            "if that is intended"
        )
    return _S3Settings(
        bucket=parts.netloc,
        prefix=parts.path.strip("/"),
        endpoint=endpoint,
        region=pick("region", "AWS_REGION", "AWS_DEFAULT_REGION"),
        allow_http=bool(allow_http),
        access_key_id=pick("access_key_id", "AWS_ACCESS_KEY_ID"),
        secret_access_key=pick("secret_access_key", "AWS_SECRET_ACCESS_KEY"),
        session_token=pick("session_token", "AWS_SESSION_TOKEN"),
    )


def _s3_store(
    s: _S3Settings,
    *,
    retries: int,
    retry_timeout: float,
    connect_timeout: float,
    request_timeout: float,
) -> Store:
    from obstore.store import S3Store
    from zarr.storage import ObjectStore

    config: dict[str, Any] = {}
    for key, value in (
        ("endpoint", s.endpoint),
        ("region", s.region),
        ("access_key_id", s.access_key_id),
        ("secret_access_key", s.secret_access_key),
        ("session_token", s.session_token),
    ):
        if value is not None:
            config[key] = value
    if s.endpoint is not None:
        config["virtual_hosted_style_request"] = False  # path style: what S3 clones serve
    try:
        backend = S3Store(
            s.bucket,
            prefix=s.prefix or None,
            config=config,  # type: ignore[arg-type]
            client_options={
                "allow_http": s.allow_http,
                "connect_timeout": timedelta(seconds=connect_timeout),
                "timeout": timedelta(seconds=request_timeout),
            },
            retry_config={
                "max_retries": retries,
                "retry_timeout": timedelta(seconds=retry_timeout),
                "backoff": {
                    "init_backoff": timedelta(milliseconds=100),
                    "max_backoff": timedelta(seconds=10),
                    "base": 2,
                },
            },
        )
    except Exception as exc:
        raise ConfigurationError(
            f"bad S3 configuration for bucket {s.bucket!r}: {s.scrub(str(exc))[:300]}"
        ) from None
    return ObjectStore(backend)


async def _awaited(aw: Awaitable[T]) -> T:
    return await aw


def _is_file(path: Path) -> bool:
    return path.exists() and not path.is_dir()


def _lease_holder(raw: Any) -> dict[str, Any]:
    try:
        doc = json.loads(bytes(raw))
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


# -- the tier -----------------------------------------------------------------------------------


class ZarrTier(Tier):
    """Snapshots as Zarr v3 groups on a parallel file system path or on S3.

    Each committed snapshot is a group that plain ``zarr`` opens and reads tensors from by
    their state-dict key (``docs/zarr.md``); small tensors are packed into one sharded
    array, so a checkpoint of thousands of tensors is a handful of objects.

    With several ranks (a distributed Checkpointer), every rank gives the same location;
    each writes its own part and rank 0 commits the step once all agreed.

    Args:
        location: a directory (local or Lustre; every write is fsynced), ``s3://bucket/prefix``,
            or any Zarr v3 ``Store`` object (used as given).
        name: the tier's name (default ``"zarr"``).
        concurrency: most requests this tier has in flight at once (metadata writes,
            deletes, reads).
        io_threads: threads doing file I/O (paths) and copies (all locations).
        pack_chunk_bytes: inner chunk size of the packed array: the unit a plain zarr reader
            fetches to read one small tensor.
        endpoint_url, region, access_key_id, secret_access_key, session_token, allow_http: S3
            settings; each defaults to its standard environment variable
            (``AWS_ENDPOINT_URL``, ``AWS_REGION``, ``AWS_ACCESS_KEY_ID``,
            ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_ALLOW_HTTP``). Credentials
            never appear in manifests, errors or logs.
        retries: S3 retries of a failed request (5xx, dropped connections, timeouts), with
            exponential backoff and jitter.
        retry_timeout: seconds after which a failing S3 request is not retried any more.
        connect_timeout, request_timeout: S3 connection and whole-request limits, seconds.
        keep_last, keep_every: retention (see :class:`lazyckpt.Retention`).
        readonly: only read (a restore, an inspection): ``open()`` creates, deletes and locks
            nothing, a missing location or bucket is :class:`~lazyckpt.SnapshotNotFoundError`,
            and writing is refused. A reader works beside a running writer.
        lease_seconds: on S3, how long a writer's lease lasts without renewal (it renews at
            every snapshot, and while writing one); a writer that was killed blocks the next
            one until then. Hosts' clocks must agree to well within it.
    """

    # the locations the command line opens with this tier: s3:// URLs, and a local directory
    # whose root holds the Zarr group's metadata
    url_schemes = ("s3",)
    location_marker = "zarr.json"
    level = TierLevel.PFS
    default_name = "zarr"

    def __init__(
        self,
        location: str | os.PathLike[str] | Store,
        *,
        name: str | None = None,
        concurrency: int = 32,
        io_threads: int = 4,
        pack_chunk_bytes: int = 64 << 10,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        allow_http: bool | None = None,
        retries: int = 5,
        retry_timeout: float = 60.0,
        connect_timeout: float = 5.0,
        request_timeout: float = 120.0,
        keep_last: int | None = None,
        keep_every: int | None = None,
        readonly: bool = False,
        lease_seconds: float = 300.0,
    ) -> None:
        super().__init__(name=name, keep_last=keep_last, keep_every=keep_every)
        self.readonly = readonly
        if not lease_seconds > 0:
            raise ConfigurationError(f"lease_seconds must be positive, got {lease_seconds!r}")
        self.lease_seconds = float(lease_seconds)
        self._retries = retries
        if sys.byteorder != "little":  # pragma: no cover - no big-endian test machine
            raise ConfigurationError("ZarrTier writes raw little-endian chunks; this host is not")
        if concurrency < 1 or io_threads < 1:
            raise ConfigurationError("concurrency and io_threads must be at least 1")
        if pack_chunk_bytes < 4096 or pack_chunk_bytes % 4096:
            raise ConfigurationError("pack_chunk_bytes must be a positive multiple of 4096")
        if (
            retries < 0
            or not retry_timeout > 0
            or not connect_timeout > 0
            or not request_timeout > 0
        ):
            raise ConfigurationError("retries must be >= 0 and the timeouts positive")
        self.concurrency = concurrency
        self.pack_chunk_bytes = pack_chunk_bytes
        self._io_threads = io_threads
        self._s3: _S3Settings | None = None
        self._local: Path | None = None  # the root directory, for a path location
        s3_options = {
            "endpoint_url": endpoint_url,
            "region": region,
            "access_key_id": access_key_id,
            "secret_access_key": secret_access_key,
            "session_token": session_token,
            "allow_http": allow_http,
        }
        if isinstance(location, Store):
            self.location = f"<{type(location).__name__}>"
            self._store: Store = location
        elif isinstance(location, str) and location.startswith("s3://"):
            self._s3 = _s3_settings(location, s3_options)
            self.location = f"s3://{self._s3.bucket}/{self._s3.prefix}".rstrip("/")
            self._store = _s3_store(
                self._s3,
                retries=retries,
                retry_timeout=retry_timeout,
                connect_timeout=connect_timeout,
                request_timeout=request_timeout,
            )
        elif isinstance(location, str | os.PathLike) and str(location):
            path = str(location)
            if path.startswith("file://"):
                path = path[len("file://") :]
            elif "://" in path:
                raise ConfigurationError(
                    f"ZarrTier takes a path or an s3:// URL, got {path.split('://')[0]}://"
                )
            self.location = str(Path(path))
            self._local = Path(path)
            self._store = DurableLocalStore(path, read_only=readonly, io_threads=io_threads)
        else:
            raise ConfigurationError(
                f"ZarrTier takes a path, an s3:// URL or a zarr Store, got {location!r}"
            )
        if self._s3 is None and any(v is not None for v in s3_options.values()):
            raise ConfigurationError("S3 settings were given for a location that is not s3://")
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._plans: dict[tuple[int, int], _Plan] = {}  # (step, rank) ->
        self._begun: set[int] = set()
        self._unsynced: dict[int, set[str]] = {}  # step -> directories to sync at commit
        self._geometry: dict[tuple[int, int], _PackGeometry] = {}  # (step, rank) ->
        self._shared_checked = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._requests = asyncio.Semaphore(concurrency)
        self._index_lock = asyncio.Lock()
        self._delete_lock = asyncio.Lock()
        self._writer_lock: WriterLock | None = None
        self._lease: tuple[str, str, float] | None = None  # token, ETag, renewed (monotonic)
        self._leased = False  # this writer took a lease: without one now, it lost it
        self._closed = False

    def describe(self) -> dict[str, Any]:
        info = {**super().describe(), "location": self.location, "format": "zarr-v3"}
        if self._s3 is not None and self._s3.public_endpoint is not None:
            info["endpoint"] = self._s3.public_endpoint
        return info

    # -- plumbing --------------------------------------------------------------------------

    def _sync_primitives(self) -> None:
        # asyncio primitives belong to one loop; a tier reused from another loop (tests, a
        # second Checkpointer) gets fresh ones.
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop = loop
            self._requests = asyncio.Semaphore(self.concurrency)
            self._index_lock = asyncio.Lock()
            self._delete_lock = asyncio.Lock()

    @contextlib.contextmanager
    def _backend(self, what: str) -> Iterator[None]:
        """Run a tier operation: refuse when closed, translate backend errors once."""
        if self._closed:
            raise TierClosedError("closed", tier=self.name)
        self._sync_primitives()
        store = self._store
        if self.readonly and isinstance(store, DurableLocalStore) and not store.read_only:
            # readonly was set after construction (before any use): a store that never
            # creates the directory
            self._store = store.with_read_only(True)
        try:
            yield
        except LazyCkptError:
            raise
        except Exception as exc:
            if self._s3 is not None and "NoSuchBucket" in str(exc):
                raise self._no_bucket() from None
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise TierFullError(f"{what}: out of space", tier=self.name) from exc
            raise TierBrokenError(f"{what}: {self._summary(exc)}", tier=self.name) from exc

    def _no_bucket(self) -> LazyCkptError:
        assert self._s3 is not None
        where = f" at {self._s3.public_endpoint}" if self._s3.public_endpoint else ""
        if self.readonly:
            return SnapshotNotFoundError(
                f"{self.location}: the bucket {self._s3.bucket!r} does not exist{where}"
            )
        return ConfigurationError(
            f"{self.location}: the bucket {self._s3.bucket!r} does not exist{where}; create it "
            "(lazyckpt never creates buckets) or fix the location"
        )

    def _writable(self, what: str) -> None:
        if self.readonly:
            raise ConfigurationError(
                f"tier {self.name!r} ({self.location}) was opened read-only: cannot {what}; "
                "build it without readonly=True to write"
            )

    def _summary(self, exc: BaseException) -> str:
        """The first line of a backend error, without anything secret."""
        text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if self._s3 is not None:
            text = self._s3.scrub(text)
        return f"{type(exc).__name__}: {text[:300]}"

    async def _request(self, aw: Awaitable[T]) -> T:
        async with self._requests:
            return await aw

    @staticmethod
    async def _all(aws: Iterable[Awaitable[Any]]) -> None:
        # Each awaitable takes its own request slot (see _request): taking one here as well
        # would deadlock once more than `concurrency` of them wait.
        try:
            async with asyncio.TaskGroup() as tg:
                for aw in aws:
                    tg.create_task(_awaited(aw))
        except ExceptionGroup as group:  # the first failure says what went wrong
            first: BaseException = group
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from first.__cause__

    async def _cpu(self, fn: Any, *args: Any) -> Any:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                self._io_threads, thread_name_prefix=f"lazyckpt-{self.name}"
            )
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    async def _get(self, key: str) -> Buffer | None:
        return await self._request(self._store.get(key, default_buffer_prototype()))

    async def _get_document(self, key: str) -> bytes | None:
        """A small metadata object (the index, a commit record, a group or array document).
        On a path it is read with aiofiles, off the store's bounded pool, so listing steps
        or reading a manifest never waits behind the chunk writes queued there; writes stay
        on the store (they fsync the file and its directory)."""
        if self._local is None:
            raw = await self._get(key)
            return None if raw is None else raw.to_bytes()
        try:
            return await read_small(self._local.joinpath(*key.split("/")))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None

    async def _put(self, key: str, data: bytes) -> None:
        await self._request(self._store.set(key, CpuBuffer.from_bytes(data)))

    async def _put_unpublished(self, step: int, key: str, parts: list[memoryview]) -> None:
        """Write an object of a snapshot that is not committed yet: on a path its directory
        entries are synced once, at commit, instead of with every object."""
        if isinstance(self._store, DurableLocalStore):
            pending = self._unsynced.setdefault(step, set())
            await self._request(self._store.write_parts(key, parts, unpublished=pending))
        elif len(parts) == 1:
            await self._request(self._store.set(key, CpuBuffer.from_bytes(parts[0])))
        else:
            joined = await self._cpu(_join, parts)
            await self._request(self._store.set(key, CpuBuffer.from_array_like(joined)))

    async def _put_documents(self, plan: _Plan) -> None:
        step = plan.manifest.step
        docs = _documents(plan)
        await self._all(self._put_unpublished(step, k, [memoryview(v)]) for k, v in docs.items())

    def _plan(self, manifest: Manifest) -> _Plan:
        at = (manifest.step, manifest.rank)  # a resharding restore reads several ranks' parts
        plan = self._plans.get(at)
        if plan is None or plan.manifest is not manifest:
            plan = plan_snapshot(manifest, self.pack_chunk_bytes)
            self._plans[at] = plan
            while len(self._plans) > 64:  # readers of old steps just plan again
                del self._plans[next(iter(self._plans))]
        return plan

    def _forget(self, step: int) -> None:
        """Drop what is cached about ``step`` (every rank's part)."""
        for cache in (self._plans, self._geometry):
            for at in [at for at in cache if at[0] == step]:
                del cache[at]
        self._begun.discard(step)
        self._unsynced.pop(step, None)

    @property
    def _committer(self) -> bool:
        """Whether this instance writes the commit index: the only one in a single-process
        run, rank 0 of several (the others never write it, so no two processes ever
        read-modify-write the same object)."""
        return self.world_size == 1 or self.rank == 0

    # -- the commit index ------------------------------------------------------------------

    async def _read_root(self) -> dict[str, Any] | None:
        raw = await self._get_document("zarr.json")
        if raw is None:
            return None
        return self._parse_root(raw)

    def _parse_root(self, raw: bytes) -> dict[str, Any]:
        try:
            doc = json.loads(raw)
            if doc.get("node_type") != "group":
                raise ValueError("not a group")
        except (ValueError, AttributeError) as exc:
            raise CorruptionError(f"{self.location}/zarr.json is not a Zarr group: {exc}") from exc
        if not isinstance(doc.get("attributes", {}).get("lazyckpt"), dict):
            raise ForeignLocationError(
                f"{self.location} holds a Zarr group that lazyckpt did not write; nothing was "
                "changed. Give ZarrTier an empty or new location.",
                location=self.location,
            )
        return doc  # type: ignore[no-any-return]

    @staticmethod
    def _committed(root: dict[str, Any] | None) -> list[int]:
        if root is None:
            return []
        steps = root["attributes"]["lazyckpt"].get("committed", [])
        if not isinstance(steps, list) or any(type(s) is not int or s < 0 for s in steps):
            raise CorruptionError("the commit index in the root zarr.json is damaged")
        return sorted(steps)

    async def _update_index(self, add: int | None = None, remove: int | None = None) -> None:
        if self._leased:
            await self._update_fenced_index(() if add is None else (add,), remove, claim=False)
            return
        async with self._index_lock:
            root = await self._read_root()
            if root is None:
                root = json.loads(_group_doc({"lazyckpt": {}}))
            assert root is not None
            steps = set(self._committed(root))
            if add is not None:
                steps.add(add)
            if remove is not None:
                steps.discard(remove)
            lazy = root["attributes"]["lazyckpt"]
            lazy["format_version"] = max(int(lazy.get("format_version", 0)), FORMAT_VERSION)
            lazy["committed"] = sorted(steps)
            # The commit point: one atomic object write (an S3 PUT, a rename on a path).
            await self._put("zarr.json", _json(root))

    async def _update_fenced_index(
        self, add: Iterable[int], remove: int | None, *, claim: bool
    ) -> None:
        """The index of a leased (S3) location, fenced: it names the lease token of the
        writer that owns it, and is only replaced with ``If-Match`` on the ETag just read.
        A writer that took the location over ``claim``s it (writes its own token) before it
        deletes anything, so a writer that lost its lease, however long it stalled after its
        last lease check, finds another token or a changed ETag and never writes the index:
        the commit point cannot be reached by two writers, whatever the hosts' clocks say."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        token = self._lease[0] if self._lease is not None else None
        async with self._index_lock:
            for attempt in range(self._retries + 3):
                if token is None:
                    raise self._lost_lease()
                try:
                    got = await self._request(obstore.get_async(self._backend_store, "zarr.json"))
                    raw, etag = bytes(await got.bytes_async()), got.meta["e_tag"]
                except FileNotFoundError:  # what obstore raises for a missing object
                    raw, etag = None, None
                root = self._parse_root(raw) if raw is not None else None
                if root is None:
                    if not claim:  # the taker always writes one: it is not ours any more
                        raise self._lost_lease()
                    root = json.loads(_group_doc({"lazyckpt": {}}))
                    assert root is not None
                lazy = root["attributes"]["lazyckpt"]
                if not claim and lazy.get("writer") != token:
                    raise self._lost_lease()
                steps = set(self._committed(root)).union(add)
                if remove is not None:
                    steps.discard(remove)
                lazy["format_version"] = max(int(lazy.get("format_version", 0)), FORMAT_VERSION)
                lazy["committed"] = sorted(steps)
                lazy["writer"] = token
                mode: Any = "create" if etag is None else {"e_tag": etag}
                try:
                    await self._request(
                        obstore.put_async(self._backend_store, "zarr.json", _json(root), mode=mode)
                    )
                    return
                except (PreconditionError, AlreadyExistsError):
                    continue  # written since the read: read again (was it the taker?)
                except Exception:
                    if attempt >= self._retries:
                        raise
                    # S3 clients do not retry conditional PUTs; a lost reply of one that
                    # landed shows up on the next read as this token's own index
                    await asyncio.sleep(min(0.1 * 2**attempt, 5.0))
            raise TierBrokenError(
                f"the commit index {self.location}/zarr.json kept changing under this writer",
                tier=self.name,
            )

    def _lost_lease(self) -> LocationInUseError:
        self._lease = None  # lost for good: every later write stops too
        return LocationInUseError(
            f"{self.location}: this writer's lease expired and another writer took the "
            "location over; this one stops writing here",
            location=self.location,
            holder=None,
        )

    # -- life cycle ------------------------------------------------------------------------

    async def open(self) -> None:
        """Check that the location is a lazyckpt Zarr store; for writing, also create it,
        take the writer's lock (path) or lease (S3), rebuild a lost index, and remove what a
        crash left uncommitted (see the module docstring)."""
        with self._backend(f"open {self.location}"):
            local = self._local
            if local is not None and await asyncio.to_thread(_is_file, local):
                raise ConfigurationError(
                    f"ZarrTier location {local} is a file, not a directory; give a directory"
                )
            if self.readonly:
                await self._open_readonly()
                return
            # a foreign location is refused before the lock or lease is written there
            if await self._read_root() is None:
                names = await self._names("")
                if self._committer:
                    await self._rebuild_index(self._check_root_names(names))
                else:  # rank 0 may be writing the root meanwhile
                    self._check_root_names([n for n in names if n != "zarr.json"])
            await self._take_writer_lock()
            try:
                await self._open_for_writing()
            except BaseException:
                await self._drop_writer_lock()
                raise

    async def _open_readonly(self) -> None:
        root = await self._read_root()
        if root is not None:
            self._check_version(root)
            return
        names = await self._names("")
        steps = self._check_root_names(names)
        if steps:
            raise CorruptionError(
                f"{self.location}/zarr.json, the commit index, is missing but step groups are "
                "there; open the location once for writing (ZarrTier without readonly) to "
                "rebuild the index from the steps whose commit records verify"
            )
        raise SnapshotNotFoundError(f"{self.location}: no lazyckpt Zarr store there")

    async def _open_for_writing(self) -> None:
        root = await self._read_root()
        if root is None:
            if not self._committer:
                return  # rank 0 creates the root; every rank waits for it before writing
            names = await self._names("")
            steps = self._check_root_names(names)
            committed, incomplete = await self._rebuild_index(steps)
            if self._leased:
                await self._update_fenced_index(committed, None, claim=True)
            else:
                document = {"format_version": FORMAT_VERSION, "committed": committed}
                await self._put("zarr.json", _group_doc({"lazyckpt": document}))
            if steps:
                log.warning(
                    "%s: the commit index (zarr.json) was missing; rebuilt it from the %d of "
                    "%d step groups whose commit records verify (%s); the others were left "
                    "in place%s",
                    self.location,
                    len(committed),
                    len(steps),
                    ", ".join(map(str, committed[-5:])) or "none",
                    "; these have a commit record but not all their objects (a delete that "
                    f"stopped part way?): {', '.join(map(_step_prefix, incomplete[:5]))}"
                    if incomplete
                    else "",
                )
            return  # nothing is deleted on the open that rebuilt the index
        self._check_version(root)
        if not self._committer:
            return  # rank 0 cleans up; every rank waits for it before writing
        if self._leased:
            # the index names this writer before anything is deleted: a writer whose lease
            # this one took over can no longer commit the steps swept below
            await self._update_fenced_index((), None, claim=True)
            root = await self._read_root()
        indexed = set(self._committed(root))
        leftovers = []
        async for name in self._store.list_dir(""):
            m = _STEP_GROUP.match(name.rstrip("/"))
            if m and int(m.group(1)) not in indexed:
                leftovers.append(m.group(0))
        for prefix in leftovers:  # each must be this layout, or nothing is deleted
            strange = [
                n
                for n in await self._names(prefix)
                if n not in _STEP_CHILDREN and not _PART_GROUP.match(n)
            ]
            if strange:
                raise ForeignLocationError(
                    f"{self.location}/{prefix} is not committed but holds "
                    f"{', '.join(strange[:5])}, which ZarrTier never writes; nothing was "
                    "deleted. Move it away.",
                    location=self.location,
                )
        # what a crash left: snapshots that never reached the index
        await self._all(self._request(self._store.delete_dir(p)) for p in leftovers)

    def _check_version(self, root: dict[str, Any]) -> None:
        version = int(root["attributes"]["lazyckpt"].get("format_version", 1))
        if version > FORMAT_VERSION:
            raise ConfigurationError(
                f"{self.location} was written by a newer lazyckpt (format {version}); upgrade"
            )

    async def _names(self, prefix: str) -> list[str]:
        return [n.rstrip("/") async for n in self._store.list_dir(prefix)]

    def _check_root_names(self, names: list[str]) -> list[str]:
        """The step groups at a root without its ``zarr.json``; raises
        :class:`~lazyckpt.ForeignLocationError` for anything ZarrTier does not write."""
        if "lazyckpt-file.json" in names:
            raise ForeignLocationError(
                f"{self.location} is a FileTier location (lazyckpt-file.json), not a Zarr "
                "store; nothing was changed. Open it with FileTier, or give ZarrTier another "
                "location.",
                location=self.location,
            )
        strangers = [n for n in names if not _STEP_GROUP.match(n) and not _OURS_AT_ROOT.match(n)]
        if strangers:
            raise ForeignLocationError(
                f"{self.location} holds {', '.join(sorted(strangers)[:5])}, which ZarrTier "
                "did not write, and no lazyckpt zarr.json; nothing was changed. Give ZarrTier "
                "an empty or new location.",
                location=self.location,
            )
        return sorted(n for n in names if _STEP_GROUP.match(n))

    async def _rebuild_index(self, groups: list[str]) -> tuple[list[int], list[int]]:
        """The steps among ``groups`` whose commit records verify (a lost index, rebuilt),
        and those whose records verify but whose objects are not all there.

        A group without a commit record was never committed and is left alone; a record
        that does not verify stops the open, since nobody can tell what it held. A record
        does not prove its data: a delete that stopped part way (the index already without
        the step) leaves the record beside a part of the objects, so every object each
        manifest names must be listed too, or the step is left out (and left in place)."""
        committed: list[int] = []
        incomplete: list[int] = []
        for prefix in groups:
            step = int(prefix[len("step-") :])
            names = await self._names(prefix)
            if "manifest.json" in names or any(n.endswith(".data") for n in names):
                raise ForeignLocationError(
                    f"{self.location}/{prefix} is a FileTier snapshot (manifest.json, "
                    "rank-*.data), not a Zarr group; nothing was changed. Open the location "
                    "with FileTier.",
                    location=self.location,
                )
            if "zarr.json" not in names:
                continue  # never committed
            key = f"{prefix}/zarr.json"
            try:
                attrs = await self._group_attributes(key)
                if "manifest" in attrs:
                    manifests = [self._record_manifest(attrs, key, step)]
                else:
                    world = attrs.get("world_size")
                    if attrs.get("step") != step or type(world) is not int or world < 2:
                        raise CorruptionError("it is neither a manifest nor a commit record")
                    manifests = []
                    for rank in range(world):
                        part = f"{_part_prefix(step, rank, world)}/zarr.json"
                        manifests.append(
                            self._record_manifest(await self._group_attributes(part), part, step)
                        )
                plans = [plan_snapshot(m, self.pack_chunk_bytes) for m in manifests]
            except CorruptionError as exc:
                raise CorruptionError(
                    f"{self.location}/zarr.json (the commit index) is missing, and whether "
                    f"step {step} was committed cannot be verified ({exc}); nothing was "
                    f"changed. Move {prefix} away to rebuild the index without it."
                ) from exc
            stored = {k async for k in self._store.list_prefix(f"{prefix}/")}
            wanted = {t.key for plan in plans for t in plan.targets}
            wanted.update(k for plan in plans for k in _documents(plan))
            (committed if wanted <= stored else incomplete).append(step)
        return committed, incomplete

    def _record_manifest(self, attrs: dict[str, Any], key: str, step: int) -> Manifest:
        source = f"{self.location}/{key}"
        try:
            manifest = Manifest.from_json(json.dumps(attrs["manifest"]), source=source)
        except KeyError as exc:
            raise CorruptionError(f"{source} has no manifest") from exc
        if manifest.step != step:
            raise CorruptionError(f"{source} holds step {manifest.step}")
        return manifest

    # -- one writer per location -----------------------------------------------------------

    async def _take_writer_lock(self) -> None:
        if self._local is not None:
            lock = WriterLock(self._local / lock_name(self.rank), self.location)

            def take() -> None:
                assert self._local is not None
                self._local.mkdir(parents=True, exist_ok=True)
                lock.acquire()

            await asyncio.to_thread(take)
            self._writer_lock = lock
        elif self._s3 is not None:
            await self._acquire_lease()
        # any other Store: the caller's to keep to one writer (docs/zarr.md)

    async def _drop_writer_lock(self) -> None:
        if self._writer_lock is not None:
            self._writer_lock.release()
            self._writer_lock = None
        if self._lease is not None:
            with contextlib.suppress(Exception):  # it expires anyway
                import obstore

                # renewed first, so that what is deleted is surely this writer's lease: a
                # taker gets in only once it expired, and a lease lost already stays put
                await self._renew_lease(force=True)
                await self._request(obstore.delete_async(self._backend_store, self._lease_key()))
            self._lease = None

    @property
    def _backend_store(self) -> Any:
        return self._store.store  # type: ignore[attr-defined]  # zarr's ObjectStore wrapper

    def _lease_key(self) -> str:
        return f".lazyckpt-writer-rank-{self.rank:05d}.json"

    def _lease_document(self, token: str) -> bytes:
        return _json(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "expires": time.time() + self.lease_seconds,
                "token": token,
            }
        )

    async def _lease_put(self, token: str, mode: Any) -> str | None:
        """PUT this writer's lease conditionally; its ETag, or ``None`` when the condition
        failed because someone else's lease is there. S3 clients do not retry conditional
        PUTs, so a dropped connection is retried here; a retry that finds the lease its own
        earlier attempt wrote (same token) counts as done."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        key = self._lease_key()
        for attempt in range(self._retries + 1):
            try:
                put = await self._request(
                    obstore.put_async(
                        self._backend_store, key, self._lease_document(token), mode=mode
                    )
                )
                return str(put["e_tag"])
            except (AlreadyExistsError, PreconditionError):
                held = await self._request(obstore.get_async(self._backend_store, key))
                if _lease_holder(await held.bytes_async()).get("token") == token:
                    return str(held.meta["e_tag"])
                return None
            except Exception:
                if attempt == self._retries:
                    raise
                await asyncio.sleep(min(0.1 * 2**attempt, 5.0))
        raise AssertionError("unreachable")  # pragma: no cover

    async def _acquire_lease(self) -> None:
        """Create the lease object, or take over one that expired; never overwrite a live
        one (conditional PUTs: ``If-None-Match: *``, then ``If-Match`` on its ETag)."""
        import obstore

        key, token = self._lease_key(), secrets.token_hex(8)
        etag = await self._lease_put(token, "create")
        if etag is None:
            held = await self._request(obstore.get_async(self._backend_store, key))
            holder = _lease_holder(await held.bytes_async())
            expires = holder.get("expires")
            if not isinstance(expires, int | float) or expires > time.time():
                raise self._in_use(key, holder)
            # expired: its writer died; take it over unless someone else just did
            etag = await self._lease_put(token, {"e_tag": held.meta["e_tag"]})
            if etag is None:
                raise self._in_use(key, None)
        self._lease = (token, etag, time.monotonic())
        self._leased = True

    def _in_use(self, key: str, holder: dict[str, Any] | None) -> LocationInUseError:
        who = (
            f"process {holder.get('pid')} on host {holder.get('host')!r} (lease until "
            f"{time.strftime('%H:%M:%S UTC', time.gmtime(float(holder.get('expires', 0))))})"
            if holder
            else "another process"
        )
        return LocationInUseError(
            f"{self.location} is being written by {who}, lease {self.location}/{key}: two "
            "writers on one location corrupt each other. Stop the other writer or use another "
            "location; if it was killed, its lease expires after lease_seconds. Restoring and "
            "the lazyckpt command line can read beside it.",
            location=self.location,
            holder={k: v for k, v in holder.items() if k != "token"} if holder else None,
        )

    async def _renew_lease(self, *, force: bool = False) -> None:
        """Before writing: renew the lease once a third of it has passed (``force``: now,
        before removing objects that may not be this writer's any more); a lease another
        writer took over (this one stalled past it) stops this writer here."""
        if not self._leased:
            return
        if self._lease is None:
            raise self._lost_lease()
        token, etag, renewed = self._lease
        if not force and time.monotonic() - renewed < self.lease_seconds / 3:
            return
        new_etag = await self._lease_put(token, {"e_tag": etag})
        if new_etag is None:
            raise self._lost_lease()
        self._lease = (token, new_etag, time.monotonic())

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._plans.clear()
        self._unsynced.clear()
        # joining worker threads blocks: not on the event loop
        if isinstance(self._store, DurableLocalStore):
            await asyncio.to_thread(self._store.close)
        if self._pool is not None:
            await asyncio.to_thread(self._pool.shutdown, wait=True)
        await self._drop_writer_lock()  # after the last write: the next writer may start

    # -- writing ---------------------------------------------------------------------------

    async def begin(self, manifest: Manifest) -> None:
        self._writable("write a snapshot")
        with self._backend("begin"):
            # begin removes what sits at the step's prefix: only while the lease is surely
            # this writer's (a taker may be writing the same step number there)
            await self._renew_lease(force=True)
            root = await self._read_root()
            if root is None and manifest.world_size > 1:
                raise ConfigurationError(
                    f"rank {manifest.rank} finds no lazyckpt root at {self.location}, which "
                    "rank 0 creates when it opens: every rank must give ZarrTier the same "
                    "shared location (an S3 prefix, or a directory every rank sees)"
                )
            if manifest.step in self._committed(root):
                raise TierBrokenError(
                    f"step {manifest.step} is already committed; delete it first", tier=self.name
                )
            plan = self._plan(manifest)
            self._geometry.pop((manifest.step, manifest.rank), None)
            # leftovers of an earlier attempt (this rank's part only: the others write theirs)
            await self._store.delete_dir(plan.prefix)
            self._unsynced.pop(manifest.step, None)
            await self._put_documents(plan)
            self._begun.add(manifest.step)

    async def put_shard(self, manifest: Manifest, shard: ShardMeta, data: memoryview) -> None:
        with self._backend(f"put shard {shard.index}"):
            if len(data) != shard.length:
                raise ConfigurationError(
                    f"shard {shard.index}: {len(data)} bytes, not {shard.length}"
                )
            await self._renew_lease()
            plan = self._plan(manifest)
            target = plan.targets[shard.index]
            if isinstance(target, _ChunkTarget):
                # data, padding and crc go out as pieces: no copy where the store takes them
                parts = await self._cpu(_chunk_parts, data, shard.crc32c, target.chunk_bytes)
            else:
                assert plan.pack is not None
                parts = [memoryview(await self._cpu(_encode_pack_shard, data, plan.pack))]
            await self._put_unpublished(manifest.step, target.key, parts)

    async def commit(self, manifest: Manifest) -> None:
        """Make this snapshot durable and, written by one rank, visible. With several ranks
        this publishes this rank's part only (its group's ``zarr.json``, with its manifest);
        :meth:`commit_global` makes the step visible once every rank has done so."""
        self._writable("commit a snapshot")
        with self._backend("commit"):
            await self._renew_lease()
            plan = self._plan(manifest)
            if manifest.step not in self._begun:  # committed without begin(): metadata owed
                await self._put_documents(plan)
            if isinstance(self._store, DurableLocalStore):
                # kept until done: a commit that fails here and is retried syncs them again
                await self._store.sync_directories(self._unsynced.get(manifest.step, ()))
            await self._put(f"{plan.prefix}/zarr.json", _group_doc(_part_attributes(plan)))
            if manifest.world_size == 1:
                await self._update_index(add=manifest.step)
            self._begun.discard(manifest.step)
            self._unsynced.pop(manifest.step, None)
            if plan.pack is not None:
                self._geometry[(manifest.step, manifest.rank)] = plan.pack

    async def commit_global(self, step: int, world_size: int) -> None:
        """Make a step written by ``world_size`` ranks visible, once every rank's part is
        durable (the engine calls this on every rank after they agreed). Rank 0 writes the
        step's group ``zarr.json`` (the commit record) and then the root index with the step
        added: that one atomic object write is the commit point. The other ranks write
        nothing; the first time, each checks that it sees rank 0's part, i.e. that every
        rank was given the same location. Idempotent."""
        with self._backend("commit"):
            if world_size == 1:
                return  # commit() published it
            self._writable("commit a snapshot")
            await self._renew_lease()
            prefix = _step_prefix(step)
            if not self._committer:
                if not self._shared_checked:
                    key = f"{prefix}/{_rank_name(0)}/zarr.json"
                    if not await self._request(self._store.exists(key)):
                        raise ConfigurationError(
                            f"rank {self.rank} does not see rank 0's part of step {step} at "
                            f"{self.location}/{key}: every rank must give ZarrTier the same "
                            "shared location"
                        )
                    self._shared_checked = True
                return
            record = {
                "lazyckpt": {
                    "format_version": FORMAT_VERSION,
                    "step": step,
                    "world_size": world_size,
                    "parts": "rank-%05d",
                }
            }
            await self._put(f"{prefix}/zarr.json", _group_doc(record))
            await self._update_index(add=step)

    async def abort(self, step: int) -> None:
        with self._backend("abort"):
            self._forget(step)
            if self.readonly:
                return  # a read-only tier wrote nothing to abort
            try:
                await self._renew_lease(force=True)
            except LocationInUseError:
                return  # what is there now is the taker's (it may write the same step)
            if step in self._committed(await self._read_root()):
                return
            if self.world_size == 1:
                await self._store.delete_dir(_step_prefix(step))
                return
            # this rank's part only: the others may still be writing theirs
            await self._store.delete_dir(_part_prefix(step, self.rank, self.world_size))
            if isinstance(self._store, DurableLocalStore):
                await self._store.remove_empty_dir(_step_prefix(step))

    # -- reading ---------------------------------------------------------------------------

    async def steps(self) -> list[int]:
        with self._backend("list"):
            return self._committed(await self._read_root())

    async def read_manifest(self, step: int) -> Manifest:
        return await self.read_rank_manifest(step, self.rank)

    async def read_rank_manifest(self, step: int, rank: int) -> Manifest:
        """Rank ``rank``'s manifest of a committed step. A step written by a single process
        has one manifest, returned for any rank; a step of several ranks that has no part of
        ``rank`` raises :class:`~lazyckpt.CorruptionError` (a resharding restore then reads
        another rank's)."""
        with self._backend("read manifest"):
            if step not in self._committed(await self._read_root()):
                raise SnapshotNotFoundError(f"step {step} is not committed on {self.name!r}")
            key = f"{_step_prefix(step)}/zarr.json"
            attrs = await self._group_attributes(key)
            if "manifest" not in attrs:  # the commit record of a step of several ranks
                world = attrs.get("world_size")
                if type(world) is not int or world < 2:
                    raise CorruptionError(
                        f"{self.name}:{self.location}/{key} is damaged: no manifest and no "
                        "world size"
                    )
                if not 0 <= rank < world:
                    raise CorruptionError(
                        f"step {step} was written by {world} ranks: it has no part of rank {rank}"
                    )
                key = f"{_part_prefix(step, rank, world)}/zarr.json"
                attrs = await self._group_attributes(key)
            source = f"{self.name}:{self.location}/{key}"
            try:
                manifest = Manifest.from_json(json.dumps(attrs["manifest"]), source=source)
            except KeyError as exc:
                raise CorruptionError(f"{source} is damaged: {exc!r:.200}") from exc
            if manifest.step != step:
                raise CorruptionError(f"{source} holds step {manifest.step}, not {step}")
            if manifest.world_size > 1 and manifest.rank != rank:
                raise CorruptionError(
                    f"{source} holds rank {manifest.rank}'s manifest, not {rank}'s"
                )
            return manifest

    async def _group_attributes(self, key: str) -> dict[str, Any]:
        """``attributes.lazyckpt`` of the group document at ``key`` of a committed step."""
        source = f"{self.name}:{self.location}/{key}"
        raw = await self._get_document(key)
        if raw is None:
            raise CorruptionError(f"{source} is missing from a committed step")
        try:
            attrs = json.loads(raw)["attributes"]["lazyckpt"]
            if not isinstance(attrs, dict):
                raise TypeError("attributes.lazyckpt is not an object")
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptionError(f"{source} is damaged: {exc!r:.200}") from exc
        return attrs

    async def _pack_geometry(self, plan: _Plan) -> _PackGeometry:
        # Read from the store, never derived from this tier's options: the writer may have
        # used another pack_chunk_bytes.
        at = (plan.manifest.step, plan.manifest.rank)
        geometry = self._geometry.get(at)
        if geometry is None:
            key = f"{plan.prefix}/packed/zarr.json"
            raw = await self._get_document(key)
            if raw is None:
                raise CorruptionError(f"{self.location}/{key} is missing")
            geometry = _geometry_from_document(raw, f"{self.location}/{key}")
            self._geometry[at] = geometry
        return geometry

    async def read_shard(self, manifest: Manifest, shard: ShardMeta, out: memoryview) -> None:
        with self._backend(f"read shard {shard.index}"):
            if len(out) != shard.length:
                raise ConfigurationError(f"shard {shard.index}: out has {len(out)} bytes")
            plan = self._plan(manifest)
            target = plan.targets[shard.index]
            where = f"{self.name}:{self.location}/{target.key}"
            if isinstance(target, _PackTarget):
                geometry = await self._pack_geometry(plan)
                if target.slot >= len(geometry.lengths) or (
                    geometry.lengths[target.slot] != shard.length
                ):
                    raise CorruptionError(f"{where} does not hold {shard.length} bytes")
                raw = await self._get(target.key)
                if raw is None:
                    raise CorruptionError(f"{where} is missing")
                blob = memoryview(raw.as_buffer_like()).cast("B")
                try:
                    await self._cpu(_decode_pack_shard, blob, out, geometry)
                except CorruptionError as exc:
                    raise CorruptionError(f"{where}: {exc}") from None
                return
            expected = target.chunk_bytes + 4
            if isinstance(self._store, DurableLocalStore):
                try:
                    size = await self._request(self._store.read_into(target.key, out))
                except FileNotFoundError:
                    raise CorruptionError(f"{where} is missing") from None
            else:
                raw = await self._get(target.key)
                if raw is None:
                    raise CorruptionError(f"{where} is missing")
                stored = memoryview(raw.as_buffer_like()).cast("B")
                size = len(stored)
                if size == expected:
                    await self._cpu(out.__setitem__, slice(None), stored[: shard.length])
            if size != expected:
                raise CorruptionError(f"{where} holds {size} bytes, not {expected}")

    async def delete(self, step: int) -> None:
        """Un-commit ``step`` (remove it from the index), then remove its objects, every
        rank's part. With several ranks this is rank 0's work, as committing is; on the
        others it only forgets what this instance cached.

        Deletes run one at a time: retention passes may overlap (one still listing when the
        next step's commit starts another) and ask to delete the same step twice; the second
        then finds nothing left to do instead of removing a tree the first is removing."""
        with self._backend(f"delete step {step}"):
            self._forget(step)
            if not self._committer:
                return
            self._writable("delete a snapshot")
            await self._renew_lease()
            async with self._delete_lock:
                await self._update_index(remove=step)  # un-commit first
                await self._store.delete_dir(_step_prefix(step))
