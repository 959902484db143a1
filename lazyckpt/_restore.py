"""Restoring a snapshot: from the fastest tier that has a good copy, shard by shard.

For each shard the restore walks its own small state table (``_state.RESTORE_TABLE``):
PENDING, READING from the next tier that holds the step, then VERIFIED when the crc32c
matches the manifest, or back to PENDING for the next tier on a bad or missing copy, and
EXHAUSTED when no tier is left (a :class:`CorruptionError` naming the tensors and tiers).

Bytes go straight into the destination tensor when it is a contiguous CPU tensor (an
``into=`` target or a new tensor); otherwise through a temporary buffer and ``copy_``.
"""

from __future__ import annotations

import asyncio
import math
import warnings
from collections.abc import Awaitable, Callable, Collection, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import crc32c
import torch

from ._errors import (
    ConfigurationError,
    CorruptionError,
    SnapshotNotFoundError,
    TierError,
)
from ._manifest import Manifest, ShardMeta, TensorMeta
from ._state import RestoreEvent, RestoreState, advance_restore
from ._tier import Tier
from ._tree import Stateful, StatefulValue, _escape, decode_tree, walk_state

__all__ = [
    "VerifyReport",
    "apply_into",
    "committed_steps",
    "read_manifest",
    "restore_lazily",
    "restore_state",
    "verify_step",
]


async def committed_steps(tiers: Sequence[Tier]) -> dict[str, list[int]]:
    """Committed steps per tier; a tier that fails to list is left out (and logged)."""
    results = await asyncio.gather(*(t.steps() for t in tiers), return_exceptions=True)
    listing: dict[str, list[int]] = {}
    for tier, result in zip(tiers, results, strict=True):
        if isinstance(result, BaseException):
            if not isinstance(result, Exception):
                raise result
            continue
        listing[tier.name] = result
    return listing


async def read_manifest(
    tiers: Sequence[Tier], step: int | None
) -> tuple[Manifest, list[Tier], list[Exception]]:
    """The manifest of ``step`` (the latest committed if None), the tiers holding it (fastest
    first), and the problems met on the way."""
    listing = await committed_steps(tiers)
    everywhere = sorted({s for steps in listing.values() for s in steps})
    if step is None:
        if not everywhere:
            raise SnapshotNotFoundError(
                f"no committed snapshot on any tier ({[t.name for t in tiers]})"
            )
        step = everywhere[-1]
    sources = [t for t in tiers if step in listing.get(t.name, [])]
    if not sources:
        raise SnapshotNotFoundError(
            f"step {step} is not committed on any tier; committed steps: {everywhere[-10:]}"
        )
    problems: list[Exception] = []
    for tier in sources:
        try:
            return await tier.read_manifest(step), sources, problems
        except (CorruptionError, TierError, SnapshotNotFoundError) as exc:
            problems.append(exc)
    raise CorruptionError(
        f"step {step}: no tier holds a readable manifest: " + "; ".join(map(str, problems))
    )


def _byte_view(t: torch.Tensor) -> memoryview:
    array = t.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")  # type: ignore[arg-type]


def _empty(meta: TensorMeta) -> torch.Tensor:
    with warnings.catch_warnings():  # torch calls complex32 "experimental"; it round-trips
        warnings.simplefilter("ignore", UserWarning)
        return torch.empty(meta.shape, dtype=meta.torch_dtype)


class _Destinations:
    """Where each tensor of the manifest goes."""

    def __init__(
        self, manifest: Manifest, into: Any, map_location: torch.device | str | None
    ) -> None:
        self.manifest = manifest
        self.device = torch.device(map_location) if map_location is not None else None
        targets: dict[str, torch.Tensor] = {}
        self.wrappers: dict[int, torch.Tensor] = {}  # tensor index -> DTensor target
        dtensors: dict[str, torch.Tensor] = {}
        if into is not None:
            _, refs = walk_state(into, allow_pickle=False, lenient=True)
            targets = {r.key: r.tensor for r in refs}  # a DTensor's local chunk
            dtensors = {r.key: r.dtensor for r in refs if r.dtensor is not None}
        self.final: list[torch.Tensor | None] = []
        self.staging: list[torch.Tensor | None] = []  # contiguous CPU tensor read into
        for meta in manifest.tensors:
            if meta.mode == "alias":
                self.final.append(None)
                self.staging.append(None)
                continue
            target = targets.get(meta.key)
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
                final = target.detach()
                direct = final.device.type == "cpu" and final.is_contiguous()
                staging = final if direct else _empty(meta)
            else:
                staging = _empty(meta)
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
            elif self.device is not None and self.device != final.device:
                final = final.to(self.device)
            out.append(self.wrappers.get(i, final))
        return out


