"""Verifying a step: every shard on every tier that lists it, read and checked; for a step
written by another number of ranks than this process has, every rank's part."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .._errors import CorruptionError, SnapshotNotFoundError, TierError
from .._format.manifest import Manifest
from .._tiering.interface import SupportsRankManifests, Tier
from .fetch import Checksum, find_step, read_copy, shard_keys, thread_checksum

__all__ = ["VerifyReport", "verify_step"]


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


async def _parts(tier: Tier, step: int, problems: list[str]) -> list[Manifest]:
    """The manifests of ``step`` on ``tier`` this process verifies: its own rank's part, or
    every rank's when the step was written by another number of ranks than this process
    has (a single process checking a step of several ranks checks all of it). A manifest
    that cannot be read is added to ``problems``, naming the rank."""
    try:
        own = await tier.read_manifest(step)
    except (CorruptionError, TierError, SnapshotNotFoundError) as exc:
        if not isinstance(tier, SupportsRankManifests) or tier.world_size == 1:
            problems.append(f"manifest: {exc}")
            return []
        # this rank may have no part: a step written by fewer ranks; rank 0's says
        try:
            own = await tier.read_rank_manifest(step, 0)
        except (CorruptionError, TierError, SnapshotNotFoundError):
            problems.append(f"manifest: {exc}")
            return []
        if tier.rank < own.world_size:  # this rank's own manifest should be there
            problems.append(f"manifest: {exc}")
            return []
    world = own.world_size
    if world == tier.world_size or world == 1:
        return [own]
    if not isinstance(tier, SupportsRankManifests):
        problems.append(
            f"step {step} was written by {world} ranks and this tier cannot read the other "
            "ranks' parts (no read_rank_manifest): only this rank's part was checked"
        )
        return [own]
    parts = []
    for rank in range(world):
        if rank == own.rank:
            parts.append(own)
            continue
        try:
            parts.append(await tier.read_rank_manifest(step, rank))
        except (CorruptionError, TierError, SnapshotNotFoundError) as exc:
            problems.append(f"rank {rank} of {world}: manifest: {exc}")
    return parts


async def verify_step(
    tiers: Sequence[Tier], step: int | None, *, checksum: Checksum = thread_checksum
) -> VerifyReport:
    """Read every shard of ``step`` on every tier that lists it and check its crc32c: this
    rank's part, or every rank's part when the step was written by another number of ranks
    (see :func:`_parts`)."""
    step, holders = await find_step(tiers, step)
    report = VerifyReport(step)
    for tier in holders:
        problems = report.problems.setdefault(tier.name, [])
        parts = await _parts(tier, step, problems)
        if not parts:
            continue
        report.shards = sum(len(m.shards) for m in parts)
        report.bytes = sum(s.length for m in parts for s in m.shards)
        for manifest in parts:
            who = f"rank {manifest.rank} " if manifest.world_size > 1 else ""
            for shard in manifest.shards:
                out = memoryview(bytearray(shard.length))
                try:
                    await read_copy(manifest, shard, tier, out, checksum=checksum)
                except (CorruptionError, TierError) as exc:
                    problems.append(
                        f"{who}shard {shard.index} ({shard_keys(manifest, shard)}): {exc}"
                    )
    return report
