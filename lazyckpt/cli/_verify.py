"""``lazyckpt verify``: read every shard of a snapshot and check its crc32c."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .._errors import CorruptionError
from .._progress import format_bytes
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
    report: dict[str, Any] = {"step": step, "ok": True, "damaged": []}
    try:
        m = await loc.tier.read_manifest(step)
    except CorruptionError as exc:
        report.update(ok=False, manifest_error=str(exc))
        return report
    report.update(shards=len(m.shards), bytes=m.stream_bytes)
    with ui.progress(sum(s.length for s in m.shards), f"verify step {step}") as bar:
        async with ShardReader(loc.tier, m, jobs=jobs) as reader:
            async for read in reader:
                bar.advance(read.shard.length)
                if read.error is None:
                    continue
                report["ok"] = False
                report["damaged"].append(
                    {
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
    elif r["ok"]:
        ui.out(f"step {r['step']}: ok ({r['shards']} shards, {format_bytes(r['bytes'])})")
    else:
        ui.out(f"step {r['step']}: DAMAGED: {len(r['damaged'])} of {r['shards']} shards")
        for d in r["damaged"]:
            end = d["offset"] + d["length"]
            ui.out(f"  shard {d['shard']} (stream bytes {d['offset']}-{end}): {d['error']}")
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
