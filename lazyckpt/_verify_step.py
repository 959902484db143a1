"""Verifying a step: every shard on every tier that lists it, read and checked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ._errors import CorruptionError, SnapshotNotFoundError, TierError
from ._fetch import Checksum, find_step, read_copy, shard_keys, thread_checksum
from ._tier import Tier

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


async def verify_step(
    tiers: Sequence[Tier], step: int | None, *, checksum: Checksum = thread_checksum
) -> VerifyReport:
    """Read every shard of ``step`` on every tier that lists it and check its crc32c."""
    step, holders = await find_step(tiers, step)
    report = VerifyReport(step)
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
            out = memoryview(bytearray(shard.length))
            try:
                await read_copy(manifest, shard, tier, out, checksum=checksum)
            except (CorruptionError, TierError) as exc:
                problems.append(f"shard {shard.index} ({shard_keys(manifest, shard)}): {exc}")
    return report