async def read_verified(
    manifest: Manifest,
    shard: ShardMeta,
    sources: Sequence[Tier],
    out: memoryview,
    problems: list[Exception],
) -> bool:
    """Fill ``out`` with the first copy of ``shard`` whose crc32c matches, trying the tiers
    in order (the restore state table); False when no tier has one. Problems are appended."""
    loop = asyncio.get_running_loop()
    state = RestoreState.PENDING
    for tier in sources:
        state = advance_restore(state, RestoreEvent.START_READ)
        try:
            await tier.read_shard(manifest, shard, out)
            crc = await loop.run_in_executor(None, crc32c.crc32c, out)
            if crc != shard.crc32c:
                raise CorruptionError(
                    f"tier {tier.name!r}: shard {shard.index} of rank {manifest.rank}, step "
                    f"{manifest.step} fails its checksum (holds {_keys(manifest, shard)})"
                )
        except (CorruptionError, TierError) as exc:
            problems.append(exc)
            state = advance_restore(state, RestoreEvent.BAD_COPY)
            continue
        advance_restore(state, RestoreEvent.CHECKSUM_OK)
        return True
    advance_restore(state, RestoreEvent.NO_MORE_TIERS)
    return False


def _segment_target(dest: torch.Tensor, meta: TensorMeta, start: int, stop: int) -> torch.Tensor:
    if meta.mode == "rows":
        return dest[start:stop]
    if meta.mode == "flat":
        return dest.reshape(-1)[start:stop]
    return dest


async def _restore_shard(
    manifest: Manifest,
    shard: ShardMeta,
    sources: Sequence[Tier],
    dests: _Destinations,
    problems: list[Exception],
) -> None:
    direct = None
    if shard.kind == "chunk":
        (seg,) = shard.segments
        staging = dests.staging[seg.tensor]
        assert staging is not None
        meta = manifest.tensors[seg.tensor]
        unit = meta.itemsize * (math.prod(meta.shape[1:]) if meta.mode == "rows" else 1)
        direct = _byte_view(staging)[seg.start * unit : seg.stop * unit]
    buffer = None
    if direct is None:
        buffer = torch.empty(shard.length, dtype=torch.uint8)
        out = _byte_view(buffer)
    else:
        out = direct
    if not await read_verified(manifest, shard, sources, out, problems):
        raise CorruptionError(
            f"step {manifest.step}: no tier holds a good copy of shard {shard.index} "
            f"({_keys(manifest, shard)}); tried {[t.name for t in sources]}"
        )
    if buffer is not None:
        for seg in shard.segments:
            meta = manifest.tensors[seg.tensor]
            nbytes = manifest.segment_nbytes(seg)
            piece = buffer[seg.offset : seg.offset + nbytes].view(meta.torch_dtype)
            piece = piece.view(manifest.segment_shape(seg))
            staging = dests.staging[seg.tensor]
            assert staging is not None
            _segment_target(staging, meta, seg.start, seg.stop).copy_(piece)


