"""``lazyckpt gc``: delete old snapshots by a retention rule."""

from __future__ import annotations

import argparse

from .._tier import Retention
from ._console import Console
from ._location import opened
from ._status import EXIT_OK


async def gc_command(args: argparse.Namespace, ui: Console) -> int:
    retention = Retention(keep_last=args.keep_last, keep_every=args.keep_every)
    # a writer: never beside a training job's own retention (the writer lock refuses it)
    async with opened(args.location, write=not args.dry_run) as loc:
        steps = await loc.tier.steps()
        doomed = retention.to_delete(steps)
        for step in doomed:
            if args.dry_run:
                ui.out(f"would delete step {step}")
            else:
                await loc.tier.delete(step)
                ui.out(f"deleted step {step}")
    kept = len(steps) - len(doomed)
    verb = "would keep" if args.dry_run else "kept"
    ui.note(f"{verb} {kept} of {len(steps)} snapshots in {args.location}")
    return EXIT_OK
