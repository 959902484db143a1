"""File-system helpers shared by the tiers that write to a local or parallel file system."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = ["fsync_dir", "remove_tree"]

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a create, a rename, an unlink) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_tree(path: Path) -> None:
    """``shutil.rmtree`` for a tree that someone else may be removing at the same time (a
    second delete of the same step): what vanishes under it is already done, not an error;
    every other failure is raised."""
    if sys.version_info >= (3, 12):

        def onexc(func: Any, name: str, exc: BaseException) -> None:
            if not isinstance(exc, FileNotFoundError):
                raise exc

        shutil.rmtree(path, onexc=onexc)
    else:

        def onerror(func: Any, name: str, info: Any) -> None:
            if not issubclass(info[0], FileNotFoundError):
                raise info[1]

        shutil.rmtree(path, onerror=onerror)
