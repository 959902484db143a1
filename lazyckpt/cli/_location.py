"""Command-line locations: which tier a location names, opening it read-only or for writing,
and picking the committed steps a command works on."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from .._tier import Tier, available_tiers, load_tier
from ._status import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    CommandError,
)

# URL schemes that mean an object store, which lazyckpt reaches through its Zarr tier.
_OBJECT_STORE_SCHEMES = frozenset({"s3"})


@dataclass
class Location:
    """A tier opened from a command-line location."""

    spec: str
    kind: str
    tier: Tier

    def __str__(self) -> str:
        return self.spec


def resolve_location(spec: str) -> tuple[str, str]:
    """The tier kind (entry-point name) and constructor argument for a location.

    Raises:
        CommandError: a URL scheme no registered tier serves (exit 2).
    """
    scheme, sep, rest = spec.partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        if (Path(spec) / "zarr.json").is_file() and "zarr" in available_tiers():
            return "zarr", spec
        return "file", spec
    scheme = scheme.lower()
    if scheme == "file":
        return "file", rest
    if "+" in scheme:
        kind, inner = scheme.split("+", 1)
        return kind, f"{inner}://{rest}"
    if scheme in _OBJECT_STORE_SCHEMES:
        return "zarr", spec
    if scheme in available_tiers():
        return scheme, spec
    raise CommandError(
        f"{spec}: no tier serves URLs starting with {scheme}://; use a directory, s3://..., "
        "zarr+file://..., or KIND+...:// for a tier registered as KIND",
        EXIT_USAGE,
    )


async def open_location(spec: str, *, create: bool = False, write: bool = False) -> Location:
    """Build the tier for ``spec``: read-only, or with ``write`` or ``create`` opened for
    writing (``create`` also makes a missing directory). A read-only tier is opened only
    when its constructor takes ``readonly=`` (the built-in tiers do): one that does not may
    not honour it, and reads need no ``open()``.

    Raises:
        CommandError: no such directory (exit 3), or no tier for it (exit 2).
        LocationInUseError: another writer holds the location (``write``/``create``).
    """
    # Resolving looks at the file system (a Zarr root?) and loads the tier plugins.
    kind, arg = await asyncio.to_thread(resolve_location, spec)
    if kind == "zarr" and "zarr" not in available_tiers():
        raise CommandError(
            f"{spec}: this installation has no Zarr tier (entry point 'zarr' in "
            f"'lazyckpt.tiers'); registered tiers: {sorted(available_tiers())}",
            EXIT_USAGE,
        )
    if kind == "file" and not create and not await asyncio.to_thread(Path(arg).is_dir):
        raise CommandError(f"{spec}: no such directory", EXIT_NOT_FOUND)
    readonly = not (create or write)
    factory = available_tiers().get(kind)
    # a tier whose constructor takes readonly= honours it: opened so, it checks the location
    # (a missing one is SnapshotNotFoundError) and creates, deletes and locks nothing
    honours = readonly and factory is not None and _takes_readonly(factory)
    tier = load_tier(kind, arg, readonly=True) if honours else load_tier(kind, arg)
    if readonly and not honours:
        tier.readonly = True  # asked, but maybe not honoured: so never opened for a read
    else:
        try:
            await tier.open()
        except BaseException:
            await tier.aclose()
            raise
    return Location(spec, kind, tier)


def _takes_readonly(factory: Callable[..., Tier]) -> bool:
    """Whether a tier's constructor takes ``readonly=`` (and so honours it in ``open()``)."""
    try:
        return "readonly" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        return False


@contextlib.asynccontextmanager
async def opened(
    spec: str, *, create: bool = False, write: bool = False
) -> AsyncIterator[Location]:
    location = await open_location(spec, create=create, write=write)
    try:
        yield location
    finally:
        await location.tier.aclose()


async def pick_steps(location: Location, step: int | None, *, every: bool = False) -> list[int]:
    """The committed steps a command works on: all, the one asked for, or the latest."""
    steps = await location.tier.steps()
    if not steps:
        raise CommandError(f"{location}: no committed snapshot", EXIT_NOT_FOUND)
    if every:
        return steps
    if step is None:
        return [steps[-1]]
    if step not in steps:
        near = ", ".join(map(str, steps[-5:]))
        raise CommandError(
            f"{location}: step {step} is not committed (latest: {near})", EXIT_NOT_FOUND
        )
    return [step]
