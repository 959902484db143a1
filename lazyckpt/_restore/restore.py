"""Restoring a snapshot: from the fastest tier that has a good copy, shard by shard.

For each shard the restore walks its own small state table (``_tiering.states.RESTORE_TABLE``):
PENDING, READING from the next tier that holds the step, then VERIFIED when the crc32c
matches the manifest, or back to PENDING for the next tier on a bad or missing copy, and
EXHAUSTED when no tier is left (a :class:`CorruptionError` naming the tensors and tiers).

Bytes go straight into the destination tensor when it is a contiguous CPU tensor (an
``into=`` target or a new tensor); otherwise through a temporary buffer and ``copy_``.

An ``into=`` target is checked against the snapshot before any byte is read
(:func:`align_into`, in ``_restore.keys``: wrapper prefixes are mapped there; the
optimizers' parameter groups and state shapes, :func:`check_optimizers`; each tensor's
shape and dtype, ``_Destinations``) and the restored state is loaded into it at the end
(:func:`apply_into`, in ``_restore.into``).
Verifying a step without restoring it is ``_restore.verify``.
"""


from __future__ import annotations

import asyncio
import ctypes
import warnings
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Mapping,
    MutableMapping,
    Sequence,
)
from typing import Any

import torch

from .._capture.optimizers import check_optimizer_state
from .._errors import (
    ConfigurationError,
    CorruptionError,
    LazyCkptError,
    SnapshotNotFoundError,
    TierError,
    first_error,
)
from .._format.entries import ShardMeta, TensorMeta
from .._format.manifest import Manifest
from .._format.values import decode_tree
from .._format.walk import JSON, _escape, walk_state
from .._gcpause import collector_paused
from .._tiering.interface import SupportsChecksummedRead, Tier
from .device import restore_into
from .fetch import (
    Checksum,
    byte_view,
    find_step,
    read_verified,
    thread_checksum,
)
from .into import _join, _mismatch, _stateful, apply_into
from .keys import _items, _key_of, align_into

__all__ = ["check_optimizers", "read_manifest", "restore_lazily", "restore_state"]


async def read_manifest(
    tiers: Sequence[Tier], step: int | None
) -> tuple[Manifest, list[Tier], list[Exception]]:
    """The manifest of ``step`` (the latest committed if None), the tiers holding it (fastest
    first), and the problems met on the way."""
    step, sources = await find_step(tiers, step)
    problems: list[Exception] = []
    for tier in sources:
        try:
            return await tier.read_manifest(step), sources, problems
        except (CorruptionError, TierError, SnapshotNotFoundError) as exc:
            problems.append(exc)
    raise CorruptionError(
        f"step {step}: no tier holds a readable manifest: " + "; ".join(map(str, problems))
    )


def check_optimizers(manifest: Manifest, into: Any) -> None:
    """Check every torch optimizer in the mappings of ``into`` against its state in
    ``manifest`` (:func:`check_optimizer_state`) before anything is read: torch's own
    ``load_state_dict`` would refuse a different number of parameters only at the end, after
    the rest of ``into`` was loaded. ``manifest``: as :func:`align_into` returned it."""
    if into is None:
        return
    metas: list[Any] = list(manifest.tensors)  # each tensor stands in as its entry (a shape)
    _check_node(manifest.tree, into, "", metas)


def _check_node(node: JSON, into: Any, path: str, metas: list[Any]) -> None:
    if type(into) is not dict and (not isinstance(into, MutableMapping) or _stateful(into)):
        return
    found = _items(node)
    if found is None:
        return
    for k_node, v_node in found[0]:
        k = _key_of(k_node)
        if k not in into:
            continue
        target = into[k]
        if isinstance(target, torch.Tensor):  # the usual leaf: nothing below it to check
            continue
        if isinstance(target, torch.optim.Optimizer):
            try:
                saved = decode_tree(v_node, metas, allow_pickle=False)
            except LazyCkptError:
                continue  # pickled or damaged: the restore itself refuses or reports it
            check_optimizer_state(target, saved, _join(path, k))
        else:
            _check_node(v_node, target, _join(path, k), metas)


def _empty(meta: TensorMeta) -> torch.Tensor:
    dtype = meta.torch_dtype
    if dtype is not torch.complex32:
        return torch.empty(meta.shape, dtype=dtype)
    # only here: entering catch_warnings costs more than the allocation of a small tensor
    with warnings.catch_warnings():  # torch calls complex32 "experimental"; it round-trips
        warnings.simplefilter("ignore", UserWarning)
        return torch.empty(meta.shape, dtype=dtype)


# from this size a new tensor is allocated at the tiers' read alignment: below it, the bounce
# copy of a direct read costs less than what the alignment adds to the tensor's storage
_ALIGNED_FROM = 1 << 20


