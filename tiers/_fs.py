"""File-system helpers shared by the tiers that write to a local or parallel file system."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import aiofiles

from lazyckpt.tier import LocationInUseError

__all__ = ["WriterLock", "fsync_dir", "lock_name", "read_small", "remove_flat", "remove_tree"]

log = logging.getLogger("lazyckpt")

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a create, a rename, an unlink) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def read_small(path: Path) -> bytes:
    """The whole of a small file (a manifest, a commit record, a marker), read with aiofiles.

    aiofiles runs on the event loop's own executor, not on a tier's bounded I/O pool: a
    manifest read or an index read never queues behind the multi-MiB writes of a snapshot
    in flight. Raises the ``OSError`` the read raised (``FileNotFoundError`` when absent).
    """
    # a read cancelled while the executor opens the file would lose the file object the
    # open still returns (an unclosed file, reported when it is collected): the open is
    # shielded, and a file it opens for a cancelled read is closed when it arrives
    opening: asyncio.Future[Any] = asyncio.ensure_future(aiofiles.open(path, "rb"))
    try:
        f = await asyncio.shield(opening)
    except asyncio.CancelledError:
        opening.add_done_callback(_close_orphan)
        raise
    try:
        data: bytes = await f.read()
    finally:
        await f.close()
    return data


_closing: set[asyncio.Task[None]] = set()  # held until done (the loop keeps weak references)


def _close_orphan(opening: asyncio.Future[Any]) -> None:
    """Close the file an open shielded from a cancelled :func:`read_small` returned."""
    if opening.cancelled() or opening.exception() is not None:
        return
    task = asyncio.ensure_future(opening.result().close())
    _closing.add(task)
    task.add_done_callback(_closing.discard)


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


def remove_flat(path: Path) -> None:
    """Remove a directory that should hold only files (a file tier's step directory), as
    :func:`remove_tree` does, with fewer calls: one listing, one ``unlink`` per file and one
    ``rmdir``, where ``shutil.rmtree`` makes about ten calls more (each releases the
    interpreter lock and takes it back, which a launch-bound training thread pays for). A
    subdirectory, or anything else ``unlink`` refuses, hands the rest to
    :func:`remove_tree`; what vanishes meanwhile is already done, not an error."""
    root = str(path)
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    for name in names:
        try:
            os.unlink(os.path.join(root, name))
        except FileNotFoundError:
            continue
        except OSError as exc:
            if exc.errno not in (errno.EISDIR, errno.EPERM):
                raise
            remove_tree(path)  # not a flat directory after all
            return
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(root)


def lock_name(rank: int) -> str:
    """The lock file of one rank's writer (a single-process writer is rank 0)."""
    return f".lazyckpt-writer-rank-{rank:05d}.lock"


# what a file system without working flock answers (some NFS or FUSE mounts)
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class WriterLock:
    """One writer per location: an advisory ``flock`` on a file, held while the writer lives.

    The kernel releases it when the process exits or is killed, so a dead writer never blocks
    the next one. The file records who holds it (process id, host, since when) for the error
    a second writer gets; the file itself stays (removing it would let a third process lock a
    new file while the second still holds the old one). Readers never take it.

    Args:
        path: the lock file.
        location: what the error names (the tier's root or location).
    """

    def __init__(self, path: Path, location: str) -> None:
        self.path = path
        self.location = location
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise :class:`~lazyckpt.LocationInUseError` naming the holder."""
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            who = (
                f"process {holder.get('pid')} on host {holder.get('host')!r} since "
                f"{holder.get('since')}"
                if holder
                else "another process"
            )
            raise LocationInUseError(
                f"{self.location} is being written by {who} (lock {self.path}): two writers on "
                "one location corrupt each other. Stop the other writer or use another "
                "location; restoring and the lazyckpt command line can read beside it.",
                location=self.location,
                holder=holder,
            ) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _NO_FLOCK:
                raise
            log.warning(
                "%s: this file system has no working flock (%s); a second writer on this "
                "location would not be stopped",
                self.location,
                exc.strerror,
            )
            return
        holder_doc = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder_doc).encode() + b"\n", 0)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        """Let the next writer in (closing the descriptor drops the flock)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _read_holder(fd: int) -> dict[str, object] | None:
    try:
        doc = json.loads(os.pread(fd, 4096, 0))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
