"""``lazyckpt copy``: copy committed snapshots between locations, checked both ways.

An incremental step (one that refers to shards stored with earlier steps) is copied whole:
each copied step is self-contained at the destination. A step written by several ranks is
copied whole too: every rank's part, then its commit record, so that the copy is committed
only once every part is there; a destination that cannot hold such a step is refused before
anything is written. A damaged step is reported and skipped, and the copy goes on with the
other steps."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from dataclasses import replace
from functools import partial
from pathlib import Path

from .._errors import ConfigurationError, CorruptionError
from .._format.manifest import Manifest
from .._progress import format_bytes
from .._tiering.calls import call_tier
from .._tiering.interface import SupportsGlobalCommit, SupportsRankManifests
from ._console import Console
from ._location import Location, opened, pick_steps, resolve_location
from ._read import ShardReader, rank_label, step_parts
from ._status import EXIT_DAMAGE, EXIT_OK, EXIT_USAGE, CommandError
from ._write import DEFAULT_POLICY, delete_step, put_all, writing


async def _readback(loc: Location, parts: list[Manifest], ui: Console, jobs: int) -> list[str]:
    """Every part of the copied step as the destination now lists it, read and checked;
    the problems found (none when the copy is whole and intact)."""
    problems = []
    step = parts[0].step
    world = parts[0].world_size
    for want in parts:
        who = rank_label(want)
        try:
            if world > 1:
                assert isinstance(loc.tier, SupportsRankManifests)  # checked before writing
                got = await loc.tier.read_rank_manifest(step, want.rank)
            else:
                got = await loc.tier.read_manifest(step)
        except CorruptionError as exc:
            problems.append(f"{who}manifest: {exc}")
            continue
        if [(s.length, s.crc32c) for s in got.shards] != [
            (s.length, s.crc32c) for s in want.shards
        ]:
            problems.append(f"{who}manifest: its shards differ from the ones written")
            continue
        label = f"check step {step} {who}on {loc}"
        with ui.progress(sum(s.length for s in got.shards), label) as bar:
            async with ShardReader(loc.tier, got, jobs=jobs) as reader:
                async for read in reader:
                    bar.advance(read.shard.length)
                    if read.error is not None:
                        problems.append(f"{who}shard {read.shard.index}: {read.error}")
    return problems


def _check_can_hold(src: Location, dst: Location, step: int, world: int) -> None:
    """Refuse, before anything is written, a step of several ranks that ``dst`` cannot hold
    whole (write each rank's part, then a commit record) and read back."""
    if world == 1:
        return
    missing = [
        name
        for name, ok in (
            ("commit_global", isinstance(dst.tier, SupportsGlobalCommit)),
            ("read_rank_manifest", isinstance(dst.tier, SupportsRankManifests)),
        )
        if not ok
    ]
    if missing:
        raise ConfigurationError(
            f"{src}: step {step} was written by {world} ranks, but {dst} (a {dst.kind} tier) "
            f"cannot hold a step of several ranks (it lacks {', '.join(missing)}); nothing "
            "was copied: copy it to a file or Zarr location, or export it"
        )


async def _copy_step(
    src: Location, dst: Location, step: int, ui: Console, args: argparse.Namespace
) -> int:
    """Copy one step whole (every rank's part, each checked as read, then the commit
    record) and read it back; the bytes copied."""
    parts = await step_parts(src.tier, step)
    world = parts[0].world_size
    _check_can_hold(src, dst, step, world)
    written: list[Manifest] = []
    try:
        for stored in parts:
            # an incremental step is read through its references but copied whole: the
            # destination need not hold the steps it refers to
            m = replace(
                stored.self_contained(), extra={**stored.extra, "tier": dst.tier.describe()}
            )
            label = f"copy step {step}" + (f" rank {m.rank} of {world}" if world > 1 else "")
            async with (
                writing(dst.tier, m) as write,
                ShardReader(src.tier, stored, jobs=args.jobs) as reader,
            ):
                await put_all(write, None, reader, ui, label, args.jobs)
                # one rank's part: durable, but not visible until the commit record
                await write.commit(m)
            written.append(m)
        if world > 1:
            assert isinstance(dst.tier, SupportsGlobalCommit)
            # the commit point: the step becomes visible with every part in place
            commit = partial(dst.tier.commit_global, step, world)
            await call_tier(dst.tier.name, f"commit step {step}", commit, DEFAULT_POLICY)
    except BaseException:
        if world > 1 and written:
            # the parts already written are not committed: no reader sees them, and the
            # next writer's open would remove them; removed here already
            with contextlib.suppress(Exception):
                await asyncio.shield(_forget(dst, step))
        raise
    if not args.no_readback:
        problems = await _readback(dst, written, ui, args.jobs)
        if problems:
            await delete_step(dst.tier, step)
            raise CorruptionError(
                f"{dst}: step {step} read back wrong, so it was removed again: "
                + "; ".join(problems[:3])
            )
    return sum(m.stream_bytes for m in written)


async def _forget(dst: Location, step: int) -> None:
    """Remove what a failed copy of a step of several ranks wrote (best effort): ``abort``
    removes only the part of the rank the tier serves, ``delete`` the whole step (the
    built-in tiers remove an uncommitted one too)."""
    await delete_step(dst.tier, step)


def _same_location(a: str, b: str) -> bool:
    kind_a, arg_a = resolve_location(a)
    kind_b, arg_b = resolve_location(b)
    if kind_a != kind_b:
        return False
    if "://" in arg_a or "://" in arg_b:
        return arg_a.rstrip("/") == arg_b.rstrip("/")
    return Path(arg_a).resolve() == Path(arg_b).resolve()


async def copy_command(args: argparse.Namespace, ui: Console) -> int:
    """``lazyckpt copy``: copy each step, checked as read, then read back (see ``--help``).

    A damaged step is skipped and the others copied; the status is then 1, naming it."""
    if await asyncio.to_thread(_same_location, args.src, args.dst):
        raise CommandError(
            f"{args.src} and {args.dst} are the same location: copy to another one", EXIT_USAGE
        )
    failed: list[tuple[int, str]] = []
    copied: list[int] = []
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
            try:
                size = await _copy_step(src, dst, step, ui, args)
            except CorruptionError as exc:
                # damage stays where it is; the other steps are still worth copying
                failed.append((step, str(exc)))
                ui.note(f"step {step}: NOT copied: {exc}")
                continue
            copied.append(step)
            ui.out(f"step {step}: copied to {dst} ({format_bytes(size)})")
    if failed:
        done = ", ".join(map(str, copied)) or "none"
        raise CommandError(
            f"{len(failed)} of {len(steps)} steps were not copied, being damaged at {args.src} "
            f"or read back wrong: {', '.join(str(s) for s, _ in failed)} (copied: {done}); "
            f"run lazyckpt verify {args.src} --all to see the damage",
            EXIT_DAMAGE,
        )
    return EXIT_OK
