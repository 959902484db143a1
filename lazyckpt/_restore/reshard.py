"""Distributed state on restore: replicated tensors written once, resharding onto any layout.

Snapshot
--------
A DTensor on any mesh is captured as its local chunk, recorded by where torch places it in
the global tensor (``_distributed.chunks``); a chunk several ranks hold identically (a
``Replicate`` mesh dimension, a tensor marked :class:`Replicated`) is written by one of them,
chosen so that each replica group's bytes spread evenly (:func:`assign_writers`); the others
record a ``replica`` entry naming that writer. Plain tensors are never assumed identical
across ranks: only the user knows they are.

Restore
-------
On the world size it was saved with, with no replica to fetch and ``into=`` chunks where
they were saved, a rank reads its own manifest and shards only (``_restore.restore.restore_state``).
Otherwise (:func:`restore_resharded`) the job reads each saved rank's manifest once and hands
it to the others (:func:`_saved_manifests`); each rank works out, per tensor, the region of
the global tensor it needs (an N-D box), the saved chunks overlapping it, and the shards
holding them; a shard several ranks need is read by one and sent to the others
(:func:`_read_fills`):

- an ``into=`` DTensor receives its own local chunk, whatever its new layout;
- an ``into=`` plain tensor of the global shape receives the whole tensor;
- without a target, the same world size gives the chunk the rank saved, and a different one
  the full tensor assembled from every saved chunk;
- plain per-rank tensors and values come from saved rank ``rank % saved_world_size``;
  pipeline stages (ranks that saved different keys) are grouped and grafted (:func:`_merge_stages`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from .._distributed.chunks import ReplicatedMarker, balance_writers
from .._distributed.coordinator import Coordinator
from .._errors import (
    ConfigurationError,
    CoordinationError,
    CorruptionError,
    SnapshotNotFoundError,
    StateMismatchError,
    TierError,
    UnsupportedStateError,
    first_error,
)
from .._format.entries import TensorMeta
from .._format.manifest import Manifest
from .._format.values import decode_tree
from .._format.walk import Stateful, TensorRef, walk_state
from .._tiering.interface import SupportsRankManifests, Tier
from .fetch import Checksum, byte_view, committed_steps, read_verified, thread_checksum
from .into import apply_into
from .keys import align_into
from .restore import check_optimizers, read_manifest

log = logging.getLogger("lazyckpt")

__all__ = [
    "Replicated",
    "assign_writers",
    "needs_resharding",
    "read_base_manifest",
    "restore_resharded",
]

Box = tuple[tuple[int, int], ...]  # per dimension, [start, stop) in global coordinates


class Replicated(ReplicatedMarker):
    """Marks part of a state as identical on every rank, so it is written once.

    ``{"model": Replicated(ddp_model.module), "optimizer": optimizer}`` stores the model's
    tensors once across the ranks instead of once per rank, the writes spread over the
    ranks. Only mark what really is identical everywhere (a DDP model, replicated
    buffers): the copy restored is the writer rank's. It wraps a tensor, a mapping or a
    Stateful object, and loads back into it on ``restore(into=...)``.
    """

    def state_dict(self) -> Any:
        """The wrapped value's state (the value itself for a tensor or a mapping)."""
        value = self.value
        if isinstance(value, Stateful) and not isinstance(value, Mapping):
            return value.state_dict()
        return value

    def load_state_dict(self, state_dict: Any, /) -> None:
        """Load restored state into the wrapped value, in place."""
        value = self.value
        if isinstance(value, torch.Tensor):
            if isinstance(state_dict, torch.Tensor) and state_dict is not value:
                value.detach().copy_(state_dict)
        elif isinstance(value, Stateful) and not isinstance(value, Mapping):
            value.load_state_dict(state_dict)
        elif isinstance(value, MutableMapping):
            apply_into(value, state_dict)
        else:
            self.value = state_dict


def assign_writers(refs: Sequence[TensorRef], rank: int, world_size: int, dedup: bool) -> None:
    """Pick the writer of each chunk several ranks hold (only when ``dedup``: every durable
    tier can read other ranks' data), balancing bytes within each group of ranks holding
    the same chunks (:func:`balance_writers`)."""
    if not dedup or world_size == 1:
        return
    shared: list[tuple[int, tuple[int, ...]]] = []
    for i, ref in enumerate(refs):
        info = ref.dist
        if info is None:
            continue
        group = info.replicas if info.replicas is not None else tuple(range(world_size))
        if len(group) < 2:
            continue
        if group[-1] >= world_size or rank not in group:
            raise UnsupportedStateError(
                f"DTensor {ref.key!r} is held by ranks {list(group)}, but the Checkpointer "
                f"runs as rank {rank} of {world_size}: its device mesh must be built over "
                "the default process group the Checkpointer uses"
            )
        shared.append((i, group))
    chunks = [
        (refs[i].key, refs[i].tensor.numel() * refs[i].tensor.element_size(), group)
        for i, group in shared
    ]
    for (i, _), writer in zip(shared, balance_writers(chunks), strict=True):
        ref = refs[i]
        assert ref.dist is not None
        ref.dist = replace(ref.dist, writer=writer)