def _new_tensor(meta: TensorMeta, align: int) -> torch.Tensor:
    """A new tensor for ``meta``, empty: where it is at least ``_ALIGNED_FROM`` bytes, its
    bytes start at a multiple of ``align`` (the tiers' read alignment: a read past the page
    cache then lands in it without a bounce copy; its storage is then up to ``align`` bytes
    longer than the tensor).

    Transparent huge pages were tried for these tensors and left out: in a fresh process
    on the 2-vCPU VM they cost more CPU time than 4 KiB pages, and far more at times
    (docs/design.md, "Reading a shard back, cold")."""
    nbytes = meta.nbytes
    if nbytes < _ALIGNED_FROM or align <= 1:
        return _empty(meta)
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    skip = -raw.data_ptr() % align
    if skip % meta.itemsize:  # an allocator aligning less than the item size: plain
        return _empty(meta)
    flat = raw[skip : skip + nbytes]
    if meta.torch_dtype is not torch.complex32:
        return flat.view(meta.torch_dtype).view(meta.shape)
    with warnings.catch_warnings():  # see _empty
        warnings.simplefilter("ignore", UserWarning)
        return flat.view(meta.torch_dtype).view(meta.shape)


def _read_alignment(sources: Sequence[Tier]) -> int:
    """The largest read alignment the tiers ask for (:class:`SupportsChecksummedRead`)."""
    return max(
        (t.read_alignment for t in sources if isinstance(t, SupportsChecksummedRead)), default=1
    )


