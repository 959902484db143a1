"""``lazyckpt gc``: delete old snapshots by a retention rule."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

from .._errors import ConfigurationError, CorruptionError, SnapshotNotFoundError
from .._progress import format_bytes
from .._tiering.calls import call_tier
from .._tiering.interface import Retention, StepInfo, SupportsReferences, Tier
from ._console import Console
from ._location import opened
from ._status import EXIT_OK
from ._write import DEFAULT_POLICY, delete_step

# manifests gc reads at once, for the policies that judge steps by them
_MANIFEST_READS = 8


async def _report_uploads(tier: object, ui: Console, *, dry_run: bool) -> None:
    """The unfinished multipart uploads an object store held (a tier that reports them:
    ZarrTier on S3): those the open for writing aborted, or with ``--dry-run`` those it
    would abort."""
    listed = getattr(tier, "unfinished_uploads", None)
    found = await listed() if dry_run and listed is not None else getattr(tier, "uploads_aborted", [])
    if found:
        size = format_bytes(sum(u.bytes for u in found))
        verb = "would abort" if dry_run else "aborted"
        ui.out(f"{verb} {len(found)} unfinished multipart uploads holding {size}")


async def step_info(tier: Tier, steps: Sequence[int], ui: Console) -> dict[int, StepInfo]:
    """Each step's :class:`StepInfo`, from its manifest (a few read at once). A step whose
    manifest cannot be read is left out, with a note: retention then keeps it."""
    sem = asyncio.Semaphore(_MANIFEST_READS)
    info: dict[int, StepInfo] = {}

    async def read(step: int) -> None:
        async with sem:
            try:
                info[step] = StepInfo.from_manifest(await tier.read_manifest(step))
            except (CorruptionError, SnapshotNotFoundError) as exc:
                ui.note(f"step {step}: {exc}; kept")

    await asyncio.gather(*(read(step) for step in steps))
    return info


def retention_of(args: argparse.Namespace) -> Retention:
    """The retention the options ask for.

    Raises:
        ConfigurationError: no policy was given (exit 2).
    """
    retention = Retention(
        keep_last=args.keep_last,
        keep_every=args.keep_every,
        keep_best=args.keep_best,
        keep_within=args.keep_within,
    )
    if not retention.describe():
        raise ConfigurationError(
            "say what to keep: --keep-last, --keep-every, --keep-best or --keep-within"
        )
    return retention


async def gc_command(args: argparse.Namespace, ui: Console) -> int:
    """Delete the committed steps the retention rule does not keep (``--dry-run``: say so)."""
    retention = retention_of(args)
    # a writer: never beside a training job's own retention (the writer lock refuses it)
    async with opened(args.location, write=not args.dry_run) as loc:
        await _report_uploads(loc.tier, ui, dry_run=args.dry_run)
        steps = await loc.tier.steps()
        info = await step_info(loc.tier, steps, ui) if retention.needs_info() else None
        doomed = retention.to_delete(steps, info)
        if args.dry_run:
            for step in doomed:
                ui.out(f"would delete step {step}")
        else:
            with ui.progress(len(doomed), "gc", unit="snapshots") as bar:
                for step in doomed:
                    await delete_step(loc.tier, step)
                    ui.out(f"deleted step {step}")
                    bar.advance(1)
            if isinstance(loc.tier, SupportsReferences):
                # data of deleted incremental steps that kept steps referred to stays
                # (retired) until nothing refers to it: remove what nothing needs now
                freed = await call_tier(
                    loc.tier.name, "collect", loc.tier.collect, DEFAULT_POLICY
                )
                if freed:
                    ui.out(f"removed the data of retired steps {', '.join(map(str, freed))}")
    kept = len(steps) - len(doomed)
    verb = "would keep" if args.dry_run else "kept"
    ui.note(f"{verb} {kept} of {len(steps)} snapshots in {args.location}")
    return EXIT_OK
