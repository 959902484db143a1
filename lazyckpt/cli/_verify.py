"""``lazyckpt verify``: read every shard of a snapshot and check its crc32c; for a step
written by several ranks, every rank's part."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .._errors import ConfigurationError, CorruptionError
from .._progress import format_bytes
from .._tiering.interface import SupportsRankManifests
from ._console import Console
from ._location import (
    Location,
    opened,
    pick_steps,
)
from ._read import ShardReader, damage_keys, shard_contents
from ._status import (
    EXIT_DAMAGE,
    EXIT_OK,
)


async def _verify_step(loc: Location, step: int, ui: Console, jobs: int) -> dict[str, Any]:
    """Check every shard of every rank's part of ``step``; a report for people and JSON."""
    report: dict[str, Any] = {"step": step, "ok": True, "damaged": []}
    try:
        first = await loc.tier.read_manifest(step)
    except CorruptionError as exc:
        report.update(ok=False, manifest_error=str(exc))
        return report
    world = first.world_size
    parts = [first]
    if world > 1:
        if not isinstance(loc.tier, SupportsRankManifests):
            raise ConfigurationError(
                f"{loc}: step {step} was written by {world} ranks and this tier cannot read "
                "the other ranks' parts (no read_rank_manifest): it cannot be verified whole"
            )
        for rank in range(1, world):
            try:
                parts.append(await loc.tier.read_rank_manifest(step, rank))
            except CorruptionError as exc:
                report["ok"] = False
                report.setdefault("manifest_errors", []).append(
                    {"rank": rank, "error": str(exc)}
                )
    report.update(
        world_size=world,
        shards=sum(len(m.shards) for m in parts),
        bytes=sum(m.stream_bytes for m in parts),
    )
    total = sum(s.length for m in parts for s in m.shards)
    with ui.progress(total, f"verify step {step}") as bar:
        for m in parts:
            async with ShardReader(loc.tier, m, jobs=jobs) as reader:
                async for read in reader:
                    bar.advance(read.shard.length)
                    if read.error is None:
                        continue
                    report["ok"] = False
                    report["damaged"].append(
                        {
                            "rank": m.rank,
                            "shard": read.shard.index,
                            "offset": read.shard.offset,
                            "length": read.shard.length,
                            "error": read.error,
                            "holds": shard_contents(m, read.shard),
                            "keys": damage_keys(m, read.shard),
                        }
                    )
    return report


def _print_report(r: dict[str, Any], ui: Console) -> None:
    if "manifest_error" in r:
        ui.out(f"step {r['step']}: DAMAGED: the manifest cannot be read: {r['manifest_error']}")
        sys.stdout.flush()
        return
    world = r["world_size"]
    ranks = f"{world} ranks, " if world > 1 else ""
    if r["ok"]:
        ui.out(f"step {r['step']}: ok ({ranks}{r['shards']} shards, {format_bytes(r['bytes'])})")
    else:
        parts = [f"{len(r['damaged'])} of {r['shards']} shards"]
        if "manifest_errors" in r:
            parts.append(f"{len(r['manifest_errors'])} of {world} ranks' manifests")
        ui.out(f"step {r['step']}: DAMAGED: {' and '.join(parts)} ({ranks.rstrip(', ') or '1 rank'})")
        for e in r.get("manifest_errors", []):
            ui.out(f"  rank {e['rank']}: the manifest cannot be read: {e['error']}")
        for d in r["damaged"]:
            end = d["offset"] + d["length"]
            who = f"rank {d['rank']} " if world > 1 else ""
            ui.out(f"  {who}shard {d['shard']} (stream bytes {d['offset']}-{end}): {d['error']}")
            for part in d["holds"]:
                ui.out(f"    {part}")
    sys.stdout.flush()  # one step at a time: a long --all run shows results as they come


async def verify_command(args: argparse.Namespace, ui: Console) -> int:
    """``lazyckpt verify``: check every shard of the chosen steps; 1 when any is damaged."""
    reports = []
    async with opened(args.location) as loc:
        for step in await pick_steps(loc, args.step, every=args.all):
            reports.append(await _verify_step(loc, step, ui, args.jobs))
            if not args.json:
                _print_report(reports[-1], ui)
    bad = [r for r in reports if not r["ok"]]
    if args.json:
        ui.out(json.dumps({"location": args.location, "steps": reports}, indent=2))
    elif len(reports) > 1:
        ui.out(f"{len(reports) - len(bad)} of {len(reports)} snapshots intact")
    return EXIT_DAMAGE if bad else EXIT_OK
