"""The layout of a FileTier's root, and the survey ``open()`` makes of it: which step
directories a crash left uncommitted, which temporaries, and whether anything there says
that another store (or a person) wrote the location, in which case nothing is changed."""

from __future__ import annotations

import json
import re
from pathlib import Path

from lazyckpt.tier import ConfigurationError, ForeignLocationError

__all__ = [
    "LAYOUT_VERSION",
    "MANIFEST",
    "MARKER",
    "MARKER_FORMAT",
    "RETIRED",
    "STEP_DIR",
    "check_marker",
    "marker_document",
    "survey",
]

STEP_DIR = re.compile(r"^step-(\d{12})$")
MANIFEST = "manifest.json"
MARKER = "lazyckpt-file.json"  # what kind of location this is, and its format
MARKER_FORMAT = "lazyckpt-file"
LAYOUT_VERSION = 1
# the only names a file tier writes inside a step directory (temporaries: see _publish)
_STEP_FILE = re.compile(r"^(manifest\.json|retired|rank-\d{5}\.(data|json))$")
RETIRED = "retired"  # in a step directory deleted while committed steps refer to its data
_TEMP = re.compile(r"^(manifest|rank-\d{5}|lazyckpt-file)\.json\.\d+\.\d+\.tmp$")
_LOCK = re.compile(r"^\.lazyckpt-writer-rank-\d{5}\.lock$")
# what other stores leave at their root: a file tier never writes these
_FOREIGN_SIGNS = {
    "zarr.json": "a Zarr store (zarr.json; a ZarrTier location?)",
    ".zgroup": "a Zarr v2 store (.zgroup)",
    ".zarray": "a Zarr v2 array (.zarray)",
}


def survey(root: Path, *, writing: bool = True) -> tuple[bool, list[Path], list[Path]]:
    """What a file tier's root holds: whether it carries the marker, the uncommitted step
    directories a crash left, and the temporaries. Raises
    :class:`~lazyckpt.ForeignLocationError` when anything says this is not a file tier's
    location (nothing has been changed then). A reader (not ``writing``), which deletes
    nothing, only refuses what another store wrote, not files it merely does not know."""
    where = str(root)
    marked = False
    marker = root / MARKER
    if marker.exists():
        check_marker(marker)
        marked = True
    leftovers: list[Path] = []
    temps: list[Path] = []
    strangers: list[str] = []
    for entry in sorted(root.iterdir()):
        name = entry.name
        if name in _FOREIGN_SIGNS:
            raise ForeignLocationError(
                f"{root} holds {_FOREIGN_SIGNS[name]}, not a file tier's snapshots; "
                "nothing was changed. Open it with the tier that wrote it, or give "
                "FileTier another directory.",
                location=where,
            )
        if STEP_DIR.match(name) and entry.is_dir():
            try:
                names = sorted(p.name for p in entry.iterdir())
            except FileNotFoundError:  # a writer beside this reader removed it meanwhile
                continue
            temps += [entry / n for n in names if _TEMP.match(n)]
            foreign = [n for n in names if not _STEP_FILE.match(n) and not _TEMP.match(n)]
            if not writing:
                foreign = [n for n in foreign if n == "zarr.json"]
            if foreign:
                what = (
                    "a Zarr group (a ZarrTier location?)"
                    if "zarr.json" in foreign
                    else f"files a file tier never writes ({', '.join(foreign[:5])})"
                )
                raise ForeignLocationError(
                    f"{entry} holds {what}; nothing was changed. Open the location with "
                    "the tier that wrote it, or move that directory away.",
                    location=where,
                )
            if MANIFEST not in names:
                leftovers.append(entry)
        elif _TEMP.match(name):
            temps.append(entry)
        elif not (_LOCK.match(name) or name == MARKER):
            strangers.append(name)
    if strangers and not marked and writing:
        raise ForeignLocationError(
            f"{root} holds {', '.join(strangers[:5])}"
            f"{' and more' if len(strangers) > 5 else ''}, which a file tier did not "
            "write, and no lazyckpt-file.json marker; nothing was changed. Give FileTier "
            "an empty or new directory.",
            location=where,
        )
    return marked, leftovers, temps


def marker_document() -> bytes:
    return json.dumps({"format": MARKER_FORMAT, "version": LAYOUT_VERSION}).encode()


def check_marker(path: Path) -> None:
    """The marker must say "file tier", in a format this version reads."""
    try:
        doc = json.loads(path.read_bytes())
        kind, version = doc["format"], doc["version"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ForeignLocationError(
            f"{path} is not a file tier's marker ({exc!r:.100}); nothing was changed",
            location=str(path.parent),
        ) from None
    if kind != MARKER_FORMAT:
        raise ForeignLocationError(
            f"{path} marks a location of kind {kind!r}, not a file tier's; nothing was changed",
            location=str(path.parent),
        )
    if type(version) is not int or version > LAYOUT_VERSION:
        raise ConfigurationError(
            f"{path.parent} was written by a newer lazyckpt (file layout {version!r}, this "
            f"version reads up to {LAYOUT_VERSION}); upgrade lazyckpt"
        )
