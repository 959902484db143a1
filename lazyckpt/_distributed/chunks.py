"""What a distributed tensor looks like in a snapshot: leaf helpers, nothing about restoring.

A DTensor on any device mesh (N-D, a sub-mesh of some ranks, one per pipeline stage or
expert group), with any mix of ``Shard(d)``, ``Replicate`` and the strided shard FSDP2 uses
over a tensor-parallel one, is captured as its local chunk (:func:`local_chunk`), and the
manifest records where that chunk lies in the global tensor (:class:`DistInfo`), as torch
itself computes it (``compute_local_shape_and_global_offset``, what DCP records), and which
ranks hold the same chunk (its replicas: the ranks that differ from this one only on the
mesh's ``Replicate`` dimensions). A tensor marked replicated (:class:`ReplicatedMarker`, the
base of the public :class:`lazyckpt.Replicated`) is held by every rank. A chunk held by
several ranks is written by one of them (:func:`balance_writers`).

This module sits below the state walk (``_format.walk``), which needs these to describe tensors;
restoring and resharding (``_restore.reshard``) sit above it. It imports nothing of lazyckpt but
the errors.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import crc32c
import torch

from .._errors import UnsupportedStateError

__all__ = [
    "DistInfo",
    "ReplicatedMarker",
    "balance_writers",
    "local_chunk",
    "replicated_info",
    "writer_of",
]


@dataclass(frozen=True)
class DistInfo:
    """Where a captured tensor lies in its global tensor.

    Attributes:
        global_shape: the shape of the whole (unsharded) tensor.
        global_offset: where this rank's chunk starts in it, per dimension.
        placements: ``"shard(d)"`` or ``"replicate"``, one per mesh dimension (a strided
            shard is recorded as the shard it is; the offset says where its rows lie).
        mesh_size: ranks of the DTensor's mesh (``None`` for a plain tensor).
        coordinate: this rank's place on that mesh, one index per mesh dimension.
        replicas: the global ranks holding this very chunk, ascending, this one included;
            ``None`` for a tensor marked :class:`Replicated`: every rank of the job.
        writer: for a chunk several ranks hold, the rank that stores it (set by
            :func:`balance_writers`); ``None`` means this rank stores it.
    """

    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    placements: tuple[str, ...]
    mesh_size: int | None = None
    coordinate: tuple[int, ...] | None = None
    replicas: tuple[int, ...] | None = None
    writer: int | None = None


class ReplicatedMarker:
    """Marks a value as identical on every rank. The state walk only needs to recognise
    the mark; loading restored state into the wrapped value is :class:`lazyckpt.Replicated`'s
    (which restores through the restore path, above this module)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Replicated({type(self.value).__qualname__})"


class _LocalChunk(torch.Tensor):
    """A DTensor's local chunk as the capture path sees it: the same memory, but a
    ``_version`` that also moves when the DTensor is changed in place.

    An in-place op on a DTensor (``optimizer.step()`` on FSDP2 parameters) bumps the
    DTensor's version counter and not its local tensor's, which it runs on below autograd;
    a write through the local tensor bumps only the local one. The capture path compares
    ``ref.tensor._version`` before and after copying, so both must count.
    """

    _owner: torch.Tensor
    # operations on the view give plain tensors: the override above is for the check only
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @property
    def _version(self) -> int:  # type: ignore[override]
        own: int = torch._C.TensorBase._version.__get__(self)  # type: ignore[attr-defined]
        return int(self._owner._version) + own


def _placement_name(p: Any, key: str) -> str:
    """A placement as the manifest records it; a typed error for one lazyckpt cannot store."""
    from torch.distributed.tensor import Replicate, Shard

    strided = getattr(sys.modules.get("torch.distributed.tensor.placement_types"), "_StridedShard", None)
    if isinstance(p, Shard) or (strided is not None and isinstance(p, strided)):
        return f"shard({p.dim})"
    if isinstance(p, Replicate):
        return "replicate"
    raise UnsupportedStateError(
        f"DTensor {key!r} has placement {p} on its mesh; lazyckpt stores Shard(d), the "
        "strided shard of FSDP over tensor parallelism, and Replicate. Redistribute a "
        "Partial (pending reduction) tensor to Replicate or Shard before snapshot()"
    )


# (mesh id, placements, global shape, local shape) -> (the mesh, where the chunk lies)
_CHUNKS: dict[tuple[Any, ...], tuple[Any, DistInfo]] = {}
_CHUNKS_KEPT = 1 << 16


