"""The ``lazyckpt`` command line: see what checkpoints exist, check them, move them.

Every subcommand takes a *location*: a directory (``file:///path`` is one too), or a URL.
``KIND+...://`` opens the tier registered as ``KIND`` under the ``lazyckpt.tiers`` entry-point
group, with the URL after ``KIND+`` as its argument; otherwise the registered tiers say what
they serve (:func:`resolve_location`): with the built-in ones, ``s3://bucket/prefix`` and a
directory holding a ``zarr.json`` open a Zarr tier, any other directory a file tier.

Commands that only read (``ls``, ``inspect``, ``verify``, ``export``, the source of ``copy``)
build the tier read-only (``readonly=True``, for a tier whose constructor takes it, which is
then opened so; otherwise ``readonly`` is set and ``open()`` is never called): they create,
delete and lock nothing, so they work beside a training job writing to the same location.
Commands that write (``gc``, ``import``, the destination of ``copy``) open the tier for
writing, which takes the location's writer lock: beside a running writer they are refused
with :class:`~lazyckpt.LocationInUseError` instead of deleting what it writes.

Exit status (``docs/cli.md`` has the full table):

===  ====================================================================================
0    success
1    damage found (a checksum mismatch, missing or truncated data, an unreadable manifest),
     or the operation failed
2    usage error: bad arguments or options, or an unsupported request
3    not found: no such location, snapshot, step, key or input file
4    storage error: a tier could not be read or written (unreachable, permissions, full)
130  interrupted
141  stdout was closed before the output was written (``| head``)
===  ====================================================================================

The package holds one module per concern: ``_location`` (which tier a location names, opening
it, picking steps), ``_read`` (shards read back and checked), ``_console`` (output),
``_formats`` (safetensors and torch file formats), ``_write`` (writing shards to a tier), one
module per command (``_inspect`` for ``ls`` and ``inspect``, ``_verify``, ``_export``,
``_import``, ``_copy``, ``_gc``, ``_timeline``), and ``_main`` (the parser, and exit statuses
from errors).
"""

from __future__ import annotations

from ._console import Console
from ._location import Location, open_location, resolve_location
from ._main import build_parser, main
from ._read import ShardRead, ShardReader, shard_contents
from ._status import (
    EXIT_BROKEN_PIPE,
    EXIT_DAMAGE,
    EXIT_INTERRUPTED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_STORAGE,
    EXIT_USAGE,
    CommandError,
)

__all__ = [
    "EXIT_BROKEN_PIPE",
    "EXIT_DAMAGE",
    "EXIT_INTERRUPTED",
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "EXIT_STORAGE",
    "EXIT_USAGE",
    "CommandError",
    "Console",
    "Location",
    "ShardRead",
    "ShardReader",
    "build_parser",
    "main",
    "open_location",
    "resolve_location",
    "shard_contents",
]
