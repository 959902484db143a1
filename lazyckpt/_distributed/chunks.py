"""What a distributed tensor looks like in a snapshot: leaf helpers, nothing about restoring.

A DTensor on a 1-D device mesh is captured as its local chunk (:func:`local_chunk`), and
the manifest records where that chunk lies in the global tensor (:class:`DistInfo`). A
tensor marked replicated (:class:`ReplicatedMarker`, the base of the public
:class:`lazyckpt.Replicated`) is written by one rank only (:func:`writer_of`).

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
        placements: ``("shard(d)",)`` or ``("replicate",)``: one per mesh dimension.
        mesh_size: ranks of the DTensor's mesh (``None`` for a plain tensor).
        coordinate: this rank's place on that mesh.
        writer: for a replicated tensor, the rank that stores it (set by
            :func:`assign_writers`); ``None`` means this rank stores it.
    """

    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    placements: tuple[str, ...]
    mesh_size: int | None = None
    coordinate: int | None = None
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


def _chunk(length: int, parts: int, index: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of chunk ``index`` when ``length`` rows are cut into ``parts``
    the way ``torch.chunk`` (and so ``Shard``) cuts them; trailing chunks may be empty."""
    size = -(-length // parts)
    start = min(index * size, length)
    return start, min(start + size, length)


def _shard_dim(placements: tuple[str, ...]) -> int | None:
    (p,) = placements
    return None if p == "replicate" else int(p[len("shard(") : -1])


def local_chunk(t: torch.Tensor, key: str) -> tuple[torch.Tensor, DistInfo] | None:
    """For a DTensor, its local chunk (a view) and where it lies; ``None`` for any other
    tensor. Raises :class:`UnsupportedStateError` for a layout lazyckpt cannot reshard."""
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or not isinstance(t, module.DTensor):
        return None  # DTensor's module was never imported: this cannot be one
    from torch.distributed.tensor import Replicate, Shard

    mesh = t.device_mesh
    if mesh.ndim != 1:
        raise UnsupportedStateError(
            f"DTensor {key!r} lives on a {mesh.ndim}-D device mesh; lazyckpt checkpoints "
            "DTensors on 1-D meshes only (FSDP2 fully_shard, or Shard/Replicate over all "
            "ranks). Use torch.distributed.checkpoint for 2-D (HSDP, TP) layouts."
        )
    (placement,) = t.placements
    if type(placement) is Shard:
        dim = placement.dim
        placements: tuple[str, ...] = (f"shard({dim})",)
    elif isinstance(placement, Replicate):
        dim = None
        placements = ("replicate",)
    else:
        raise UnsupportedStateError(
            f"DTensor {key!r} has placement {placement}; lazyckpt supports Shard(d) and "
            "Replicate (redistribute a Partial tensor first)"
        )
    size, coordinate = mesh.size(), mesh.get_local_rank()
    local = t.to_local().detach()
    gshape = tuple(t.shape)
    offset = [0] * len(gshape)
    expected = list(gshape)
    if dim is not None:
        start, stop = _chunk(gshape[dim], size, coordinate)
        offset[dim], expected[dim] = start, stop - start
    if list(local.shape) != expected:
        raise UnsupportedStateError(
            f"DTensor {key!r}: rank {coordinate} holds {list(local.shape)} of "
            f"{list(gshape)}, not the torch.chunk split {expected}; uneven sharding is "
            "not supported"
        )
    view = local.as_subclass(_LocalChunk)
    view._owner = t
    info = DistInfo(gshape, tuple(offset), placements, mesh_size=size, coordinate=coordinate)
    return view, info


def replicated_info(t: torch.Tensor) -> DistInfo:
    """What a plain tensor marked :class:`Replicated` records: the whole, replicated."""
    return DistInfo(tuple(t.shape), (0,) * t.dim(), ("replicate",))


def writer_of(key: str, world_size: int) -> int:
    """The rank that writes replicated tensor ``key``: stable across runs and ranks (it
    depends on the key only), and spread evenly over the ranks."""
    return crc32c.crc32c(key.encode()) % world_size
