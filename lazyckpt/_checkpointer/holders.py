"""Which Checkpointers of this process are open, and where each was opened: what a
:class:`~lazyckpt.LocationInUseError` names when the writer holding a location is this very
process (a notebook that opens a second Checkpointer on a location without closing the
first, or a framework integration's object still holding it).

A tier's lock records the holder's process id and host; when they are this process's, the
error raised by the tier is replaced by one that says so, names where the holding
Checkpointer was opened (the first caller outside lazyckpt and the installed packages,
captured at ``open()``: the notebook cell or the script line) and through which
integration object, and says how to release it (its ``close()``) or to read beside it
(a read-only tier)."""

from __future__ import annotations

import os
import socket
import sys
import sysconfig
import weakref
from dataclasses import dataclass
from typing import Any

from .._errors import LocationInUseError

__all__ = ["explain_in_use", "forget", "open_site", "opened"]


@dataclass(frozen=True)
class OpenSite:
    """Where a Checkpointer was opened: ``where`` as ``file:line in function``, and ``via``
    the integration object that opened it (``"LazyCheckpointIO"``), if any."""

    where: str
    via: str | None

    def __str__(self) -> str:
        return f"by a {self.via}, at {self.where}" if self.via else f"at {self.where}"


# the open cores (weakly: one collected is gone) and where each was opened
_OPEN: weakref.WeakKeyDictionary[Any, OpenSite] = weakref.WeakKeyDictionary()
_LIBRARY_DIRS: tuple[str, ...] | None = None


def _library_dirs() -> tuple[str, ...]:
    """The directories of the standard library and the installed packages."""
    global _LIBRARY_DIRS
    if _LIBRARY_DIRS is None:
        paths = sysconfig.get_paths()
        found = {
            os.path.join(os.path.realpath(paths[k]), "")
            for k in ("stdlib", "platstdlib", "purelib", "platlib")
            if paths.get(k)
        }
        _LIBRARY_DIRS = tuple(sorted(found))
    return _LIBRARY_DIRS


_IN_LIBRARY: dict[str, bool] = {}


def _in_library(filename: str) -> bool:
    """Whether a frame's file is frozen, in the standard library or an installed package."""
    known = _IN_LIBRARY.get(filename)
    if known is None:
        known = filename.startswith("<frozen") or os.path.realpath(filename).startswith(
            _library_dirs()
        )
        if len(_IN_LIBRARY) < 4096:
            _IN_LIBRARY[filename] = known
    return known


def _ours(module: str) -> bool:
    return module == "lazyckpt" or module.startswith("lazyckpt.")


def open_site() -> OpenSite:
    """Where the caller of a facade's ``open()`` is: the first frame outside lazyckpt that
    is not in the standard library or an installed package (the user's line, past a
    framework's own frames), else the first frame outside lazyckpt."""
    frame = sys._getframe(1)
    via: str | None = None
    while frame is not None and _ours(frame.f_globals.get("__name__", "")):
        module = frame.f_globals.get("__name__", "")
        if module.startswith("lazyckpt.integrations."):
            owner = frame.f_locals.get("self")
            if owner is not None and type(owner).__module__ == module:
                via = type(owner).__name__  # the outermost: the object the user holds
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return OpenSite("an unknown place", via)
    first = frame
    while frame is not None and _in_library(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
    chosen = frame if frame is not None else first
    code = chosen.f_code
    return OpenSite(f"{code.co_filename}:{chosen.f_lineno} in {code.co_name}", via)


def opened(core: Any, site: OpenSite) -> None:
    """Record an open Checkpointer's core and where it was opened."""
    _OPEN[core] = site


def forget(core: Any) -> None:
    """The core is closed."""
    _OPEN.pop(core, None)


def _normal(location: object) -> str:
    text = os.fspath(location) if isinstance(location, os.PathLike) else str(location)
    if "://" in text:
        return text.rstrip("/")
    return os.path.realpath(text)


def _locations(tier: Any, depth: int = 0) -> set[str]:
    """What ``tier`` may name as its location in a LocationInUseError: its ``location``
    and ``root`` attributes and the strings of its ``describe()``, and those of a tier it
    wraps (``inner``)."""
    found: set[str] = set()
    for attr in ("location", "root"):
        value = getattr(tier, attr, None)
        if isinstance(value, str | os.PathLike) and str(value):
            found.add(_normal(value))
    try:
        described = tier.describe()
    except Exception:
        described = {}
    for key, value in described.items():
        if key not in ("name", "type", "level") and isinstance(value, str) and value:
            found.add(_normal(value))
    inner = getattr(tier, "inner", None)
    if inner is not None and depth < 4:
        found |= _locations(inner, depth + 1)
    return found


def _holds(core: Any, location: str) -> bool:
    try:
        tiers = list(core.engine.tiers)
    except Exception:
        return False
    return any(location in _locations(t) for t in tiers)


def explain_in_use(exc: LocationInUseError, me: Any) -> LocationInUseError:
    """``exc`` itself when another process holds its location; when this process does, a
    new error that says so, names where the holding Checkpointer was opened and says how to
    let go of it (raise it ``from exc``). ``me``: the core whose open failed."""
    holder = exc.holder or {}
    if holder.get("pid") != os.getpid() or holder.get("host") not in (None, socket.gethostname()):
        return exc
    location = _normal(exc.location)
    others = [
        (core, site)
        for core, site in list(_OPEN.items())
        if core is not me and not getattr(core.engine, "closed", False)
    ]
    holding = [site for core, site in others if _holds(core, location)]
    release = (
        "first (its close(), or the end of its 'with' block; a "
        "LazyCheckpointIO or LazyCheckpointCallback closes its tiers at the end of each fit "
        "or train, and with close()), or, to read the steps meanwhile, open this one "
        "read-only: FileTier(path, readonly=True) or ZarrTier(location, readonly=True) takes "
        "no lock"
    )
    if holding:
        where = "; ".join(str(s) for s in holding)
        message = (
            f"{exc.location} is already opened by this process: a Checkpointer opened "
            f"{where} is still open and writes there, and a location has one writer at a "
            f"time. Close that Checkpointer {release}."
        )
    else:
        listing = (
            " (those open were opened " + "; ".join(str(s) for _, s in others) + ")"
            if others
            else ""
        )
        message = (
            f"{exc.location} is already opened by this process, though by none of the "
            f"Checkpointers it has open{listing}: by a tier opened on its own, or by a "
            "Checkpointer dropped without close() whose close is still draining. A location "
            f"has one writer at a time. Close the writer {release}."
        )
    return LocationInUseError(message, location=exc.location, holder=exc.holder)
