"""DurableLocalStore: a Zarr v3 store over a local or Lustre directory whose writes survive a
crash.

zarr's own ``LocalStore`` writes a temporary file and renames it over the target, so a reader
never sees half an object, but it never calls ``fsync``: after a power loss a "written" chunk
may be empty or missing, and so may the rename. This store does the same dance and makes it
durable: the data is ``fdatasync``'d before the rename, the directory is ``fsync``'d after
it, and every directory created on the way is made durable in its parent.

Blocking file work runs on the store's own bounded thread pool, so the store is safe to
await from any event loop (it holds no loop-bound state) and to pickle. Listing a directory
and asking whether an object exists are small and go through aiofiles instead (the event
loop's executor): they never wait behind the chunk writes queued on that pool.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import secrets
import threading
from collections.abc import AsyncIterator, Callable, Iterable, MutableSet, Sequence
from pathlib import Path
from typing import Any, Self, TypeVar

import aiofiles.os
from zarr.abc.store import (
    ByteRequest,
    OffsetByteRequest,
    RangeByteRequest,
    Store,
    SuffixByteRequest,
)
from zarr.core.buffer import Buffer, BufferPrototype, default_buffer_prototype

from lazyckpt import hooks

from .._fs import fsync_dir, remove_tree

__all__ = ["DurableLocalStore"]

T = TypeVar("T")

# Temporary files are hidden and carry a random token; listings skip them, so a write that a
# crash interrupted never shows up as a key.
_TEMP = re.compile(r"^\..+\.[0-9a-f]{16}\.tmp$")
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _write_all(fd: int, parts: Sequence[memoryview]) -> None:
    for part in parts:
        while part:
            part = part[os.write(fd, part) :]


def _check_byte_range(byte_range: ByteRequest | None) -> None:
    if byte_range is not None and not isinstance(
        byte_range, RangeByteRequest | OffsetByteRequest | SuffixByteRequest
    ):
        raise TypeError(f"Unexpected byte_range, got {byte_range!r}")


def _window(size: int, byte_range: ByteRequest | None) -> tuple[int, int]:
    """The ``[start, stop)`` of an object of ``size`` bytes that ``byte_range`` asks for."""
    if byte_range is None:
        return 0, size
    if isinstance(byte_range, RangeByteRequest):
        return min(byte_range.start, size), min(max(byte_range.end, byte_range.start), size)
    if isinstance(byte_range, OffsetByteRequest):
        return min(byte_range.offset, size), size
    if isinstance(byte_range, SuffixByteRequest):
        return max(0, size - byte_range.suffix), size
    raise TypeError(f"Unexpected byte_range, got {byte_range!r}")


class DurableLocalStore(Store):
    """A Zarr v3 store in a local directory; every completed write is on disk.

    Keys map to files under ``root`` (``a/b/c`` is ``root/a/b/c``). A write goes to a hidden
    temporary file in the target's directory, is ``fdatasync``'d, renamed into place, and
    the directory is ``fsync``'d; directories created for it are made durable in their
    parents too. Keys that would leave ``root`` (``..``, absolute paths, NUL) are refused.

    Args:
        root: the directory; created when the store opens (unless read-only).
        read_only: refuse every write and delete.
        io_threads: threads running the blocking file calls.
    """

    def __init__(
        self, root: str | os.PathLike[str], *, read_only: bool = False, io_threads: int = 4
    ) -> None:
        super().__init__(read_only=read_only)
        if io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, got {io_threads}")
        self.root = Path(root)
        self.io_threads = io_threads
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # -- identity ------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DurableLocalStore) and self.root == other.root

    def __hash__(self) -> int:
        return hash((DurableLocalStore, self.root))

    def __repr__(self) -> str:
        return f"DurableLocalStore('{self.root}')"

    def __str__(self) -> str:
        return f"file://{self.root.as_posix()}"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_pool"] = None
        del state["_pool_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pool_lock = threading.Lock()

    def with_read_only(self, read_only: bool = False) -> Self:
        """A new, unopened store over the same directory with another ``read_only``."""
        return type(self)(self.root, read_only=read_only, io_threads=self.io_threads)

    @property
    def supports_writes(self) -> bool:
        return True

    @property
    def supports_deletes(self) -> bool:
        return True

    @property
    def supports_listing(self) -> bool:
        return True

    # -- life cycle ----------------------------------------------------------------------

    async def _open(self) -> None:
        await super()._open()
        if not self.read_only:
            await self._run(self.root.mkdir, parents=True, exist_ok=True)

    def close(self) -> None:
        """Close the store and stop its threads (a later call starts them again)."""
        super().close()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.io_threads, thread_name_prefix="lazyckpt-zarr-io"
                )
            pool = self._pool
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(pool, lambda: fn(*args, **kwargs))

    # -- keys and paths ------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        parts = key.split("/")
        if not key or "\0" in key or "\\" in key or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"invalid store key {key!r}: it must be a relative path inside root")
        return self.root.joinpath(*parts)

    def _prefix_dir(self, prefix: str) -> Path:
        prefix = prefix.strip("/")
        return self._path(prefix) if prefix else self.root

    # -- reading -------------------------------------------------------------------------

    def _read(self, key: str, byte_range: ByteRequest | None) -> bytearray | None:
        try:
            fd = os.open(self._path(key), os.O_RDONLY | _O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return None
        try:
            start, stop = _window(os.fstat(fd).st_size, byte_range)
            out = bytearray(stop - start)
            view = memoryview(out)
            done = 0
            while done < len(out):
                n = os.preadv(fd, [view[done:]], start + done)
                if n == 0:  # the file shrank under us: return what is there
                    del view
                    del out[done:]
                    break
                done += n
            return out
        finally:
            os.close(fd)

    async def get(
        self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None
    ) -> Buffer | None:
        """The bytes of ``key`` (or the requested range of them); ``None`` if it is absent."""
        _check_byte_range(byte_range)
        await self._ensure_open()
        data = await self._run(self._read, key, byte_range)
        return None if data is None else prototype.buffer.from_bytes(data)

    def get_sync(
        self,
        key: str,
        *,
        prototype: BufferPrototype | None = None,
        byte_range: ByteRequest | None = None,
    ) -> Buffer | None:
        """Blocking :meth:`get`, for callers outside an event loop."""
        _check_byte_range(byte_range)
        data = self._read(key, byte_range)
        if data is None:
            return None
        return (prototype or default_buffer_prototype()).buffer.from_bytes(data)

    async def get_partial_values(
        self,
        prototype: BufferPrototype,
        key_ranges: Iterable[tuple[str, ByteRequest | None]],
    ) -> list[Buffer | None]:
        """Several :meth:`get` calls at once."""
        return list(await asyncio.gather(*(self.get(k, prototype, r) for k, r in key_ranges)))

    def _read_into(self, key: str, out: memoryview) -> int:
        fd = os.open(self._path(key), os.O_RDONLY | _O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            want = min(size, len(out))
            done = 0
            while done < want:
                n = os.preadv(fd, [out[done:want]], done)
                if n == 0:
                    break
                done += n
            return size if done == want else done
        finally:
            os.close(fd)

    async def read_into(self, key: str, out: memoryview) -> int:
        """Read the start of ``key`` straight into ``out`` (no intermediate buffer).

        Returns the object's size; ``min(size, len(out))`` bytes of ``out`` were filled.
        Raises ``FileNotFoundError`` if ``key`` is absent.
        """
        await self._ensure_open()
        return await self._run(self._read_into, key, out)

    async def exists(self, key: str) -> bool:
        """Whether ``key`` holds an object (with aiofiles: off the bulk pool)."""
        found: bool = await aiofiles.os.path.isfile(self._path(key))
        return found

    async def getsize(self, key: str) -> int:
        """The size of ``key`` in bytes; ``FileNotFoundError`` if it is absent."""
        return await self._run(lambda: os.stat(self._path(key)).st_size)

    async def getsize_prefix(self, prefix: str) -> int:
        """The total size of every object whose key starts with ``prefix``."""

        def total() -> int:
            return sum(os.stat(self._path(k)).st_size for k in self._keys(prefix))

        return await self._run(total)

    # -- writing -------------------------------------------------------------------------

    def _changed(self, directory: Path, unpublished: MutableSet[str] | None) -> None:
        """A directory's entries changed: sync it now, or leave it to the caller."""
        if unpublished is None:
            fsync_dir(directory)
        else:
            rel = directory.relative_to(self.root).as_posix()
            unpublished.add("" if rel == "." else rel)

    def _make_dirs(self, directory: Path, unpublished: MutableSet[str] | None) -> None:
        missing: list[Path] = []
        d = directory
        while not d.is_dir():
            missing.append(d)
            if d.parent == d:
                break
            d = d.parent
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):
                d.mkdir()
            self._changed(d.parent, unpublished)  # the new entry must survive a crash too

    def _write(
        self,
        key: str,
        parts: Sequence[memoryview],
        *,
        exclusive: bool = False,
        unpublished: MutableSet[str] | None = None,
    ) -> None:
        path = self._path(key)
        directory = path.parent
        self._make_dirs(directory, unpublished)
        if unpublished is not None:
            # Nobody reads this key before the caller's own commit point, so it is written
            # in place; only its data is synced here, its directory entry at that point.
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC, 0o644)
            try:
                _write_all(fd, parts)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            self._changed(directory, unpublished)
            return
        tmp = directory / f".{path.name}.{secrets.token_hex(8)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644)
        try:
            try:
                _write_all(fd, parts)
                os.fdatasync(fd)
            finally:
                os.close(fd)
            if exclusive:
                try:
                    os.link(tmp, path)  # fails if the key exists: an atomic "create"
                except FileExistsError:
                    return
            else:
                os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        fsync_dir(directory)

    async def set(self, key: str, value: Buffer) -> None:
        """Store ``value`` at ``key``, atomically and durably."""
        self._check_writable()
        if not isinstance(value, Buffer):
            raise TypeError(f"DurableLocalStore.set takes a zarr Buffer, got {type(value)}")
        await self._ensure_open()
        await self._run(self._write, key, [memoryview(value.as_buffer_like()).cast("B")])

    def set_sync(self, key: str, value: Buffer) -> None:
        """Blocking :meth:`set`."""
        self._check_writable()
        self._write(key, [memoryview(value.as_buffer_like()).cast("B")])

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        """Store ``value`` at ``key`` unless ``key`` exists (atomic: two writers, one wins)."""
        self._check_writable()
        await self._ensure_open()
        await self._run(
            self._write, key, [memoryview(value.as_buffer_like()).cast("B")], exclusive=True
        )

    async def write_parts(
        self, key: str, parts: Sequence[memoryview], *, unpublished: MutableSet[str] | None = None
    ) -> None:
        """Like :meth:`set`, with the object given as consecutive pieces (written without
        joining them: one copy fewer for large chunks).

        With ``unpublished`` (for a writer with a commit point of its own, such as
        ``ZarrTier``), the object is written in place instead of through a temporary name,
        its data is synced before this returns, and the directories whose entries changed
        are added to ``unpublished`` rather than synced: pass them to
        :meth:`sync_directories` before publishing anything that points to the object. A
        snapshot's directories are then synced once each instead of once per object.
        """
        self._check_writable()
        await self._ensure_open()
        await self._run(self._write, key, parts, unpublished=unpublished)

    async def sync_directories(self, directories: Iterable[str]) -> None:
        """``fsync`` each directory (keys relative to root; ``""`` is root itself)."""
        await asyncio.gather(
            *(self._run(fsync_dir, self._prefix_dir(d)) for d in sorted(set(directories)))
        )

    # -- deleting ------------------------------------------------------------------------

    def _delete(self, key: str) -> None:
        path = self._path(key)
        if path.is_dir():
            remove_tree(path)
        else:
            try:
                path.unlink()
            except (FileNotFoundError, NotADirectoryError):
                return
        fsync_dir(path.parent)

    async def delete(self, key: str) -> None:
        """Remove ``key``; absent keys are fine."""
        self._check_writable()
        await self._run(self._delete, key)

    def delete_sync(self, key: str) -> None:
        """Blocking :meth:`delete`."""
        self._check_writable()
        self._delete(key)

    def _delete_dir(self, prefix: str) -> None:
        directory = self._prefix_dir(prefix)
        if directory == self.root:
            if not self.root.is_dir():
                return
            for entry in self.root.iterdir():
                if entry.is_dir() and not entry.is_symlink():
                    remove_tree(entry)
                else:
                    entry.unlink(missing_ok=True)
            fsync_dir(self.root)
            return
        if directory.is_dir():
            # Another delete of the same prefix may be removing it right now (and may even
            # finish first): whatever it removed is gone either way.
            hooks.point("zarr.delete_dir.before_remove")
            remove_tree(directory)
            fsync_dir(directory.parent)

    async def delete_dir(self, prefix: str) -> None:
        """Remove every key under ``prefix/``; another delete of the same prefix running at
        the same time (and removing keys under this one) is fine."""
        self._check_writable()
        await self._run(self._delete_dir, prefix)

    def _remove_empty_dir(self, prefix: str) -> bool:
        directory = self._prefix_dir(prefix)
        if directory == self.root:
            return False
        try:
            directory.rmdir()
        except OSError:  # not empty (someone still writes under it), or already gone
            return False
        fsync_dir(directory.parent)
        return True

    async def remove_empty_dir(self, prefix: str) -> bool:
        """Remove the directory of ``prefix`` if nothing is left in it (atomic: a directory
        that another writer filled in the meantime stays). Whether it was removed."""
        self._check_writable()
        return await self._run(self._remove_empty_dir, prefix)

    # -- listing -------------------------------------------------------------------------

    def _keys(self, prefix: str) -> list[str]:
        # Walk only the deepest directory that can hold keys starting with ``prefix``.
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self._prefix_dir(head)
        if not start.is_dir():
            return []
        found = []
        for dirpath, _dirs, files in os.walk(start):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if _TEMP.match(name):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    found.append(key)
        return found

    async def list(self) -> AsyncIterator[str]:
        """Every key in the store."""
        for key in await self._run(self._keys, ""):
            yield key

    async def list_prefix(self, prefix: str) -> AsyncIterator[str]:
        """Every key that starts with ``prefix``."""
        for key in await self._run(self._keys, prefix):
            yield key

    async def list_dir(self, prefix: str) -> AsyncIterator[str]:
        """The names (objects and sub-prefixes) directly under ``prefix``: one directory
        read, with aiofiles (off the bulk pool, like the metadata reads)."""
        try:
            names = await aiofiles.os.listdir(self._prefix_dir(prefix))
        except (FileNotFoundError, NotADirectoryError):
            return
        for name in names:
            if not _TEMP.match(name):
                yield name
