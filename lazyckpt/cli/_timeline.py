"""``lazyckpt timeline``: draw a run's recorded events as a picture."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from ._console import Console
from ._status import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    CommandError,
)


async def timeline_command(args: argparse.Namespace, ui: Console) -> int:
    """``lazyckpt timeline``: draw an events file as a PNG."""
    from .. import timeline

    path = Path(args.events)
    if not await asyncio.to_thread(path.is_file):
        raise CommandError(f"{path}: no such file", EXIT_NOT_FOUND)
    events = await asyncio.to_thread(timeline.load_events, path)
    await asyncio.to_thread(timeline.draw, events, args.out, title=args.title)
    ui.note(f"wrote {args.out}")
    return EXIT_OK