# -- restore ------------------------------------------------------------------------------


async def read_base_manifest(
    tiers: Sequence[Tier], step: int | None, rank: int, world_size: int
) -> tuple[Manifest, list[Tier]]:
    """This rank's manifest of ``step`` and the tiers holding it; when the step was saved
    by fewer ranks than this rank's number, saved rank ``rank % saved_world``'s."""
    try:
        manifest, sources, _ = await read_manifest(tiers, step)
        return manifest, sources
    except CorruptionError as exc:
        if world_size == 1 or step is None:
            raise
        readers = await _readers(tiers, step)
        if not readers:
            raise
        first = await _read_rank_manifest(readers, step, 0)
        if rank < first.world_size:  # this rank's own manifest should exist: it is damaged
            raise exc from None
        base = first.rank if first.world_size == 1 else rank % first.world_size
        return await _read_rank_manifest(readers, step, base), readers


async def _readers(tiers: Sequence[Tier], step: int) -> list[Tier]:
    listing = await committed_steps(tiers)
    return [
        t for t in tiers if isinstance(t, SupportsRankManifests) and step in listing.get(t.name, [])
    ]


async def _read_rank_manifest(tiers: Sequence[Tier], step: int, rank: int) -> Manifest:
    problems: list[Exception] = []
    for tier in tiers:
        assert isinstance(tier, SupportsRankManifests)
        try:
            return await tier.read_rank_manifest(step, rank)
        except (CorruptionError, TierError, SnapshotNotFoundError) as exc:
            problems.append(exc)
    raise CorruptionError(
        f"step {step}: no tier holds a readable manifest of rank {rank}: "
        + "; ".join(map(str, problems))
    )


async def _saved_manifests(
    base: Manifest,
    sources: Sequence[Tier],
    readers: Sequence[Tier],
    sem: asyncio.Semaphore,
    exchange: Coordinator | None,
    rank: int,
    world_size: int,
) -> dict[int, Manifest]:
    """Every saved rank's manifest of ``base.step`` (``base``: this rank's own, read from
    ``sources``; the others' from ``readers``).

    Alone, a rank reads them all. With the ranks restoring together (``exchange``), the job
    reads each manifest from the tiers once instead of once per rank: the restoring rank
    ``j % world_size`` reads saved rank ``j``'s (its own ``base`` where that came from the
    first reader) and one ``all_gather`` on the control channel hands every rank the others',
    each checked against its own checksum as it is decoded. A manifest its reader could not
    read, or that arrives damaged, is read directly from the tiers by every rank that needs
    it. The parallel file system then sees N manifest reads per restore of an N-rank step,
    not N² (docs/distributed.md, "Modelled: 16 to 16,000 ranks")."""
    saved = base.world_size
    manifests: dict[int, Manifest] = {base.rank: base}

    async def read(r: int) -> Manifest:
        async with sem:
            return await _read_rank_manifest(readers, base.step, r)

    async def read_all(ranks: Sequence[int]) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = {r: tg.create_task(read(r)) for r in ranks}
        except ExceptionGroup as group:
            raise first_error(group) from None
        manifests.update({r: t.result() for r, t in tasks.items()})

    if exchange is None or world_size == 1:
        await read_all([r for r in range(saved) if r != base.rank])
        return manifests
    mine = range(rank, saved, world_size)  # every saved rank has one reader
    sent: dict[int, bytes | None] = {}
    # a manifest differs from tier to tier (a durable tier's refers unchanged shards to the
    # step storing them; the host tier's does not): the others read with the readers, so
    # they get the readers' copy; ``base`` is that copy when it came from the first of them
    base_is_readers = bool(sources) and sources[0] is readers[0]

    async def read_to_send(r: int) -> None:
        try:
            m = base if r == base.rank and base_is_readers else await read(r)
            sent[r] = m.to_json()
            if r != base.rank:  # this rank reads its own shards with its own copy
                manifests[r] = m
        except Exception as exc:  # the others read it themselves
            log.warning(
                "lazyckpt: rank %d could not read saved rank %d's manifest: %s", rank, r, exc
            )
            sent[r] = None

    async with asyncio.TaskGroup() as tg:
        for r in mine:
            tg.create_task(read_to_send(r))
    missing: list[int] = []
    for payload in await exchange.gather(0, sent):
        for r, raw in payload.items():
            if r in manifests:
                continue
            if raw is None:
                missing.append(r)
                continue
            try:
                got = Manifest.from_json(raw, source=f"saved rank {r}'s manifest, as sent")
            except CorruptionError:
                missing.append(r)
                continue
            if got.step != base.step or got.rank != r or got.world_size != saved:
                missing.append(r)
                continue
            manifests[r] = got
    await read_all(missing)
    return manifests