def local_chunk(t: torch.Tensor, key: str) -> tuple[torch.Tensor, DistInfo] | None:
    """For a DTensor, its local chunk (a view) and where it lies; ``None`` for any other
    tensor. Raises :class:`UnsupportedStateError` for a placement lazyckpt cannot store."""
    legacy = sys.modules.get("torch.distributed._shard.sharded_tensor.api")
    if legacy is not None and isinstance(t, legacy.ShardedTensor):
        return _sharded_tensor_chunk(t, key)
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or not isinstance(t, module.DTensor):
        return None  # DTensor's module was never imported: this cannot be one
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = t.device_mesh
    local = t.to_local().detach()
    gshape = tuple(t.shape)
    try:
        # the same mesh, placements and shapes give the same chunk: a model's layers share
        # them, and every snapshot of a run asks again (torch's own computation of it is
        # about a hundred microseconds a tensor)
        cache_key: tuple[Any, ...] | None = (id(mesh), t.placements, gshape, tuple(local.shape))
        hash(cache_key)
    except TypeError:  # a placement that cannot be hashed: computed each time
        cache_key = None
    hit = _CHUNKS.get(cache_key) if cache_key is not None else None
    if hit is not None and hit[0] is mesh:
        view = local.as_subclass(_LocalChunk)
        view._owner = t
        return view, hit[1]
    placements = tuple(_placement_name(p, key) for p in t.placements)
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise UnsupportedStateError(
            f"DTensor {key!r} lives on a device mesh this rank is not part of; snapshot only "
            "the state this rank holds"
        )
    shape, offset = compute_local_shape_and_global_offset(gshape, mesh, t.placements)
    if tuple(local.shape) != tuple(shape):
        raise UnsupportedStateError(
            f"DTensor {key!r}: rank {tuple(coordinate)} of its mesh holds "
            f"{list(local.shape)} of {list(gshape)}, not the {list(shape)} its placements "
            f"{list(t.placements)} give; a DTensor built with from_local(..., run_check=False) "
            "from chunks of other shapes cannot be described"
        )
    # the ranks holding this same chunk: equal coordinates on every dimension but the
    # Replicate ones
    ranks = mesh.mesh
    index = []
    for dim, p in enumerate(t.placements):
        index.append(slice(None) if isinstance(p, Replicate) else coordinate[dim])
    replicas = tuple(sorted(int(r) for r in ranks[tuple(index)].flatten().tolist()))
    view = local.as_subclass(_LocalChunk)
    view._owner = t
    info = DistInfo(
        gshape,
        tuple(int(o) for o in offset),
        placements,
        mesh_size=mesh.size(),
        coordinate=tuple(int(c) for c in coordinate),
        replicas=replicas,
    )
    if cache_key is not None:
        if len(_CHUNKS) >= _CHUNKS_KEPT:
            _CHUNKS.clear()
        _CHUNKS[cache_key] = (mesh, info)  # the mesh held, so its id is not reused
    return view, info


def _sharded_tensor_chunk(t: Any, key: str) -> tuple[torch.Tensor, DistInfo]:
    """A legacy ``ShardedTensor`` (FSDP1's ``SHARDED_STATE_DICT``, accelerate's FSDP1
    default): its one local shard, where its own metadata says it lies. Its shards are
    disjoint blocks, each held by one rank. The shard's tensor is returned detached (it
    shares the shard's version counter, so a write through it, or through the flat
    parameter it views, fails the capture's check as on any tensor)."""
    shards = t.local_shards()
    gshape = tuple(int(n) for n in t.metadata().size)
    if len(shards) != 1:
        raise UnsupportedStateError(
            f"ShardedTensor {key!r} has {len(shards)} local shards on this rank; lazyckpt "
            "stores one block per rank (what ChunkShardingSpec and FSDP1 give). Save it as a "
            "DTensor (get_model_state_dict from torch.distributed.checkpoint.state_dict) or "
            "as a full state dict"
        )
    meta = shards[0].metadata
    offset = tuple(int(o) for o in meta.shard_offsets)
    shape = tuple(int(n) for n in meta.shard_sizes)
    local = shards[0].tensor.detach()
    if tuple(local.shape) != shape:
        raise UnsupportedStateError(
            f"ShardedTensor {key!r}: its local shard is {list(local.shape)} but its metadata "
            f"says {shape}"
        )
    split = [d for d in range(len(gshape)) if shape[d] != gshape[d]]
    if len(split) > 1:
        raise UnsupportedStateError(
            f"ShardedTensor {key!r}: its local shard {list(shape)} at {list(offset)} is a "
            f"block of {list(gshape)} split on several dimensions; lazyckpt stores "
            "shardings along one dimension"
        )
    dim = split[0] if split else int(getattr(t.sharding_spec(), "dim", 0) or 0)
    everyone = [tuple(int(o) for o in m.shard_offsets) for m in t.metadata().shards_metadata]
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    info = DistInfo(
        gshape,
        offset,
        (f"shard({dim})",),
        mesh_size=len(everyone),
        coordinate=(everyone.index(offset) if offset in everyone else 0,),
        replicas=(rank,),
    )
    return local, info


def replicated_info(t: torch.Tensor) -> DistInfo:
    """What a plain tensor marked :class:`Replicated` records: the whole, replicated."""
    return DistInfo(tuple(t.shape), (0,) * t.dim(), ("replicate",))


def writer_of(key: str, world_size: int) -> int:
    """A rank for ``key`` among ``world_size``: stable across runs and ranks (it depends on
    the key only), spread over the ranks. Ties of :func:`balance_writers` start here."""
    return crc32c.crc32c(key.encode()) % world_size


def balance_writers(chunks: list[tuple[str, int, tuple[int, ...]]]) -> list[int]:
    """The writer of each chunk several ranks hold, for ``(key, nbytes, replicas)`` listed
    in the order of the state walk, the same list on every rank of a replica group.

    Largest first (ties by key), each chunk goes to the member of its group that has been
    given the fewest bytes so far (ties: the member the key hashes to, then the next ones),
    counted per group: every member sees the same chunks of its group, so every member makes
    the same choice without a message, in every run, and each group's bytes spread evenly
    over its members (within the largest chunk of the group)."""
    given: dict[tuple[tuple[int, ...], int], int] = {}
    out = [0] * len(chunks)
    order = sorted(range(len(chunks)), key=lambda i: (-chunks[i][1], chunks[i][0]))
    for i in order:
        key, nbytes, group = chunks[i]
        first = writer_of(key, len(group))
        members = [group[(first + j) % len(group)] for j in range(len(group))]
        writer = min(members, key=lambda r: given.get((group, r), 0))
        given[(group, writer)] = given.get((group, writer), 0) + nbytes
        out[i] = writer
    return out
