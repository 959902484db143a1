"""``lazyckpt copy``: copy committed snapshots between locations, checked both ways.

An incremental step (one that refers to shards stored with earlier steps) is copied whole:
each copied step is self-contained at the destination."""

from __future__ import annotations

import argparse
from dataclasses import replace

from .._errors import CorruptionError
from .._manifest import Manifest
from .._progress import format_bytes
from ._console import Console
from ._location import Location, opened, pick_steps
from ._read import ShardReader
from ._status import EXIT_OK
from ._write import delete_step, put_all, writing


async def _readback(loc: Location, m: Manifest, ui: Console, jobs: int) -> list[str]:
    problems = []
    with ui.progress(sum(s.length for s in m.shards), f"check step {m.step} on {loc}") as bar:
        async with ShardReader(loc.tier, m, jobs=jobs) as reader:
            async for read in reader:
                bar.advance(read.shard.length)
                if read.error is not None:
                    problems.append(f"shard {read.shard.index}: {read.error}")
    return problems


async def copy_command(args: argparse.Namespace, ui: Console) -> int:
    """``lazyckpt copy``: copy each step, checked as read, then read back (see ``--help``)."""
    async with opened(args.src) as src, opened(args.dst, create=True) as dst:
        if args.step:
            steps = [s for step in args.step for s in await pick_steps(src, step)]
        else:
            steps = await pick_steps(src, None, every=True)
        present = set(await dst.tier.steps())
        for step in steps:
            if step in present:
                ui.note(f"step {step}: already on {dst}, left as it is")
                continue
            stored = await src.tier.read_manifest(step)
            # an incremental step is read through its references but copied whole: the
            # destination need not hold the steps it refers to
            m = replace(stored.self_contained(), extra={**stored.extra, "tier": dst.tier.describe()})
            async with (
                writing(dst.tier, m) as write,
                ShardReader(src.tier, stored, jobs=args.jobs) as reader,
            ):
                await put_all(write, None, reader, ui, f"copy step {step}", args.jobs)
                await write.commit(m)
            if not args.no_readback:
                problems = await _readback(dst, m, ui, args.jobs)
                if problems:
                    await delete_step(dst.tier, step)
                    raise CorruptionError(
                        f"{dst}: step {step} read back wrong, so it was removed again: "
                        + "; ".join(problems[:3])
                    )
            ui.out(f"step {step}: copied to {dst} ({format_bytes(m.stream_bytes)})")
    return EXIT_OK