def _targets(into: Any) -> dict[str, TensorRef]:
    if into is None:
        return {}
    _, refs = walk_state(into, allow_pickle=False, lenient=True)
    return {r.key: r for r in refs}


def needs_resharding(manifest: Manifest, into: Any, rank: int, world_size: int) -> bool:
    """Whether restoring ``manifest`` here needs other ranks' data or a new sharding
    (:func:`restore_resharded`), rather than this rank's own shards as saved."""
    if manifest.world_size != world_size or manifest.rank != rank:
        return True
    if any(m.mode == "replica" for m in manifest.tensors):
        return True
    if not any(m.placements for m in manifest.tensors):
        return False  # plain state: nothing to compare into= with
    targets = _targets(into)
    for meta in manifest.tensors:
        if meta.placements is None:
            continue
        ref = targets.get(meta.key)
        if ref is None:
            continue
        region = ref.dist.global_offset if ref.dist is not None else None
        if region != meta.global_offset or tuple(ref.tensor.shape) != meta.shape:
            return True
    return False


@dataclass
class _Wanted:
    """One tensor to rebuild: the global region it covers and where its bytes go."""

    meta: TensorMeta
    region: Box
    staging: torch.Tensor  # contiguous CPU, the region's shape
    final: torch.Tensor
    value: torch.Tensor  # what the restored state holds (a DTensor target itself)


@dataclass(frozen=True)
class _Refused:
    """Sent in place of a rank's needs when it refuses the restore: the others raise too."""

    rank: int
    error: str


@dataclass
class _Piece:
    """The part ``overlap`` of a wanted tensor that saved rank ``rank`` holds."""

    wanted: _Wanted
    rank: int
    overlap: Box


def _box(offset: Sequence[int], shape: Sequence[int]) -> Box:
    return tuple((o, o + n) for o, n in zip(offset, shape, strict=True))