def _keys(manifest: Manifest, shard: ShardMeta) -> str:
    keys = [manifest.tensors[s.tensor].key for s in shard.segments]
    return ", ".join(repr(k) for k in keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")


async def restore_state(
    manifest: Manifest,
    sources: Sequence[Tier],
    *,
    into: Any,
    map_location: torch.device | str | None,
    allow_pickle: bool,
    concurrency: int = 4,
) -> Any:
    """Read every shard of ``manifest`` (falling back tier by tier) and rebuild the state."""
    if manifest.pickled and not allow_pickle:
        decode_tree(manifest.tree, [None] * len(manifest.tensors), allow_pickle=False)
    dests = _Destinations(manifest, into, map_location)
    problems: list[Exception] = []
    sem = asyncio.Semaphore(concurrency)
    shards: Sequence[ShardMeta] = manifest.shards
    if any(t is not None and t.device.type == "cuda" for t in dests.final):
        from ._cuda import restore_into  # device targets: in place, host to device

        await restore_into(manifest, sources, dests.final, concurrency=concurrency)
        dests.staging = list(dests.final)  # every tensor is filled: nothing left to copy
        shards = ()

    async def one(shard: ShardMeta) -> None:
        async with sem:
            await _restore_shard(manifest, shard, sources, dests, problems)

    try:
        async with asyncio.TaskGroup() as tg:
            for shard in shards:
                tg.create_task(one(shard))
    except ExceptionGroup as group:
        first = group.exceptions[0]
        while isinstance(first, ExceptionGroup):
            first = first.exceptions[0]
        raise first from None
    tensors = dests.finish()
    state = decode_tree(manifest.tree, tensors, allow_pickle=allow_pickle)
    if into is not None:
        apply_into(into, state)
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
    dests = _Destinations(manifest, into, map_location)
    if any(t is not None and t.device.type == "cuda" for t in dests.final):
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
    await _read_shards(manifest, now, sources, dests, problems, concurrency)
    _finish_some(dests, done, first)
    state = decode_tree(manifest.tree, done, allow_pickle=allow_pickle)
    apply_into(into, {k: v for k, v in state.items() if k not in deferred})

    async def finish() -> None:
        await _read_shards(manifest, rest, sources, dests, problems, concurrency)
        _finish_some(dests, done, set(range(len(tensors))) - first)
        full = decode_tree(manifest.tree, done, allow_pickle=allow_pickle)
        apply_into(into, {k: v for k, v in full.items() if k in deferred})

    return finish


async def _read_shards(
    manifest: Manifest,
    shards: Sequence[ShardMeta],
    sources: Sequence[Tier],
    dests: _Destinations,
    problems: list[Exception],
    concurrency: int,
) -> None:
    sem = asyncio.Semaphore(concurrency)

    async def one(shard: ShardMeta) -> None:
        async with sem:
            await _restore_shard(manifest, shard, sources, dests, problems)

    try:
        async with asyncio.TaskGroup() as tg:
            for shard in shards:
                tg.create_task(one(shard))
    except ExceptionGroup as group:
        first = group.exceptions[0]
        while isinstance(first, ExceptionGroup):
            first = first.exceptions[0]
        raise first from None


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


def apply_into(into: Any, restored: Any, key: str = "") -> None:
    """Load ``restored`` into ``into`` in place: tensors were already copied into; Stateful
    objects get ``load_state_dict``; other values of a mutable mapping are replaced."""
    if isinstance(into, Stateful) and not isinstance(into, Mapping):
        into.load_state_dict(dict(restored) if isinstance(restored, StatefulValue) else restored)
        return
    if not isinstance(into, MutableMapping) or not isinstance(restored, Mapping):
        raise ConfigurationError(
            f"cannot restore into {type(into).__qualname__} at {key or '<root>'!r}; "
            "into= takes a mutable mapping of tensors, Stateful objects and values"
        )
    for k, value in restored.items():
        current = into.get(k)
        child = f"{key}/{k}" if key else str(k)
        if isinstance(current, torch.Tensor):
            if isinstance(value, torch.Tensor) and value is not current:
                current.copy_(value)
        elif (isinstance(current, Stateful) and not isinstance(current, Mapping)) or (isinstance(current, MutableMapping) and isinstance(value, Mapping)):
            apply_into(current, value, child)
        else:
            into[k] = dict(value) if isinstance(value, StatefulValue) else value



@dataclass
class VerifyReport:
    """What :meth:`Checkpointer.verify` found: per tier, the problems with one step.

    ``problems[tier]`` is empty when every shard of the step on that tier matched its
    checksum. ``ok`` is true when at least one tier holds a complete good copy.
    """

    step: int
    problems: dict[str, list[str]] = field(default_factory=dict)
    shards: int = 0
    bytes: int = 0

    @property
    def ok(self) -> bool:
        return any(not p for p in self.problems.values())

    @property
    def damaged_tiers(self) -> list[str]:
        return [name for name, p in self.problems.items() if p]


async def verify_step(tiers: Sequence[Tier], step: int | None) -> VerifyReport:
    """Read every shard of ``step`` on every tier that lists it and check its crc32c."""
    listing = await committed_steps(tiers)
    everywhere = sorted({s for steps in listing.values() for s in steps})
    if step is None:
        if not everywhere:
            raise SnapshotNotFoundError("no committed snapshot on any tier")
        step = everywhere[-1]
    holders = [t for t in tiers if step in listing.get(t.name, [])]
    if not holders:
        raise SnapshotNotFoundError(f"step {step} is not committed on any tier")
    report = VerifyReport(step)
    loop = asyncio.get_running_loop()
    for tier in holders:
        problems = report.problems.setdefault(tier.name, [])
        try:
            manifest = await tier.read_manifest(step)
        except (CorruptionError, TierError, SnapshotNotFoundError) as exc:
            problems.append(f"manifest: {exc}")
            continue
        report.shards = len(manifest.shards)
        report.bytes = sum(s.length for s in manifest.shards)
        for shard in manifest.shards:
            buf = bytearray(shard.length)
            try:
                await tier.read_shard(manifest, shard, memoryview(buf))
            except (CorruptionError, TierError) as exc:
                problems.append(f"shard {shard.index} ({_keys(manifest, shard)}): {exc}")
                continue
            crc = await loop.run_in_executor(None, crc32c.crc32c, buf)
            if crc != shard.crc32c:
                problems.append(
                    f"shard {shard.index} ({_keys(manifest, shard)}): checksum mismatch"
                )
    return report
