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

from .._restore.fetch import latest_step
from .._tiering.interface import Tier, available_tiers, load_tier
from ._status import (
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    CommandError,
)

# What a registered tier class may declare about the locations the command line opens
# with it (class attributes, read where present, so a tier that declares nothing still
# works through KIND+...:// and its entry-point name):
#   url_schemes      URL schemes it serves: "s3" opens s3://... with the whole URL; "file"
#                    means local paths (a directory, or file:///path), given as the path
#   location_marker  a file at the root of a local directory that says the directory is in
#                    this tier's format (ZarrTier: "zarr.json")
_LOCAL = "file"


@dataclass
class Location:
    """A tier opened from a command-line location."""

    spec: str
    kind: str
    tier: Tier

    def __str__(self) -> str:
        return self.spec


def _declared(factory: Callable[..., Tier], name: str) -> tuple[str, ...]:
    value = getattr(factory, name, None)
    if isinstance(value, str):
        return (value,)
    if isinstance(value, tuple | list | frozenset | set):
        return tuple(str(v) for v in value)
    return ()


def _serving(tiers: dict[str, Callable[..., Tier]], scheme: str) -> list[str]:
    """The registered tier kinds that declare ``scheme`` among their ``url_schemes``."""
    return sorted(k for k, f in tiers.items() if scheme in _declared(f, "url_schemes"))


def _only(spec: str, kinds: list[str], what: str) -> str:
    if len(kinds) > 1:
        choices = ", ".join(f"{k}+..." for k in kinds)
        raise CommandError(
            f"{spec}: {what} is claimed by several registered tiers ({', '.join(kinds)}); "
            f"say which with {choices}",
            EXIT_USAGE,
        )
    return kinds[0]


def _local_kind(spec: str, path: str, tiers: dict[str, Callable[..., Tier]]) -> str:
    """The tier for a local path: the one whose marker file the directory holds, else the
    one serving local paths."""
    owners = sorted(
        kind
        for kind, factory in tiers.items()
        if any((Path(path) / marker).is_file() for marker in _declared(factory, "location_marker"))
    )
    if owners:
        return _only(spec, owners, "the directory")
    serving = _serving(tiers, _LOCAL)
    if not serving:
        raise CommandError(
            f"{spec}: no registered tier serves local paths (url_schemes with 'file'); "
            f"registered tiers: {sorted(tiers)}; use KIND+...:// for one of them",
            EXIT_USAGE,
        )
    return _only(spec, serving, "a local path")


def _resolve(spec: str) -> tuple[str, str, bool]:
    """:func:`resolve_location`, and whether the location is a local path."""
    tiers = available_tiers()
    scheme, sep, rest = spec.partition("://")
    if not sep or not re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme):
        return _local_kind(spec, spec, tiers), spec, True
    scheme = scheme.lower()
    if "+" in scheme:
        kind, inner = scheme.split("+", 1)
        return kind, f"{inner}://{rest}", False
    if scheme == _LOCAL:
        return _local_kind(spec, rest, tiers), rest, True
    serving = _serving(tiers, scheme)
    if serving:
        return _only(spec, serving, f"{scheme}://"), spec, False
    if scheme in tiers:
        return scheme, spec, False
    known = sorted({s for f in tiers.values() for s in _declared(f, "url_schemes")} - {_LOCAL})
    urls = "".join(f"{s}://..., " for s in known)
    raise CommandError(
        f"{spec}: no tier serves URLs starting with {scheme}://; use a directory, {urls}"
        "or KIND+...:// for a tier registered as KIND",
        EXIT_USAGE,
    )


def resolve_location(spec: str) -> tuple[str, str]:
    """The tier kind (entry-point name) and constructor argument for a location.

    The registered tiers say what they serve (``url_schemes``, ``location_marker`` on the
    tier class): a local path (or ``file://`` URL) goes to the tier whose marker file its
    root holds, else to the tier serving local paths, with the path; ``SCHEME://...`` to the
    tier declaring ``SCHEME`` (or registered under that name), with the whole URL;
    ``KIND+URL`` to the tier registered as ``KIND``, with ``URL``.

    Raises:
        CommandError: a URL scheme no registered tier serves, or that several claim (exit 2).
    """
    kind, arg, _ = _resolve(spec)
    return kind, arg


async def open_location(spec: str, *, create: bool = False, write: bool = False) -> Location:
    """Build the tier for ``spec``: read-only, or with ``write`` or ``create`` opened for
    writing (``create`` also makes a missing directory). A read-only tier is opened only
    when its constructor takes ``readonly=`` (the built-in tiers do): one that does not may
    not honour it, and reads need no ``open()``.

    Raises:
        CommandError: no such directory, or a file there (exit 3), or no tier for it
            (exit 2).
        LocationInUseError: another writer holds the location (``write``/``create``).
    """
    # Resolving looks at the file system (a marker file?) and loads the tier plugins.
    kind, arg, local = await asyncio.to_thread(_resolve, spec)
    tiers = available_tiers()
    factory = tiers.get(kind)
    if factory is None:
        raise CommandError(
            f"{spec}: no tier is registered as {kind!r} (entry point in 'lazyckpt.tiers'); "
            f"registered tiers: {sorted(tiers)}",
            EXIT_USAGE,
        )
    if local and not create and not await asyncio.to_thread(Path(arg).is_dir):
        what = "a file, not a directory" if await asyncio.to_thread(Path(arg).exists) else (
            "no such directory"
        )
        raise CommandError(f"{spec}: {what}", EXIT_NOT_FOUND)
    readonly = not (create or write)
    # a tier whose constructor takes readonly= honours it: opened so, it checks the location
    # (a missing one is SnapshotNotFoundError) and creates, deletes and locks nothing
    honours = readonly and _takes_readonly(factory)
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
    """:func:`open_location` as a context: the tier is closed on the way out."""
    location = await open_location(spec, create=create, write=write)
    try:
        yield location
    finally:
        await location.tier.aclose()


async def pick_steps(location: Location, step: int | None, *, every: bool = False) -> list[int]:
    """The committed steps a command works on: all, the one asked for, or the latest.

    Raises:
        SnapshotNotFoundError: the location has no committed snapshot (exit 3).
        CommandError: ``step`` is not committed there (exit 3).
    """
    steps = await location.tier.steps()
    newest = latest_step(steps, str(location))
    if every:
        return steps
    if step is None:
        return [newest]
    if step not in steps:
        shown = ", ".join(map(str, steps[-5:]))
        which = f"the newest 5 of {len(steps)}" if len(steps) > 5 else "committed steps"
        raise CommandError(
            f"{location}: step {step} is not committed ({which}: {shown})", EXIT_NOT_FOUND
        )
    return [step]