def _intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def _volume(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def _slices(box: Box, origin: Box) -> tuple[slice, ...]:
    return tuple(slice(lo - o, hi - o) for (lo, hi), (o, _) in zip(box, origin, strict=True))


def _region_for(
    meta: TensorMeta, ref: TensorRef | None, base: Manifest, rank: int, world_size: int
) -> Box:
    """The global region this rank restores for a distributed tensor."""
    assert meta.global_shape is not None and meta.global_offset is not None
    full = _box((0,) * len(meta.global_shape), meta.global_shape)
    if ref is not None:
        shape = tuple(ref.tensor.shape)
        if ref.dist is not None and ref.dist.global_shape == meta.global_shape:
            return _box(ref.dist.global_offset, shape)
        if shape == meta.global_shape:
            return full
        if base.world_size == world_size and base.rank == rank and shape == meta.shape:
            return _box(meta.global_offset, shape)
        if ref.dist is not None:
            target = (
                f"a DTensor of global shape {list(ref.dist.global_shape)} placed "
                f"{list(ref.dist.placements)}, this rank's chunk {list(shape)}"
            )
        else:
            target = f"a tensor of shape {list(shape)}"
        raise StateMismatchError(
            f"into[{meta.key!r}] is {target}, but the checkpoint holds a tensor of global "
            f"shape {list(meta.global_shape)} saved placed {list(meta.placements or ())} "
            f"(rank {base.rank}'s chunk: {list(meta.shape)}): the saved layout cannot be "
            "mapped onto it; nothing was loaded",
            key=meta.key,
            missing=[],
            unexpected=[],
        )
    if base.world_size == world_size and base.rank == rank:
        return _box(meta.global_offset, meta.shape)
    return full


def _holders(
    meta: TensorMeta,
    base: Manifest,
    held: Mapping[str, list[tuple[int, Box]]],
    owners: Mapping[str, int] | None = None,
) -> list[tuple[int, Box]]:
    """The saved ranks holding parts of a tensor, with the global box each holds: for a
    distributed tensor, what the saved ranks' manifests record (each box once: of several
    ranks holding the same chunk, the base rank if it is one, else the first)."""
    if meta.placements is None:  # a per-rank tensor: the base rank's own (or, grafted
        # from another pipeline stage, that stage's first rank's)
        owner = base.rank if owners is None else owners.get(meta.key, base.rank)
        return [(owner, _box((0,) * len(meta.shape), meta.shape))]
    found: dict[Box, int] = {}
    for r, box in held.get(meta.key, []):
        if box not in found or r == base.rank:
            found[box] = r
    return [(r, box) for box, r in found.items()]


def _held_boxes(
    manifests: Mapping[int, Manifest], stage_of: Mapping[str, frozenset[int]] | None = None
) -> dict[str, list[tuple[int, Box]]]:
    """Per tensor key, the boxes of the global tensor each saved rank stores itself (only
    from the ranks of the stage the key is restored from, where ``stage_of`` says so)."""
    held: dict[str, list[tuple[int, Box]]] = {}
    seen: dict[str, tuple[int, TensorMeta]] = {}  # the first saved rank's entry, per key
    for r, m in sorted(manifests.items()):
        for meta in m.tensors:
            if stage_of is not None and r not in stage_of.get(meta.key, (r,)):
                continue
            if meta.placements is None:
                continue
            if stage_of is not None and meta.key not in stage_of:
                continue  # another stage's key: this rank restores nothing of it
            first, other = seen.setdefault(meta.key, (r, meta))
            if other.global_shape != meta.global_shape or other.dtype != meta.dtype:
                raise StateMismatchError(
                    f"the saved ranks disagree about the distributed tensor {meta.key!r}: "
                    f"rank {first} saved it as {other.dtype}{list(other.global_shape or ())} "
                    f"placed {list(other.placements or ())}, rank {r} as {meta.dtype}"
                    f"{list(meta.global_shape or ())} placed {list(meta.placements)}; its "
                    "chunks cannot be put together (were the ranks running different "
                    "models?); nothing was loaded",
                    key=meta.key,
                    missing=[],
                    unexpected=[],
                )
            if meta.mode == "replica":
                continue
            assert meta.global_offset is not None
            held.setdefault(meta.key, []).append((r, _box(meta.global_offset, meta.shape)))
    return held


def _stages(manifests: Mapping[int, Manifest]) -> list[frozenset[int]]:
    """The saved ranks grouped by the keys they saved, lowest rank first: one group when
    every rank saved the same keys; one per pipeline stage (or any split where ranks hold
    different parts of the state) otherwise."""
    groups: dict[frozenset[str], set[int]] = {}
    for r, m in sorted(manifests.items()):
        groups.setdefault(frozenset(t.key for t in m.tensors), set()).add(r)
    return sorted((frozenset(g) for g in groups.values()), key=min)


def _merge_stages(
    base: Manifest, manifests: Mapping[int, Manifest], stages: list[frozenset[int]]
) -> tuple[Manifest, dict[str, frozenset[int]], dict[str, int]]:
    """``base`` with the parts of the state only other stages saved grafted into its tree
    (a pipeline stage's own layers, under their own names), for a restore onto another
    layout or into one process. A key several stages saved with their own tensors (a
    positional optimizer state: ``optim/state/0/...`` on every stage) cannot name both: the
    base's stage keeps it, and a warning says how many such keys there are.

    Returns the merged manifest, the stage each key is restored from, and the rank
    holding each grafted per-rank tensor."""
    mine = next(g for g in stages if base.rank in g)
    base_keys = {t.key for t in base.tensors}
    stage_of: dict[str, frozenset[int]] = dict.fromkeys(base_keys, mine)
    owners: dict[str, int] = {}
    tensors = list(base.tensors)
    tree = copy.deepcopy(base.tree)
    shared: set[str] = set()
    for group in stages:
        if group is mine:
            continue
        source = manifests[min(group)]
        remap: dict[int, int] = {}

        def take(
            i: int,
            source: Manifest = source,
            remap: dict[int, int] = remap,
            group: frozenset[int] = group,
        ) -> int:
            if i not in remap:
                meta = source.tensors[i]
                if meta.alias_of is not None:
                    meta = replace(meta, alias_of=take(meta.alias_of))
                remap[i] = len(tensors)
                tensors.append(meta)
                stage_of[meta.key] = group
                owners[meta.key] = source.rank
            return remap[i]

        tree = _graft(tree, source.tree, take)
        shared |= {t.key for t in source.tensors} & base_keys
    if shared:
        log.warning(
            "restoring a step whose ranks saved different parts of the state (pipeline "
            "stages?): %d keys were saved by several of them with tensors of their own "
            "(such as %r) and come from ranks %s only; save optimizer state keyed by "
            "parameter names (torch.distributed.checkpoint.state_dict."
            "get_optimizer_state_dict) for a restore that keeps every stage's",
            len(shared),
            min(shared),
            sorted(mine),
        )
    return replace(base, tensors=tuple(tensors), tree=tree), stage_of, owners


def _graft_values(base: Manifest, manifests: Mapping[int, Manifest]) -> Manifest:
    """``base`` with the dict entries holding no tensor that only other saved ranks saved,
    from the lowest such rank: values keyed by a rank coordinate (torchtitan keeps its
    dataloader's position under ``dp_rank_<d>``, and after a layout change the rank that
    restores data-parallel rank d is not the one that saved it). Every key saved by any
    rank can then be found, as with DCP; a restoring rank's own values stay its own."""
    tree = base.tree
    for r, m in sorted(manifests.items()):
        if r != base.rank and m.tree != tree:
            tree = _graft(tree, m.tree, _no_tensor, values_only=True)
    return base if tree is base.tree else replace(base, tree=tree)


def _no_tensor(i: int) -> int:
    raise AssertionError(f"tensor {i} grafted as a value")


def _has_tensor(node: Any) -> bool:
    """Whether ``node`` holds a tensor (or a pickled value: a rank restores only the pickles
    it saved itself, which ``allow_pickle`` was checked against)."""
    if isinstance(node, dict):
        if set(node) == {"$tensor"} or set(node) == {"$pickle"}:
            return True
        return any(_has_tensor(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_tensor(v) for v in node)
    return False


def _graft(into: Any, other: Any, take: Callable[[int], int], values_only: bool = False) -> Any:
    """``into`` (a tree as manifests keep it) with every entry of the dicts of ``other``
    it lacks, at the same place, their tensors renumbered by ``take`` (``values_only``:
    only the entries holding no tensor)."""
    if (
        isinstance(into, dict)
        and isinstance(other, dict)
        and set(into) == set(other) == {"$stateful"}  # a module's or optimizer's state dict
    ):
        return {"$stateful": _graft(into["$stateful"], other["$stateful"], take, values_only)}
    if not (_is_dict(into) and _is_dict(other)):
        return into
    have = {_entry_key(k): i for i, (k, _) in enumerate(into["$dict"])}
    entries = list(into["$dict"])
    for k, v in other["$dict"]:
        at = have.get(_entry_key(k))
        if at is None:
            if not (values_only and _has_tensor(v)):
                entries.append([k, _renumbered(v, take)])
        elif entries[at][1] != v:  # equal subtrees (most of them) have nothing to graft
            entries[at] = [entries[at][0], _graft(entries[at][1], v, take, values_only)]
    return {"$dict": entries}


def _is_dict(node: Any) -> bool:
    return isinstance(node, dict) and set(node) == {"$dict"}


def _entry_key(k: Any) -> Any:
    # a str key as it is (most keys); any other in a tuple, so that 1 and "1" differ
    return k if type(k) is str else (json.dumps(k, sort_keys=True),)


def _renumbered(node: Any, take: Callable[[int], int]) -> Any:
    """A copy of ``node`` with each ``{"$tensor": i}`` replaced by ``{"$tensor": take(i)}``."""
    if isinstance(node, dict):
        if set(node) == {"$tensor"} and isinstance(node["$tensor"], int):
            return {"$tensor": take(node["$tensor"])}
        return {k: _renumbered(v, take) for k, v in node.items()}
    if isinstance(node, list):
        return [_renumbered(v, take) for v in node]
    return node


async def restore_resharded(
    base: Manifest,
    sources: Sequence[Tier],
    all_tiers: Sequence[Tier],
    *,
    rank: int,
    world_size: int,
    into: Any,
    map_location: torch.device | str | None,
    allow_pickle: bool,
    concurrency: int = 4,
    checksum: Checksum = thread_checksum,
    exchange: Coordinator | None = None,
) -> Any:
    """Rebuild the state from ``base`` (a saved rank's manifest), reading each tensor's
    overlapping parts from whichever saved ranks hold them (see the module docstring);
    ``checksum`` computes each shard's crc32c (the Checkpointer's checksum pool)."""
    if base.pickled and not allow_pickle:
        decode_tree(base.tree, [None] * len(base.tensors), allow_pickle=False)
    device = torch.device(map_location) if map_location is not None else None
    targets = _targets(into)
    readers = await _readers(all_tiers, base.step)
    sem = asyncio.Semaphore(concurrency)
    # where every chunk lies is in the saved ranks' manifests: read them all, once each,
    # when anything is distributed (the chunks of any layout are boxes of the global tensor)
    manifests: dict[int, Manifest] = {base.rank: base}
    # onto fewer ranks, a state of plain per-rank tensors needs them too: its ranks may have
    # saved different parts of it (pipeline stages without sharding) that no restoring
    # rank's own saved rank holds (onto more ranks, each saved rank is some rank's own)
    distributed = any(m.placements is not None for m in base.tensors)
    if base.world_size > 1 and (distributed or world_size < base.world_size):
        if readers:
            manifests = await _saved_manifests(
                base, sources, readers, sem, exchange, rank, world_size
            )
        elif distributed:
            raise CorruptionError(
                f"step {base.step}: rank {rank} needs the other ranks' manifests, but no "
                "tier holding the step can read other ranks' parts "
                f"({[t.name for t in sources]})"
            )
    stage_of: dict[str, frozenset[int]] | None = None
    owners: dict[str, int] | None = None
    stages = _stages(manifests) if len(manifests) > 1 else []
    if len(stages) > 1:
        own_keys = {t.key for t in base.tensors}
        if (base.world_size != world_size and into is None) or any(
            k not in own_keys for k in targets
        ):
            # onto another layout, or into one process: every stage's own part too
            base, stage_of, owners = _merge_stages(base, manifests, stages)
        else:  # the same layout: this rank's stage only
            mine = next(g for g in stages if base.rank in g)
            stage_of = {t.key: mine for t in base.tensors}
    if len(manifests) > 1 and base.world_size != world_size:
        base = _graft_values(base, manifests)
    try:
        # the keys, and the optimizers' groups and state shapes (global shapes: a DTensor's
        # entry gives its global shape, as a DTensor parameter's .shape is), are checked
        # before any tensor data is read
        check_optimizers(align_into(base, into, rename=False), into)
        held = _held_boxes(manifests, stage_of)
        wanted: list[_Wanted | None] = []
        pieces: dict[int, list[_Piece]] = {}
        for meta in base.tensors:
            if meta.mode == "alias":
                wanted.append(None)
                continue
            ref = targets.get(meta.key)
            if meta.placements is None:
                region = _box((0,) * len(meta.shape), meta.shape)
                if ref is not None and tuple(ref.tensor.shape) != meta.shape:
                    raise ConfigurationError(
                        f"into[{meta.key!r}] is {list(ref.tensor.shape)} but the checkpoint has "
                        f"{list(meta.shape)}"
                    )
            else:
                region = _region_for(meta, ref, base, rank, world_size)
            if ref is not None and ref.tensor.dtype != meta.torch_dtype:
                raise ConfigurationError(
                    f"into[{meta.key!r}] is {ref.tensor.dtype} but the checkpoint has {meta.dtype}"
                )
            shape = tuple(hi - lo for lo, hi in region)
            if ref is not None:
                final = ref.tensor.detach()
                direct = final.device.type == "cpu" and final.is_contiguous()
                staging = final if direct else torch.empty(shape, dtype=meta.torch_dtype)
                value = ref.dtensor if ref.dtensor is not None else final
            else:
                staging = final = value = torch.empty(shape, dtype=meta.torch_dtype)
            want = _Wanted(meta, region, staging, final, value)
            wanted.append(want)
            holders = _holders(meta, base, held, owners)
            covered = 0
            for holder, box in holders:
                overlap = _intersect(box, region)
                if overlap is not None:
                    pieces.setdefault(holder, []).append(_Piece(want, holder, overlap))
                    covered += _volume(overlap)
            if meta.placements is not None and covered < _volume(region):
                raise CorruptionError(
                    f"step {base.step}: the saved chunks of {meta.key!r} do not cover the region "
                    f"{[list(span) for span in region]} of its global shape "
                    f"{list(meta.global_shape or ())}"
                )

        problems: list[Exception] = []
        fills = {
            r: _plan_fill(manifests[r], list(sources) if r == base.rank else readers, todo)
            for r, todo in pieces.items()
        }
    except Exception as exc:
        # a rank that refuses (a target that does not fit, say) still answers the exchange
        # of needs the others wait in, so that every rank raises instead of waiting
        if exchange is not None:
            with contextlib.suppress(Exception):
                await exchange.gather(0, _Refused(rank, f"{type(exc).__name__}: {exc}"))
        raise
    try:
        await _read_fills(fills, sem, problems, checksum, exchange, rank)
    except ExceptionGroup as group:
        raise first_error(group) from None

    out: list[torch.Tensor] = []
    for i, meta in enumerate(base.tensors):
        if meta.alias_of is not None:
            out.append(out[meta.alias_of])
            continue
        done = wanted[i]
        assert done is not None
        if done.final is not done.staging:
            done.final.copy_(done.staging)
        value = done.value
        if device is not None and value is done.staging and device != value.device:
            value = value.to(device)
        out.append(value)
    state = decode_tree(base.tree, out, allow_pickle=allow_pickle)
    if into is not None:
        apply_into(into, state)
        return into
    return state


@dataclass
class _Fill:
    """What one saved rank's shards give this restore: per shard, the pieces it holds."""

    manifest: Manifest
    tiers: Sequence[Tier]
    by_shard: dict[int, list[tuple[_Piece, int, Box]]]
    flat: list[tuple[_Piece, int, Box, torch.Tensor]]


def _plan_fill(manifest: Manifest, tiers: Sequence[Tier], todo: list[_Piece]) -> _Fill:
    """The shards of ``manifest`` that hold the pieces, each listed once, with the pieces."""
    index = {m.key: i for i, m in enumerate(manifest.tensors)}
    by_shard: dict[int, list[tuple[_Piece, int, Box]]] = {}
    flat: list[tuple[_Piece, int, Box, torch.Tensor]] = []
    for piece in todo:
        key = piece.wanted.meta.key
        i = index.get(key)
        if i is None:
            raise CorruptionError(
                f"rank {manifest.rank}'s manifest of step {manifest.step} has no {key!r}"
            )
        alias = manifest.tensors[i].alias_of
        if alias is not None:  # an alias always names a stored entry
            i = alias
        meta = manifest.tensors[i]
        origin = _saved_box(manifest, meta, piece)
        if meta.mode == "empty":
            continue
        if meta.mode == "replica":
            raise CorruptionError(
                f"rank {manifest.rank} of step {manifest.step} does not hold {key!r} itself"
            )
        if meta.mode == "flat":
            scratch = torch.empty(meta.shape, dtype=meta.torch_dtype)
            flat.append((piece, i, origin, scratch))
        for s in meta.shards:
            if meta.mode == "rows":
                seg = next(g for g in manifest.shards[s].segments if g.tensor == i)
                lo, hi = piece.overlap[0]
                if seg.stop + origin[0][0] <= lo or seg.start + origin[0][0] >= hi:
                    continue  # this chunk of rows lies outside the piece
            by_shard.setdefault(s, []).append((piece, i, origin))
    return _Fill(manifest, tiers, by_shard, flat)


def _copy_shard(fill: _Fill, s: int, buffer: torch.Tensor) -> None:
    """Copy the pieces shard ``s`` holds from its verified bytes into the wanted tensors."""
    manifest = fill.manifest
    scratch_of = {(id(p), i): t for p, i, _, t in fill.flat}
    shard = manifest.shards[s]
    for piece, i, origin in fill.by_shard[s]:
        meta = manifest.tensors[i]
        for seg in shard.segments:
            if seg.tensor != i:
                continue
            data = manifest.shard_part(seg, buffer)
            if meta.mode == "flat":
                manifest.tensor_part(seg, scratch_of[(id(piece), i)]).copy_(data)
                continue
            if meta.mode == "rows":  # the segment holds rows start:stop of the chunk
                row0 = origin[0][0] + seg.start
                held = ((row0, row0 + seg.stop - seg.start), *origin[1:])
            else:
                held = origin
            part = _intersect(held, piece.overlap)
            if part is None:
                continue
            target = piece.wanted
            target.staging[_slices(part, target.region)].copy_(data[_slices(part, held)])


def _share_plan(
    everyone: Sequence[Sequence[tuple[int, int, int]]],
) -> dict[tuple[int, int], tuple[int, list[int], int]]:
    """For every stored shard several ranks need (``(saved rank, shard, length)`` per rank),
    who reads it, who gets it from that reader, and the message tag: the same plan on every
    rank. Largest first, each shard goes to the needing rank that has been given the fewest
    bytes to read for others, so the reading spreads as the bytes do."""
    needers: dict[tuple[int, int], list[int]] = {}
    length: dict[tuple[int, int], int] = {}
    for rank, needs in enumerate(everyone):
        for r, s, n in needs:
            needers.setdefault((r, s), []).append(rank)
            length[(r, s)] = n
    shared = sorted(k for k, v in needers.items() if len(v) > 1)
    tags = {k: i for i, k in enumerate(shared)}
    given: dict[int, int] = {}
    plan: dict[tuple[int, int], tuple[int, list[int], int]] = {}
    for key in sorted(shared, key=lambda k: (-length[k], k)):
        group = sorted(needers[key])
        first = (key[0] * 7919 + key[1]) % len(group)
        order = group[first:] + group[:first]
        reader = min(order, key=lambda r: given.get(r, 0))
        given[reader] = given.get(reader, 0) + length[key]
        plan[key] = (reader, [r for r in group if r != reader], tags[key])
    return plan


async def _read_fills(
    fills: Mapping[int, _Fill],
    sem: asyncio.Semaphore,
    problems: list[Exception],
    checksum: Checksum,
    exchange: Coordinator | None,
    rank: int,
) -> None:
    """Read every shard the fills need, verified, and copy the pieces out. With several
    ranks (``exchange``), a stored shard several ranks need is read by one of them and sent
    to the others, each copy checked against its crc32c on arrival; one that does not
    arrive whole (a sender that failed, damage on the way) is read directly instead."""
    needs = sorted(
        (r, s, f.manifest.shards[s].length) for r, f in fills.items() for s in f.by_shard
    )
    plan = {}
    if exchange is not None:
        everyone = await exchange.gather(0, needs)
        refused = [e for e in everyone if isinstance(e, _Refused)]
        if refused:
            raise CoordinationError(
                f"rank {refused[0].rank} refused the restore ({refused[0].error}); nothing "
                "was loaded on any rank"
            )
        plan = _share_plan(everyone)
    buffers: dict[tuple[int, int], torch.Tensor] = {}
    received: dict[tuple[int, int], torch.Tensor] = {}  # the sender's status per shard
    recv_works: list[Any] = []
    for r, s, n in needs:
        buffers[(r, s)] = torch.empty(n, dtype=torch.uint8)
        entry = plan.get((r, s))
        if entry is not None and entry[0] != rank:
            assert exchange is not None
            status = torch.zeros(1, dtype=torch.int32)
            received[(r, s)] = status
            recv_works.append(exchange.irecv(status, entry[0], 2 * entry[2]))
            recv_works.append(exchange.irecv(buffers[(r, s)], entry[0], 2 * entry[2] + 1))
    send_works: list[Any] = []

    async def read(r: int, s: int) -> None:
        fill = fills[r]
        buffer = buffers[(r, s)]
        async with sem:
            await read_verified(
                fill.manifest,
                fill.manifest.shards[s],
                fill.tiers,
                byte_view(buffer),
                checksum=checksum,
                problems=problems,
            )

    async def read_and_send(r: int, s: int) -> None:
        entry = plan.get((r, s))
        ok = True
        try:
            await read(r, s)
        except Exception:
            ok = False
            raise
        finally:
            if entry is not None:  # the others wait for it either way: say how it went
                assert exchange is not None
                status = torch.tensor([1 if ok else 0], dtype=torch.int32)
                for dst in entry[1]:
                    send_works.append(exchange.isend(status, dst, 2 * entry[2]))
                    send_works.append(exchange.isend(buffers[(r, s)], dst, 2 * entry[2] + 1))

    try:
        async with asyncio.TaskGroup() as tg:
            for r, s, _ in needs:
                if (r, s) not in received:
                    tg.create_task(read_and_send(r, s))
    finally:
        if exchange is not None:
            arrivals = await exchange.wait(recv_works)
            await exchange.wait(send_works)
    if received:
        assert exchange is not None
        failed = {i // 2 for i, e in enumerate(arrivals) if e is not None}
        fallback = []
        for n, (key, status) in enumerate(received.items()):
            shard = fills[key[0]].manifest.shards[key[1]]
            good = n not in failed and int(status.item()) == 1
            if good and await checksum(byte_view(buffers[key])) == shard.crc32c:
                continue
            fallback.append(key)
        async with asyncio.TaskGroup() as tg:
            for r, s in fallback:
                tg.create_task(read(r, s))
    for r, s, _ in needs:
        _copy_shard(fills[r], s, buffers[(r, s)])
    for fill in fills.values():
        for piece, _, origin, scratch in fill.flat:
            target = piece.wanted
            target.staging[_slices(piece.overlap, target.region)].copy_(
                scratch[_slices(piece.overlap, origin)]
            )


def _saved_box(manifest: Manifest, meta: TensorMeta, piece: _Piece) -> Box:
    """The global box saved rank ``manifest.rank`` holds of a tensor, checked against what
    the chunking rule said it holds."""
    wanted = piece.wanted.meta
    if meta.placements is None:
        if wanted.placements is not None or meta.shape != wanted.shape:
            raise CorruptionError(f"rank {manifest.rank} holds {meta.key!r} differently")
        return _box((0,) * len(meta.shape), meta.shape)
    assert meta.global_offset is not None
    box = _box(meta.global_offset, meta.shape)
    if meta.global_shape != wanted.global_shape or _intersect(box, piece.overlap) != piece.overlap:
        raise CorruptionError(
            f"rank {manifest.rank}'s chunk of {meta.key!r} in step {manifest.step} is not "
            "where the sharding says it is"
        )
    return box