class _Buffers:
    """The buffers shards that are not read in place (packed small tensors, or a chunk of a
    target that is not contiguous host memory) are read into: kept for the next shard
    instead of freed, so that their pages are faulted in once per restore, not once per
    shard, and allocated at the tiers' read alignment (a read past the page cache lands in
    them directly)."""

    def __init__(self, align: int, keep: int) -> None:
        self.align = max(align, 1)
        self.keep = keep
        self.free: list[torch.Tensor] = []

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes; give it back with :meth:`give`."""
        for i, buf in enumerate(self.free):
            if buf.numel() >= nbytes:
                return self.free.pop(i)
        raw = torch.empty(nbytes + self.align, dtype=torch.uint8)
        skip = -raw.data_ptr() % self.align
        return raw[skip : skip + nbytes]

    def give(self, buf: torch.Tensor) -> None:
        if len(self.free) < self.keep:
            self.free.append(buf)


class _Destinations:
    """Where each tensor of the manifest goes; ``align``: see :func:`_new_tensor`."""

    def __init__(
        self,
        manifest: Manifest,
        into: Any,
        map_location: torch.device | str | None,
        align: int = 1,
    ) -> None:
        self.manifest = manifest
        self.device = torch.device(map_location) if map_location is not None else None
        self.buffers = _Buffers(align, keep=4)
        targets: dict[str, torch.Tensor] = {}
        self.wrappers: dict[int, torch.Tensor] = {}  # tensor index -> DTensor target
        # tensor index -> the into= tensor itself: returned as it is, so that apply_into
        # finds the very object it holds and copies nothing
        self.given: dict[int, torch.Tensor] = {}
        self.on_device = False  # a target is device memory (restored by restore_into)
        dtensors: dict[str, torch.Tensor] = {}
        if into is not None:
            _, refs = walk_state(into, allow_pickle=False, lenient=True)
            targets = {r.key: r.tensor for r in refs}  # a DTensor's local chunk
            dtensors = {r.key: r.dtensor for r in refs if r.dtensor is not None}
        self.final: list[torch.Tensor | None] = []
        self.staging: list[torch.Tensor | None] = []  # contiguous CPU tensor read into
        dtypes: dict[str, torch.dtype] = {}  # by name: one lookup per dtype, not per tensor
        for meta in manifest.tensors:
            mode = meta.mode
            if mode == "alias":
                self.final.append(None)
                self.staging.append(None)
                continue
            target = targets.get(meta.key) if targets else None
            if target is None and mode == "pack":  # a new small tensor: most of a large state
                dtype = dtypes.get(meta.dtype)
                if dtype is None:
                    dtype = dtypes[meta.dtype] = meta.torch_dtype
                if dtype is torch.complex32:
                    staging = _empty(meta)
                else:
                    staging = torch.empty(meta.shape, dtype=dtype)
                self.final.append(staging)
                self.staging.append(staging)
                continue
            if target is not None and (
                tuple(target.shape) != meta.shape or target.dtype != meta.torch_dtype
            ):
                raise ConfigurationError(
                    f"into[{meta.key!r}] is {target.dtype}{list(target.shape)} but the "
                    f"checkpoint has {meta.dtype}{list(meta.shape)}"
                )
            if meta.key in dtensors:  # its local chunk is filled; the state holds the DTensor
                self.wrappers[len(self.final)] = dtensors[meta.key]
            if target is not None:
                self.given[len(self.final)] = target
                # detached only where autograd would refuse the in-place write: a detach
                # costs about a microsecond, on every tensor of a large state
                final = target.detach() if target.requires_grad else target
                device = final.device.type
                if device == "cuda":
                    self.on_device = True
                staging = final if device == "cpu" and final.is_contiguous() else _empty(meta)
            else:
                staging = _new_tensor(meta, align) if mode != "pack" else _empty(meta)
                final = staging
            self.final.append(final)
            self.staging.append(staging)

    def finish(self) -> list[torch.Tensor]:
        """Move staged bytes to their final tensors; resolve aliases."""
        out: list[torch.Tensor] = []
        for i, meta in enumerate(self.manifest.tensors):
            if meta.alias_of is not None:
                out.append(out[meta.alias_of])
                continue
            final, staging = self.final[i], self.staging[i]
            assert final is not None and staging is not None
            if final is not staging:
                final.copy_(staging)
            given = self.given.get(i)
            if given is not None:  # filled in place (a DTensor target: through its chunk)
                out.append(self.wrappers.get(i, given))
                continue
            if self.device is not None and self.device != final.device:
                final = final.to(self.device)
            out.append(final)
        return out


async def _restore_shard(
    manifest: Manifest,
    shard: ShardMeta,
    sources: Sequence[Tier],
    dests: _Destinations,
    problems: list[Exception],
    checksum: Checksum,
) -> None:
    direct = None
    if shard.kind == "chunk":  # one piece of one tensor: read straight into its bytes
        (seg,) = shard.segments
        staging = dests.staging[seg.tensor]
        assert staging is not None
        start, nbytes = manifest.segment_span(seg)
        direct = byte_view(staging)[start : start + nbytes]
    if direct is not None:
        await read_verified(manifest, shard, sources, direct, checksum=checksum, problems=problems)
        return
    whole = dests.buffers.take(shard.length)
    try:
        buffer = whole[: shard.length]
        await read_verified(
            manifest, shard, sources, byte_view(buffer), checksum=checksum, problems=problems
        )
        _unpack(manifest, shard, buffer, dests)
    finally:
        dests.buffers.give(whole)


def _unpack(
    manifest: Manifest, shard: ShardMeta, buffer: torch.Tensor, dests: _Destinations
) -> None:
    """Copy each segment of a shard read into ``buffer`` to its staging tensor."""
    tensors, all_staging = manifest.tensors, dests.staging
    base = buffer.data_ptr()
    for seg in shard.segments:
        meta = tensors[seg.tensor]
        staging = all_staging[seg.tensor]
        assert staging is not None
        if meta.mode == "pack":  # the usual case, thousands per shard
            # a staging tensor is contiguous host memory of the tensor's size, and the
            # manifest's decoder checked that the segment lies inside the shard: one
            # memmove, where three tensor operations cost some 10 µs per tiny tensor
            ctypes.memmove(staging.data_ptr(), base + seg.offset, staging.nbytes)
            continue
        manifest.tensor_part(seg, staging).copy_(manifest.shard_part(seg, buffer))


async def restore_state(
    manifest: Manifest,
    sources: Sequence[Tier],
    *,
    into: Any,
    map_location: torch.device | str | None,
    allow_pickle: bool,
    concurrency: int = 4,
    checksum: Checksum = thread_checksum,
) -> Any:
    """Read every shard of ``manifest`` (falling back tier by tier) and rebuild the state;
    ``checksum`` computes each shard's crc32c (the Checkpointer's checksum pool)."""
    if manifest.pickled and not allow_pickle:
        decode_tree(manifest.tree, [None] * len(manifest.tensors), allow_pickle=False)
    with collector_paused():  # a few objects per tensor, none cyclic: see _gc.py
        manifest = align_into(manifest, into)
        check_optimizers(manifest, into)
        dests = _Destinations(manifest, into, map_location, _read_alignment(sources))
    problems: list[Exception] = []
    shards: Sequence[ShardMeta] = manifest.shards
    if dests.on_device:  # device targets: in place, host to device
        await restore_into(
            manifest, sources, dests.final, concurrency=concurrency, checksum=checksum
        )
        dests.staging = list(dests.final)  # every tensor is filled: nothing left to copy
        shards = ()

    await _read_shards(manifest, shards, sources, dests, problems, concurrency, checksum)
    with collector_paused():
        tensors = dests.finish()
        state = decode_tree(manifest.tree, tensors, allow_pickle=allow_pickle)
    if into is not None:
        apply_into(into, state)  # outside the pause: it runs the objects' load_state_dict
        return into
    return state


async def restore_lazily(
    manifest: Manifest,
    sources: Sequence[Tier],
    *,
    into: Mapping[Any, Any],
    deferred: Collection[Any],
    map_location: torch.device | str | None,
    allow_pickle: bool,
    concurrency: int = 4,
    checksum: Checksum = thread_checksum,
) -> Callable[[], Awaitable[None]] | None:
    """Restore everything but the top-level entries ``deferred`` of ``into`` now, and
    return the coroutine function that restores those (the guarded optimizers' state).

    The shards holding any tensor outside ``deferred`` are read first and those tensors
    loaded into ``into``; the rest is left for the returned function, which loads only the
    deferred entries (so it never overwrites what the caller changed meanwhile: a forward
    pass updates BatchNorm statistics). Returns None, having read nothing, where the
    restore cannot be split (device targets are restored in one pass): restore eagerly."""
    if manifest.pickled and not allow_pickle:
        decode_tree(manifest.tree, [None] * len(manifest.tensors), allow_pickle=False)
    manifest = align_into(manifest, into)
    check_optimizers(manifest, into)
    dests = _Destinations(manifest, into, map_location, _read_alignment(sources))
    if dests.on_device:
        return None
    later = {_escape(str(k)) for k in deferred}
    tensors = manifest.tensors
    first = {
        i for i, meta in enumerate(tensors) if meta.key.split("/", 1)[0] not in later
    }
    for i in sorted(first):  # an early tensor aliasing a later one needs the later one now
        target = tensors[i].alias_of
        while target is not None:
            first.add(target)
            target = tensors[target].alias_of
    now = [sh for sh in manifest.shards if any(seg.tensor in first for seg in sh.segments)]
    rest = [sh for sh in manifest.shards if not any(seg.tensor in first for seg in sh.segments)]
    problems: list[Exception] = []
    done: list[Any] = [None] * len(tensors)
    await _read_shards(manifest, now, sources, dests, problems, concurrency, checksum)
    _finish_some(dests, done, first)
    state = decode_tree(manifest.tree, done, allow_pickle=allow_pickle)
    lacking = [k for k in deferred if k not in state]
    if lacking:
        raise _mismatch("", "the mapping", lacking, [])
    _apply_part(into, state, [k for k in into if k not in deferred])

    async def finish() -> None:
        await _read_shards(manifest, rest, sources, dests, problems, concurrency, checksum)
        _finish_some(dests, done, set(range(len(tensors))) - first)
        full = decode_tree(manifest.tree, done, allow_pickle=allow_pickle)
        _apply_part(into, full, [k for k in into if k in deferred])

    return finish


def _apply_part(into: Mapping[Any, Any], restored: Mapping[Any, Any], keys: Sequence[Any]) -> None:
    """:func:`apply_into` for the top-level entries ``keys`` of ``into`` only (with the same
    key checks below them): a lazy restore loads its two parts one after the other."""
    part = {k: into[k] for k in keys}
    apply_into(part, {k: restored[k] for k in keys if k in restored})
    if isinstance(into, MutableMapping):
        for k, v in part.items():  # plain values are replaced, not loaded in place
            if into[k] is not v:
                into[k] = v


async def _read_shards(
    manifest: Manifest,
    shards: Sequence[ShardMeta],
    sources: Sequence[Tier],
    dests: _Destinations,
    problems: list[Exception],
    concurrency: int,
    checksum: Checksum,
) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(shard: ShardMeta) -> None:
        async with sem:
            await _restore_shard(manifest, shard, sources, dests, problems, checksum)

    try:
        async with asyncio.TaskGroup() as tg:
            for shard in shards:
                tg.create_task(one(shard))
    except ExceptionGroup as group:
        raise first_error(group) from None
    finally:
        dests.buffers.free.clear()  # not held while a lazy restore waits for its second part


def _finish_some(dests: _Destinations, out: list[Any], indices: Collection[int]) -> None:
    """:meth:`_Destinations.finish` for the tensors ``indices`` only, into ``out``."""
    tensors = dests.manifest.tensors
    for i in sorted(indices):  # an alias refers to an earlier tensor
        meta = tensors[i]
        if meta.alias_of is not None:
            out[i] = out[meta.alias_of]
            continue
        final, staging = dests.final[i], dests.staging[i]
        assert final is not None and staging is not None
        if final is not staging:
            final.copy_(staging)
        elif dests.device is not None and dests.device != final.device:
            final = final.to(dests.device)
        out[i] = dests.wrappers.get(i, final)
